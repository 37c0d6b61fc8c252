"""Faults of ``data build`` found by trying it as a new user would (issue 34): a build never
writes over a directory it does not own (nor into one another build is writing), never reads
its own output, refuses shard sizes that are not finite and positive, and starts no more
workers than it has shards to build; a rebuild with other options equals a fresh build."""

from __future__ import annotations

import fcntl
import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
from helpers import write_chatml_tokenizer

from transformer_jax.cli import data as data_cli
from transformer_jax.data import build as build_lib
from transformer_jax.data import shards
from transformer_jax.data.sources import BadInput
from transformer_jax.tokenizer import load_tokenizer

WORDS = [f"w{i}" for i in range(20)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """``root/text``: 8 text files of one document each (about 60 bytes), and a tokenizer."""
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    (root / "text").mkdir()
    for i in range(8):
        words = rng.choice(WORDS, int(rng.integers(3, 20)))
        (root / "text" / f"{i}.txt").write_text(" ".join(words))
    tok_dir = write_chatml_tokenizer(root / "tok", WORDS)
    return {"root": root, "text": root / "text", "tok_dir": tok_dir,
            "tokenizer": load_tokenizer(tok_dir)}


def _files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file()}


def _tokens(directory: Path, split: str) -> list[list[int]]:
    stream = shards.TokenStream.open([directory], split)
    if not stream.num_tokens:
        return []
    tokens, docs = stream.read([0], stream.num_tokens)
    return [tokens[0][docs[0] == d].tolist() for d in np.unique(docs[0])]


def _build(corpus, out, **options):
    overwrite = options.pop("overwrite", False)
    kw = {"overwrite": True} if overwrite else {}
    return build_lib.build([str(corpus["text"])], out, corpus["tokenizer"], progress=False,
                           options=build_lib.BuildOptions(**{"shard_bytes": 200, **options}), **kw)


def _user_dir(directory: Path) -> dict[str, bytes]:
    """The issue's directory that is not a build: a metadata.json, a tokenizer config and a
    hidden ``.tmp`` file of the user's."""
    (directory / "tokenizer").mkdir(parents=True)
    (directory / "metadata.json").write_text('{"my": 1}\n')
    (directory / ".report.tmp").write_text("x\n")
    (directory / "tokenizer" / "tokenizer_config.json").write_text("{}\n")
    return _files(directory)


def test_a_directory_that_is_not_a_build_needs_overwrite(corpus, tmp_path, capsys):
    out = tmp_path / "d"
    before = _user_dir(out)
    with pytest.raises(FileExistsError, match=r"not a shard build's .*--overwrite"):
        _build(corpus, out)
    assert _files(out) == before  # nothing written over, nothing deleted
    args = ["build", "--input", str(corpus["text"]), "--out", str(out), "--tokenizer",
            str(corpus["tok_dir"]), "--no-progress"]
    assert data_cli.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--overwrite" in err[0] and str(out) in err[0]
    assert _files(out) == before
    # With --overwrite the build's own names are replaced; the user's other files are kept.
    assert data_cli.main([*args, "--overwrite"]) == 0
    assert (out / ".report.tmp").read_text() == "x\n"
    assert shards.read_metadata(out)["format"] == build_lib.FORMAT
    assert load_tokenizer(out / "tokenizer").fingerprint == corpus["tokenizer"].fingerprint
    assert (out / "tokenizer" / "tokenizer_config.json").read_text() != "{}\n"


def test_a_finished_build_of_other_options_needs_overwrite(corpus, tmp_path):
    out = tmp_path / "d"
    _build(corpus, out, val_fraction=0.2)
    before = _files(out)
    with pytest.raises(FileExistsError, match=r"other options \(val_fraction 0.2 -> 0.5\).*"
                                              r"--overwrite"):
        _build(corpus, out, val_fraction=0.5)
    assert _files(out) == before
    # The same build again is no change and needs no --overwrite.
    _build(corpus, out, val_fraction=0.2)
    assert _files(out) == before


@pytest.mark.parametrize("change", [{"val_fraction": 0.4}, {"add_bos": True},
                                    {"add_eos": False}, {"val_fraction": 0.4, "add_bos": True},
                                    {"shard_bytes": 10**6}])
def test_a_rebuild_with_other_options_equals_a_fresh_build(corpus, tmp_path, change):
    # Options A, then B (one option or two changed; or one shard, not several, and none left
    # of A's beyond it) over it; against B into an empty directory.
    a = {"val_fraction": 0.0, "add_bos": False, "add_eos": True}
    b = {**a, **change}
    rebuilt, fresh = tmp_path / "rebuilt", tmp_path / "fresh"
    _build(corpus, rebuilt, **a)
    meta = _build(corpus, rebuilt, overwrite=True, **b)
    fresh_meta = _build(corpus, fresh, **b)
    strip = ("build_tokens", "build_seconds")
    assert {k: v for k, v in meta.items() if k not in strip} == {
        k: v for k, v in fresh_meta.items() if k not in strip}
    assert shards.read_metadata(rebuilt) == shards.read_metadata(fresh)
    for split in build_lib.SPLITS:
        assert _tokens(rebuilt, split) == _tokens(fresh, split)
    train = _tokens(fresh, "train")
    assert bool(_tokens(fresh, "val")) == (b["val_fraction"] > 0)
    assert all((doc[0] == corpus["tokenizer"].bos_id) == b["add_bos"] for doc in train)
    assert all((doc[-1] == corpus["tokenizer"].eos_id) == b["add_eos"] for doc in train)
    assert _files(rebuilt) == _files(fresh)


def test_a_second_build_into_the_same_out_at_once_is_refused(corpus, tmp_path):
    out = tmp_path / "d"
    out.mkdir()
    # Another build holds the directory and is writing a shard.
    other = os.open(out, os.O_RDONLY)
    fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    (out / ".train-00000.arrayrecord.tmp4242").write_bytes(b"half a shard")
    try:
        with pytest.raises(FileExistsError, match="another build is writing into it"):
            _build(corpus, out)
        assert (out / ".train-00000.arrayrecord.tmp4242").exists()
    finally:
        os.close(other)
    # Once it has ended (its lock dropped, as on kill -9) its temporary files are stale.
    _build(corpus, out)
    assert not (out / ".train-00000.arrayrecord.tmp4242").exists()
    # The lock is let go after a build, and after one that fails.
    (tmp_path / "bin.txt").write_bytes(b"\0binary\0")
    bad = tmp_path / "bad"
    with pytest.raises(BadInput):
        build_lib.build([str(tmp_path / "bin.txt")], bad, corpus["tokenizer"], progress=False)
    for directory in (out, bad):
        fd = os.open(directory, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free
        finally:
            os.close(fd)


def test_a_build_leaves_its_out_out_of_its_inputs(corpus, tmp_path, caplog):
    c2 = tmp_path / "c2"
    c2.mkdir()
    for f in corpus["text"].iterdir():
        (c2 / f.name).write_bytes(f.read_bytes())
    out = c2 / "shards"
    args = ["build", "--input", str(c2), "--out", str(out), "--tokenizer",
            str(corpus["tok_dir"]), "--no-progress"]
    assert data_cli.main(args) == 0
    first = _files(out)
    with caplog.at_level(logging.INFO):
        assert data_cli.main(args) == 0  # not its own shards, tokenizer nor metadata
    assert "out of the inputs" in caplog.text and str(out) in caplog.text
    assert _files(out) == first
    sources = [s["path"] for s in shards.read_metadata(out)["sources"]]
    assert sources == [str((c2 / f"{i}.txt").resolve()) for i in range(8)]
    # Nor does a tokenizer trained on the inputs read them.
    tok = build_lib.resolve_tokenizer("char", [str(c2)], 64, str(tmp_path / "cache"),
                                      exclude=[out])
    texts = build_lib.resolve_tokenizer("char", [str(c2 / "*.txt")], 64, str(tmp_path / "cache"))
    assert tok.fingerprint == texts.fingerprint
    with pytest.raises(FileNotFoundError, match="left out of the inputs"):
        build_lib.build([str(out)], out, corpus["tokenizer"], progress=False)


@pytest.mark.parametrize("mb", ["0", "-1", "inf", "nan", "1e308", "x"])
def test_shard_sizes_must_be_finite_and_positive(corpus, tmp_path, capsys, mb):
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("w1 w2")
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        data_cli.main(["build", "--input", str(tiny), "--out", str(out), "--tokenizer",
                       str(corpus["tok_dir"]), "--shard-mb", mb, "--no-progress"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--shard-mb" in err and (mb == "x" or "above 0" in err)
    assert not out.exists()


@pytest.mark.parametrize("size", [0, -1, float("inf"), float("nan"), 1.5, True])
def test_shard_bytes_must_be_a_positive_whole_number(size):
    with pytest.raises(ValueError, match="shard_bytes must be"):
        build_lib.BuildOptions(shard_bytes=size)


class _Pools:
    """A stand-in for ``multiprocessing.get_context``: records each pool's size and runs its
    tasks in this process."""

    def __init__(self):
        self.sizes: list[int] = []

    def __call__(self, method):
        assert method == "spawn"
        return self

    def Pool(self, processes, initializer, initargs):  # noqa: N802 - multiprocessing's name
        self.sizes.append(processes)
        initializer(*initargs)
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def imap_unordered(self, fn, tasks):
        return map(fn, tasks)


def test_workers_are_capped_at_the_shards_to_build(corpus, tmp_path, monkeypatch, caplog):
    pools = _Pools()
    monkeypatch.setattr(build_lib.multiprocessing, "get_context", pools)
    one = tmp_path / "one.txt"
    one.write_text("w1 w2 w3")
    with caplog.at_level(logging.INFO):
        build_lib.build([str(one)], tmp_path / "a", corpus["tokenizer"], workers=16,
                        progress=False)
    assert pools.sizes == []  # one shard: built in this process
    assert "1 worker(s) (--workers 16: one per shard to build)" in caplog.text
    meta = build_lib.build([str(corpus["text"])], tmp_path / "b", corpus["tokenizer"],
                           workers=16, progress=False,
                           options=build_lib.BuildOptions(shard_bytes=200))
    assert pools.sizes == [len(meta["shards"])] and 1 < len(meta["shards"]) < 16
    # A finished build run again has nothing to build: no pool at all.
    build_lib.build([str(corpus["text"])], tmp_path / "b", corpus["tokenizer"], workers=16,
                    progress=False, options=build_lib.BuildOptions(shard_bytes=200))
    assert pools.sizes == [len(meta["shards"])]
    with pytest.raises(ValueError, match="workers must be a whole number >= 1"):
        build_lib.build([str(one)], tmp_path / "c", corpus["tokenizer"], workers=0)


def test_a_build_killed_while_it_claimed_its_out_is_continued(corpus, tmp_path):
    """Only the marker's temporary file (a kill while the build wrote it) counts as empty."""
    out = tmp_path / "d"
    out.mkdir()
    (out / "..build.json.abc123.tmp").write_text("{")
    _build(corpus, out)
    assert not (out / "..build.json.abc123.tmp").exists()
    assert json.loads((out / build_lib.MARKER).read_text())["format"] == build_lib.FORMAT
