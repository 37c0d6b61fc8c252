"""Faults of training from shard builds (issue 34): a damaged shard set fails before anything
compiles, in one line naming the file; a mixture's validation loss is the weighted mean of its
sources' (whatever their order), a source smaller than one eval batch is evaluated on what it
has; mixture weights that are not finite are refused naming ``data.mixture``. And two
properties: the segment ids of packed rows start at 1 and never are 0 on a token (0 is
padding), and the eval rows of P processes, put together, are the one process's."""

from __future__ import annotations

import json
import logging
import shutil
import types
from pathlib import Path

import numpy as np
import pytest
from helpers import TINY, write_chatml_tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st

from transformer_jax.data import batches as data_lib
from transformer_jax.data import build as build_lib
from transformer_jax.data import shards
from transformer_jax.data.instruct import pack, packed_eval_batches, packed_layout
from transformer_jax.data.instruct_records import Example
from transformer_jax.tokenizer import load_tokenizer
from transformer_jax.train import run as training
from transformer_jax.train import validation
from transformer_jax.train.config import ConfigError, DataConfig, TrainConfig, build_configs
from transformer_jax.train.data import RunData, prepare_shard_data

SEQ = 16
WORDS = [f"w{i}" for i in range(60)]
FIRST_WORD = 5  # the tokenizer's specials come first
# Each source's words: a row's largest token id names its source.
SOURCE_WORDS = {"a": WORDS[:20], "b": WORDS[20:40], "c": WORDS[40:]}


def _build(root, name, docs, tokenizer, val_fraction):
    (root / f"{name}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    build_lib.build([str(root / f"{name}.jsonl")], root / name, tokenizer, progress=False,
                    options=build_lib.BuildOptions(val_fraction=val_fraction, shard_bytes=1500))
    return str(root / name)


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """Builds ``a`` and ``b`` (a few eval batches of validation each), ``c`` (validation of
    fewer rows than one eval batch of 4) and ``d`` (no validation split), each of its own
    words."""
    root = tmp_path_factory.mktemp("faults_shards")
    tokenizer = load_tokenizer(write_chatml_tokenizer(root / "tok", WORDS))
    rng = np.random.default_rng(0)
    out = {"root": root, "tokenizer": tokenizer}
    for name, words in SOURCE_WORDS.items():
        docs = [" ".join(rng.choice(words, rng.integers(1, 30))) for _ in range(120)]
        if name == "c":  # held-out documents of 17 .. 50 tokens: 1 to 2 packed rows
            val = [d for d in docs if build_lib.is_held_out(d, 0.25)]
            total = 0
            for d in val:
                if total + len(d.split()) + 1 > 50:
                    docs.remove(d)
                else:
                    total += len(d.split()) + 1
        out[name] = _build(root, name, docs, tokenizer, 0.25)
    out["d"] = _build(root, "d", [" ".join(rng.choice(WORDS[:20], 9)) for _ in range(60)],
                      tokenizer, 0.0)
    rows = {n: shards.TokenStream.open([out[n]], "val").num_tokens // (SEQ + 1) for n in "abcd"}
    assert rows["a"] >= 8 and rows["b"] >= 8 and 1 <= rows["c"] < 4 and rows["d"] == 0, rows
    return out


# 7. A damaged shard set ---------------------------------------------------------------------


def _truncate(path, size):
    data = path.read_bytes()
    path.write_bytes(data[:size])


DAMAGES = {
    "train shard deleted": ("train-00001.arrayrecord", lambda p: p.unlink()),
    "val shard cut to 64 KiB": ("val-00000.arrayrecord", lambda p: _truncate(p, 65536)),
    "train shard cut to 10 bytes": ("train-00000.arrayrecord", lambda p: _truncate(p, 10)),
    "train shard cut by a byte": ("train-00002.arrayrecord",
                                  lambda p: _truncate(p, p.stat().st_size - 1)),
    "train shard grown by a byte": ("train-00001.arrayrecord",
                                    lambda p: p.write_bytes(p.read_bytes() + b"\0")),
    "lengths deleted": ("train-00000.lengths.npy", lambda p: p.unlink()),
    "metadata not JSON": ("metadata.json", lambda p: p.write_text('{"format": "transf')),
    "metadata shard record": ("metadata.json", lambda p: p.write_text(json.dumps(
        {**json.loads(p.read_text()), "shards": [{"index": 0}]}))),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_shard_set_fails_before_any_compile_in_one_line_naming_the_file(
        builds, tmp_path, monkeypatch, damage):
    name, spoil = DAMAGES[damage]
    build = tmp_path / "b"
    shutil.copytree(builds["b"], build)
    spoil(build / name)

    def compiled(*args, **kwargs):
        raise AssertionError("the run went on to make its state (compile) with a damaged build")

    monkeypatch.setattr(training, "make_init_fn", compiled)
    tc = TrainConfig(run_dir=str(tmp_path / "run"), steps=2, batch_size=4, seq_len=SEQ,
                     eval_every=0, eval_batches=1, sample_tokens=0, mesh="1,1,1")
    dc = DataConfig(mixture=f"a={builds['a']}:1,b={build}:1")
    # What the training CLI reports in one line (exit 2): ValueError or FileNotFoundError.
    with pytest.raises((ValueError, FileNotFoundError)) as error:
        training.run(TINY.replace(max_seq_len=32, n_layers=1), tc, dc, progress=False,
                     memory_check=False)
    message = str(error.value)
    assert "\n" not in message and str(build / name) in message, message
    assert "data build" in message  # and what to do about it


def test_a_build_records_each_shard_files_size_and_a_reader_checks_it(builds, tmp_path):
    meta = shards.read_metadata(builds["b"])
    for shard in meta["shards"]:
        for split in ("train", "val"):
            file = Path(builds["b"]) / f"{split}-{shard['index']:05d}.arrayrecord"
            assert shard[f"{split}_bytes"] == file.stat().st_size
    build = tmp_path / "b"
    shutil.copytree(builds["b"], build)
    meta["shards"][0]["train_bytes"] += 1  # the file is intact; the metadata says otherwise
    (build / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"train-00000\.arrayrecord is \d+ bytes, not the"):
        shards.TokenStream.open([str(build)], "train")


def test_an_intact_build_reads_as_before_after_its_check(builds):
    stream = shards.TokenStream.open([builds["a"]], "train")
    meta = shards.read_metadata(builds["a"])
    assert stream.num_tokens == meta["train_tokens"]
    assert len(stream.read([0], stream.num_tokens)[0][0]) == stream.num_tokens


# 14. Mixture weights ------------------------------------------------------------------------


@pytest.mark.parametrize("mixture", ["a=/x:inf", "a=/x:1,b=/y:-inf", "a=/x:nan",
                                     "a=/x:1e308,b=/y:1e308"])
def test_mixture_weights_that_are_not_finite_are_refused_naming_the_field(mixture):
    with pytest.raises(ConfigError, match=r"data\.mixture.*finite") as error:
        build_configs("tiny", [f"data.mixture={mixture}"])
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match=r"data\.mixture.*finite"):
        shards.Mixture.parse("", mixture)
    # Relative weights of any finite size are fine.
    assert shards.Mixture.parse("", "a=/x:1e300,b=/y:3e300").weights == pytest.approx((.25, .75))


# 13. A mixture's validation loss ------------------------------------------------------------

SOURCE_LOSS = {"a": 1.0, "b": 2.0, "c": 4.0}


def _source_of(row: np.ndarray) -> str:
    top = int(row.max()) - FIRST_WORD
    return "a" if top < 20 else "b" if top < 40 else "c"


def _stub_eval_step(params, batch):
    """A loss of 1, 2 or 4 per target token of a row of source a, b or c."""
    mask = batch.get("mask", np.ones(batch["targets"].shape, np.float32))
    per_row = np.array([SOURCE_LOSS[_source_of(r)] for r in batch["inputs"]])
    return {"loss_sum": float((mask.sum(axis=1) * per_row).sum()), "tokens": float(mask.sum())}


class _Log:
    def __init__(self):
        self.val, self.sources = None, {}

    def record_eval(self, step, loss, *args, **kwargs):
        self.val = loss

    def record_source_eval(self, step, name, loss):
        self.sources[name] = loss

    def record_eval_set(self, *args):
        raise AssertionError("no eval sets here")


def _validate(builds, mixture):
    _, shard_data = prepare_shard_data(DataConfig(mixture=mixture), SEQ, None)
    log = _Log()
    tc = TrainConfig(batch_size=4, seq_len=SEQ, sample_tokens=0)
    loss = validation.evaluate_and_sample(
        types.SimpleNamespace(params={}), 1, _stub_eval_step, RunData(shards=shard_data),
        dict(batch_size=4, seq_len=SEQ, max_batches=2), builds["tokenizer"], None, tc, log,
        {"eval": 0.0, "sample": 0.0})
    assert loss == log.val
    return log


@pytest.mark.parametrize("packing", shards.PACKING)
def test_a_mixtures_validation_loss_is_the_weighted_mean_of_all_its_sources(builds, packing,
                                                                           caplog):
    weights = {"a": 3, "b": 1, "c": 1}
    spec = ",".join(f"{n}={builds[n]}:{w}" for n, w in weights.items())
    expected = sum(w * SOURCE_LOSS[n] for n, w in weights.items()) / sum(weights.values())
    for order in (spec, ",".join(reversed(spec.split(",")))):  # the same in any order
        log = _validate(builds, order + f",d={builds['d']}:5")
        # c (fewer rows than one batch) is evaluated on what it has; d (no validation row)
        # is left out of the mean, and named.
        assert log.val == pytest.approx(expected)
        assert log.sources == pytest.approx(SOURCE_LOSS)
    assert any("'d'" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


# Packed rows: segment ids -------------------------------------------------------------------


class _MemoryStream(shards.TokenStream):
    """A ``TokenStream`` whose records are in memory (no ArrayRecord file)."""

    docs: tuple = ()

    def records(self, docs):
        return [self.docs[d].tobytes() for d in docs.tolist()]


def _assert_segments_from_one(segment_ids: np.ndarray) -> None:
    """Each row's ids: 1 first, then each the one before or one more; never 0 on a token."""
    assert (segment_ids[:, 0] == 1).all(), segment_ids
    assert (segment_ids >= 1).all(), segment_ids
    assert np.isin(np.diff(segment_ids, axis=1), (0, 1)).all(), segment_ids


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 30), min_size=1, max_size=30),
       width=st.integers(2, 24), data=st.data())
def test_packed_rows_number_their_segments_from_one(lengths, width, data):
    docs = tuple(np.full(n, 7 + d, np.int32) for d, n in enumerate(lengths))
    stream = _MemoryStream((), (len(docs),), np.asarray(lengths, np.int64), np.dtype("<i4"))
    object.__setattr__(stream, "docs", docs)
    rows = stream.num_tokens // width
    if rows == 0:
        return
    index = data.draw(st.lists(st.integers(0, rows - 1), min_size=1, max_size=8))
    batch = shards.packed_rows(stream, index, width)
    _assert_segments_from_one(batch["segment_ids"])
    # A segment is one document: its tokens (7 + document index) are all the same.
    inputs, seg = batch["inputs"], batch["segment_ids"]
    assert (np.diff(inputs, axis=1)[np.diff(seg, axis=1) == 0] == 0).all()


def test_shard_batches_segment_ids_start_at_one(builds):
    mixture = shards.Mixture.parse("", f"a={builds['a']}:1,b={builds['b']}:1")
    reader = shards.ShardBatches(mixture, SEQ, 8, "pack", seed=1)
    for step in range(3):
        _assert_segments_from_one(reader.get(step)["segment_ids"])
    stream = shards.TokenStream.open([builds["a"]], "train")
    rows = stream.num_tokens // (SEQ + 1)
    _assert_segments_from_one(shards.packed_rows(stream, np.arange(rows), SEQ + 1)["segment_ids"])


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 17), min_size=1, max_size=40), capacity=st.integers(17, 24))
def test_instruction_rows_number_their_examples_from_one_with_zero_only_for_padding(lengths,
                                                                                   capacity):
    segment_ids, positions, _ = packed_layout(lengths, capacity)
    assert (segment_ids > 0).sum() == sum(lengths)  # every token in a segment, padding 0
    for row in segment_ids:
        used = row[row > 0]
        assert used[0] == 1 and (row[:len(used)] == used).all()  # tokens first, padding last
        assert np.isin(np.diff(used), (0, 1)).all()
    examples = [Example(np.arange(1, n + 1, dtype=np.int32), np.ones(n, bool), i + 1)
                for i, n in enumerate(lengths)]
    assert (pack(examples, capacity - 1).segment_ids == segment_ids).all()


# Eval rows over processes -------------------------------------------------------------------


def _assert_split_over_processes(batches_of, batch_size: int) -> None:
    """``batches_of(p, P)``: the eval batches of process p of P; P = 2 and 4's, put together
    batch by batch, are P = 1's."""
    whole = list(batches_of(0, 1))
    assert whole and len(whole[0]["inputs"]) == batch_size
    for count in (2, 4):
        parts = [list(batches_of(p, count)) for p in range(count)]
        assert all(len(part) == len(whole) for part in parts)
        for i, batch in enumerate(whole):
            for key, value in batch.items():
                joined = np.concatenate([part[i][key] for part in parts])
                assert np.array_equal(joined, value), (count, i, key)


@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("packing", shards.PACKING)
def test_shard_eval_rows_of_several_processes_are_the_one_process_rows(builds, packing, pad):
    stream = shards.TokenStream.open([builds["a"], builds["b"]], "val")
    padding = {"pad": True} if pad else {}
    _assert_split_over_processes(lambda p, n: shards.eval_batches(
        stream, packing, 4, SEQ, process_index=p, process_count=n, **padding), 4)
    if pad:  # every row once, the last batch's missing rows masked out
        rows = shards.eval_rows(stream, packing, SEQ)
        batches = list(shards.eval_batches(stream, packing, 4, SEQ, pad=True))
        assert len(batches) == -(-rows // 4)
        assert sum(b["mask"].any(axis=1).sum() for b in batches) == rows


def test_run_data_eval_rows_of_several_processes_are_the_one_process_rows(builds):
    _, shard_data = prepare_shard_data(
        DataConfig(mixture=f"a={builds['a']}:1,b={builds['b']}:1"), SEQ, None)
    data = RunData(shards=shard_data)
    kw = dict(batch_size=4, seq_len=SEQ, max_batches=3)
    _assert_split_over_processes(lambda p, n: data.eval_batches(
        **kw, process_index=p, process_count=n), 4)
    for name in ("a", "b"):
        _assert_split_over_processes(lambda p, n, name=name: data.source_eval_batches(
            **kw, process_index=p, process_count=n)[name], 4)


def test_text_and_instruction_eval_rows_of_several_processes_are_the_one_process_rows():
    tokens = np.random.default_rng(0).integers(0, 50, 700).astype(np.int32)
    _assert_split_over_processes(lambda p, n: data_lib.eval_batches(
        tokens, 8, SEQ, process_index=p, process_count=n), 8)
    rng = np.random.default_rng(1)
    examples = [Example(rng.integers(1, 50, n).astype(np.int32), rng.random(n) < 0.5, i + 1)
                for i, n in enumerate(rng.integers(2, 17, 40))]
    rows = pack(examples, SEQ)
    assert rows.num_rows % 8  # a last batch padded
    _assert_split_over_processes(lambda p, n: packed_eval_batches(rows, 8, None, p, n), 8)
