"""``python -m transformer_jax.data build``: inputs of every kind -> shards, the held-out split
by document, resuming a build killed with SIGKILL, and bad inputs named in one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import write_chatml_tokenizer

from transformer_jax.cli import data as data_cli
from transformer_jax.data import build as build_lib
from transformer_jax.data import shards
from transformer_jax.data.sources import BadInput
from transformer_jax.tokenizer import load_tokenizer

WORDS = [f"w{i}" for i in range(40)]
ROOT = Path(__file__).resolve().parent.parent


def _docs(rng: np.random.Generator, n: int) -> list[str]:
    return [" ".join(rng.choice(WORDS, rng.integers(1, 30))) for _ in range(n)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Text files (one document each), a jsonl file, a parquet file and a saved dataset."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    docs: dict[str, list[str]] = {}
    text = root / "text"
    text.mkdir()
    for i in range(12):
        (doc,) = _docs(rng, 1)
        (text / f"{i:02d}.txt").write_text(doc)
        docs[f"text/{i:02d}"] = [doc]
    docs["jsonl"] = _docs(rng, 60)
    (root / "a.jsonl").write_text("".join(json.dumps({"text": d, "id": i}) + "\n"
                                          for i, d in enumerate(docs["jsonl"])))
    docs["parquet"] = _docs(rng, 40)
    pq.write_table(pa.table({"body": docs["parquet"]}), root / "b.parquet", row_group_size=10)
    docs["hf"] = _docs(rng, 30)
    datasets.Dataset.from_dict({"body": docs["hf"]}).save_to_disk(str(root / "hf"))
    tokenizer = load_tokenizer(write_chatml_tokenizer(root / "tok", WORDS))
    return {"root": root, "docs": docs, "tokenizer": tokenizer}


def _files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file()}


def _split_docs(directory: Path, split: str, tokenizer) -> list[str]:
    stream = shards.TokenStream.open([directory], split)
    tokens, docs = stream.read([0], stream.num_tokens)
    return [tokenizer.decode(tokens[0][docs[0] == d][:-1]) for d in np.unique(docs[0])]


def test_every_kind_is_read_and_held_out_by_document(corpus, tmp_path):
    root, tok = corpus["root"], corpus["tokenizer"]
    opts = build_lib.BuildOptions(field="text", val_fraction=0.2, shard_bytes=300)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes-00007.txt").write_text("not the build's")  # never removed as a stale shard
    # A directory holding other files is built into only with overwrite, which still replaces
    # only the build's own files.
    meta = build_lib.build([str(root / "text"), str(root / "a.jsonl")], out, tok, options=opts,
                           progress=False, overwrite=True)
    assert (out / "notes-00007.txt").read_text() == "not the build's"
    meta2 = build_lib.build([str(root / "b.parquet"), str(root / "hf")], tmp_path / "out2", tok,
                            options=build_lib.BuildOptions(field="body", val_fraction=0.2,
                                                           shard_bytes=300), progress=False)
    assert len(meta["shards"]) > 2  # the jsonl file is cut into pieces at byte offsets
    assert meta["tokenizer"]["fingerprint"] == shards.read_metadata(out)["tokenizer"][
        "fingerprint"]
    # Sources in path order: a.jsonl, text/ and b.parquet, hf/.
    for directory, kinds in ((out, ["jsonl", "text"]), (tmp_path / "out2", ["parquet", "hf"])):
        expected = [d for kind in kinds for key, docs in corpus["docs"].items()
                    if key.split("/")[0] == kind for d in docs]
        train = _split_docs(directory, "train", tok)
        val = _split_docs(directory, "val", tok)
        # Every document once, whole, in input order; the split is by document.
        assert sorted(train + val) == sorted(expected)
        assert train == [d for d in expected if not build_lib.is_held_out(d, 0.2)]
        assert 0 < len(val) < len(train)
    for m in (meta, meta2):
        assert m["train_tokens"] == sum(s["train_tokens"] for s in m["shards"])
        assert m["train_docs"] + m["val_docs"] == sum(
            len(d) for k, d in corpus["docs"].items()
            if k.split("/")[0] in {s["kind"] for s in m["sources"]})


_SLOW_BUILD = """
import sys, time
from transformer_jax.cli import data as data_cli
from transformer_jax.data import sources
documents = sources.documents
def slow(piece, *a):
    for d in documents(piece, *a):
        time.sleep(0.004)
        yield d
sources.documents = slow
sys.exit(data_cli.main(sys.argv[1:]))
"""


def test_a_build_killed_and_run_again_equals_an_uninterrupted_one(corpus, tmp_path):
    root = corpus["root"]
    args = ["build", "--input", str(root / "a.jsonl"), str(root / "text"), "--tokenizer",
            str(root / "tok"), "--shard-mb", "0.0005", "--val-fraction", "0.1",
            "--no-progress"]
    whole = tmp_path / "whole"
    assert data_cli.main([*args, "--out", str(whole)]) == 0
    killed = tmp_path / "killed"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_BUILD, *args, "--out", str(killed)],
                            env=env, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not (killed / "shard-00001.json").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)  # mid-way: a later shard's files are being written
    proc.wait()
    partial = _files(killed)
    assert "metadata.json" not in partial and "shard-00001.json" in partial
    assert any(".tmp" in name for name in partial)  # killed while writing a shard
    assert data_cli.main([*args, "--out", str(killed)]) == 0
    assert _files(killed) == _files(whole)
    assert shards.read_metadata(whole)["val_docs"] > 0


def test_bad_inputs_are_named_in_one_line(corpus, tmp_path, capsys):
    root, tok = corpus["root"], corpus["tokenizer"]
    (tmp_path / "bin.txt").write_bytes(b"\x00\x01binary\x00")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "nofield.jsonl").write_text('{"text": "w1"}\n{"body": "w2"}\n')
    out = tmp_path / "out"
    with pytest.raises(BadInput, match=r"bin.txt: a binary file"):
        build_lib.build([str(tmp_path / "bin.txt"), str(root / "a.jsonl")], out, tok,
                        progress=False)
    with pytest.raises(BadInput, match=r"nofield.jsonl:byte 15: no field 'text' \(has: body\)"):
        build_lib.build([str(tmp_path / "nofield.jsonl")], out, tok, progress=False)
    with pytest.raises(BadInput, match=r"b.parquet: no column 'text' \(columns: body\)"):
        build_lib.build([str(root / "b.parquet")], out, tok, progress=False)
    code = data_cli.main(["build", "--input", str(tmp_path / "empty.txt"), "--out", str(out),
                           "--tokenizer", str(root / "tok")])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is empty" in err[0] and "empty.txt" in err[0]
    # --skip-bad: the bad file is left out and named in the metadata.
    meta = build_lib.build([str(tmp_path / "bin.txt"), str(root / "a.jsonl")], out, tok,
                           options=build_lib.BuildOptions(skip_bad=True), progress=False)
    assert len(meta["skipped"]) == 1 and "bin.txt: a binary file" in meta["skipped"][0]
    assert meta["train_docs"] + meta["val_docs"] == len(corpus["docs"]["jsonl"])
