"""Reading shard builds: packed rows with segment ids, windows, the global batch the same for
any process count (and after a resume on another), mixtures by weight, and a run from shards."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import TINY, write_chatml_tokenizer

from transformer_jax.checkpoint.manager import ensure_writable_dir
from transformer_jax.data import batches as data_lib
from transformer_jax.data import build as build_lib
from transformer_jax.data import shards
from transformer_jax.tokenizer import load_tokenizer
from transformer_jax.train import run as training
from transformer_jax.train.config import DataConfig, TrainConfig
from transformer_jax.train.data import prepare_data, prepare_shard_data

WORDS = [f"w{i}" for i in range(40)]
SEQ = 16


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """Two builds: ``a`` of words w0..w19, ``b`` of w20..w39 (so a row names its source)."""
    root = tmp_path_factory.mktemp("shards")
    tokenizer = load_tokenizer(write_chatml_tokenizer(root / "tok", WORDS))
    rng = np.random.default_rng(0)
    out = {"tokenizer": tokenizer, "root": root}
    for name, words in (("a", WORDS[:20]), ("b", WORDS[20:])):
        docs = [" ".join(rng.choice(words, rng.integers(1, 40))) for _ in range(150)]
        (root / f"{name}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n"
                                                    for d in docs))
        build_lib.build([str(root / f"{name}.jsonl")], root / name, tokenizer, progress=False,
                        options=build_lib.BuildOptions(val_fraction=0.25, shard_bytes=2000))
        out[name] = str(root / name)
        out[f"{name}_docs"] = docs
    return out


def test_packed_rows_hold_whole_documents_in_order_with_nothing_dropped(builds):
    tok = builds["tokenizer"]
    docs = [d for d in builds["a_docs"] if not build_lib.is_held_out(d, 0.25)]
    # Independently: the train documents' tokens one after another, and whose each token is.
    encoded = [tok.encode(d, add_eos=True) for d in docs]
    expected = np.concatenate(encoded)
    owner = np.repeat(np.arange(len(docs)), [len(e) for e in encoded])
    stream = shards.TokenStream.open([builds["a"]], "train")
    width = SEQ + 1
    rows = stream.num_tokens // width
    assert stream.num_tokens == len(expected) and len(expected) - rows * width < width
    batch = shards.packed_rows(stream, np.arange(rows), width)
    assert np.array_equal(np.c_[batch["inputs"], batch["targets"][:, -1:]].ravel(),
                          expected[:rows * width])  # no token dropped but the last < T + 1
    owners = owner[:rows * width].reshape(rows, width)[:, :-1]
    for r in range(rows):
        seg, pos = batch["segment_ids"][r], batch["positions"][r]
        for s in np.unique(seg):
            where = np.flatnonzero(seg == s)
            assert len(np.unique(owners[r, where])) == 1  # one document per segment
            assert np.array_equal(pos[where], np.arange(len(where)))  # positions from 0
        # A new segment starts exactly where a new document does.
        assert np.array_equal(np.diff(seg) != 0, np.diff(owners[r]) != 0)
        assert np.array_equal(batch["mask"][r],
                              (np.r_[seg[1:], seg[-1] + (owner[(r + 1) * width - 1] !=
                                                        owners[r, -1])] == seg))
    assert batch["segment_ids"].max() > 2  # rows do hold several documents


@pytest.mark.parametrize("packing", shards.PACKING)
def test_the_global_batch_is_the_same_for_any_process_count_and_after_a_resume(builds,
                                                                               packing):
    mixture = shards.Mixture.parse(f"{builds['a']},{builds['b']}", "")
    one = shards.ShardBatches(mixture, SEQ, 8, packing, seed=3)
    reference = [one.get(step) for step in range(6)]
    for count in (2, 4):
        parts = [shards.ShardBatches(mixture, SEQ, 8, packing, 3, i, count)
                 for i in range(count)]
        for step in range(6):
            got = [p.get(step) for p in parts]
            for key, value in reference[step].items():
                assert np.array_equal(np.concatenate([g[key] for g in got]), value), (count, key)
    # A resume at step 4 on 2 processes (fresh objects: no iterator state) continues the same.
    resumed = [shards.ShardBatches(mixture, SEQ, 8, packing, 3, i, 2) for i in range(2)]
    for step in (4, 5):
        assert np.array_equal(np.concatenate([r.get(step)["inputs"] for r in resumed]),
                              reference[step]["inputs"])
    assert not np.array_equal(reference[0]["inputs"], reference[1]["inputs"])


def test_every_packed_row_once_per_epoch_and_concat_windows_as_a_token_array(builds):
    mixture = shards.Mixture.parse(builds["a"], "")
    rows = shards.Rows(shards.TokenStream.open([builds["a"]], "train"), SEQ, seed=1)
    epochs = [[rows.order[e * rows.num_rows + i] for i in range(rows.num_rows)] for e in (0, 1)]
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(rows.num_rows))
    assert epochs[0] != epochs[1]
    # concat: exactly data.get_batch's windows over the stream's tokens.
    stream = shards.TokenStream.open([builds["a"]], "train")
    tokens = stream.read([0], stream.num_tokens)[0][0]
    concat = shards.ShardBatches(mixture, SEQ, 8, "concat", seed=5)
    for step in (0, 7):
        expected = data_lib.get_batch(tokens, 5, step, 8, SEQ)
        got = concat.get(step)
        assert all(np.array_equal(got[k], expected[k]) for k in ("inputs", "targets"))


def test_mixture_rows_follow_the_weights(builds):
    weights = (0.8, 0.2)
    steps, batch = 300, 16
    drawn = np.concatenate([shards.mixture_sources(0, s, batch, weights) for s in range(steps)])
    n = steps * batch
    share = np.mean(drawn == 1)
    assert abs(share - 0.2) < 4 * np.sqrt(0.2 * 0.8 / n)  # within 4 standard errors
    mixture = shards.Mixture.parse("", f"a={builds['a']}:4,b={builds['b']}:1")
    assert mixture.weights == pytest.approx(weights)
    reader = shards.ShardBatches(mixture, SEQ, batch, "pack", seed=0)
    b_first = 5 + 20  # the specials, then w0..w19 are source a's
    for step in range(3):
        rows = reader.get(step)["inputs"]
        from_b = (rows >= b_first).any(axis=1)
        assert np.array_equal(from_b, reader.sources(step) == 1)
        assert not ((rows >= 5) & (rows < b_first)).any(axis=1)[from_b].any()


def test_bad_mixtures_and_a_foreign_tokenizer_are_one_line(builds):
    for bad in ("a=/x", "a=/x:0", "=/x:1", "a=/x:1,a=/y:1"):
        with pytest.raises(ValueError, match="data.mixture"):
            shards.Mixture.parse("", bad)
    other = load_tokenizer(write_chatml_tokenizer(builds["root"] / "other", WORDS[::-1]))
    with pytest.raises(ValueError, match=r"^data.tokenizer=X \(fingerprint \w+\) is not the "
                                         r"tokenizer of the shards in .*/a \("):
        prepare_shard_data(DataConfig(path=builds["a"]), SEQ, other, where="data.tokenizer=X")
    unfinished = builds["root"] / "unfinished"
    unfinished.mkdir()
    (unfinished / "shard-00000.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="is not a finished shard build"):
        DataConfig(path=str(unfinished)).is_shards  # noqa: B018
    # What a resume compares: another packing or mixture is other data.
    prints = {prepare_shard_data(DataConfig(**kw), SEQ, None)[1].fingerprint for kw in (
        {"path": builds["a"]}, {"path": builds["a"], "packing": "concat"},
        {"mixture": f"a={builds['a']}:1,b={builds['b']}:1"},
        {"mixture": f"a={builds['a']}:2,b={builds['b']}:1"})}
    assert len(prints) == 4
    # A bucket URL is never made into a local directory named gs: (test_object_storage runs
    # in a bucket).
    assert str(ensure_writable_dir("gs://b/run", "run directory")) == "gs://b/run"
    with pytest.raises(ValueError, match="data.packing=pack reads shard builds"):
        prepare_data(DataConfig(packing="pack", path=str(builds["root"] / "a.jsonl")), 64)


def test_a_run_trains_from_a_mixture_with_a_loss_per_source(builds, tmp_path):
    tc = TrainConfig(run_dir=str(tmp_path / "run"), steps=2, batch_size=4, seq_len=SEQ,
                     eval_every=0, eval_batches=1, sample_tokens=0, log_every=1, mesh="1,1,1",
                     peak_flops=1e12)
    dc = DataConfig(mixture=f"a={builds['a']}:1,b={builds['b']}:1")
    summary = training.run(TINY.replace(max_seq_len=32, n_layers=1), tc, dc, progress=False,
                           memory_check=False)
    assert summary.final_step == 2 and summary.val_loss is not None
    assert "data" in summary.time_s
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    splits = {r["split"] for r in records}
    assert {"val", "val/a", "val/b"} <= splits
    # The headline is the sources' mean weighted by the mixture (1:1), not the first's.
    last = {r["split"]: r["loss"] for r in records if r["split"].startswith("val")}
    assert last["val"] == pytest.approx((last["val/a"] + last["val/b"]) / 2)
    assert summary.val_loss == pytest.approx(last["val"])
