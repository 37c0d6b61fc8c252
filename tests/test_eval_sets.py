"""``train.eval_sets``: per-dataset loss and bits per byte at every evaluation.

Bits per byte are checked against nats x tokens / (ln 2 x bytes) computed here from one
unwindowed forward per document, for two tokenizers (word-level and byte-level BPE) on the same
text; each evaluation writes the sets' curves to metrics.jsonl, TensorBoard and loss.png; bad
sets fail in one line before any training.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import TINY, write_chatml_tokenizer

from transformer_jax.data.eval_sets import document_windows, load_eval_set, load_eval_sets
from transformer_jax.model.transformer import Transformer, init_params
from transformer_jax.tokenizer import load_tokenizer
from transformer_jax.train import run as training
from transformer_jax.train.config import DataConfig, TrainConfig
from transformer_jax.train.data import RunData
from transformer_jax.train.log import RunLog
from transformer_jax.train.plot import plot_run, read_metrics
from transformer_jax.train.step import make_eval_step, make_init_fn
from transformer_jax.train.validation import evaluate, evaluate_and_sample

WORDS = "the cat dog sat ran on a mat red blue big small".split()
DOCS = [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(n))
        for i, n in enumerate((3, 9, 30, 50))]
# One model for both tokenizers (its vocabulary holds either), so each program compiles once.
CONFIG = TINY.replace(vocab_size=320, n_layers=1, max_seq_len=64)
EVAL_STEP = jax.jit(make_eval_step(CONFIG))
FORWARD = jax.jit(lambda p, x: Transformer(CONFIG).apply({"params": p}, x).logits)


def _bpe_dir(directory: Path) -> Path:
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(DOCS, trainer)
    directory.mkdir(parents=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return directory


@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("sets")
    (directory / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    return directory


@pytest.mark.parametrize("kind", ["word", "bpe"])
def test_bits_per_byte_equal_nats_times_tokens_over_bytes(kind, texts, tmp_path):
    if kind == "word":
        tokenizer = load_tokenizer(write_chatml_tokenizer(tmp_path / "tok", WORDS))
    else:
        tokenizer = load_tokenizer(_bpe_dir(tmp_path / "tok"))
    assert tokenizer.vocab_size <= CONFIG.vocab_size
    params = init_params(CONFIG, 0)
    # Rows of 64 tokens: each document is one window, several share a row.
    eval_set = load_eval_set("docs", texts / "docs.jsonl", tokenizer, seq_len=64)
    loss = evaluate(EVAL_STEP, params, eval_set.batches(batch_size=2))
    bpb = eval_set.bits_per_byte(loss)

    # Independently: each document alone in one forward, from its prefix token.
    prefix = tokenizer.bos_id if tokenizer.bos_id >= 0 else tokenizer.eos_id
    nats = tokens = num_bytes = 0
    for doc in DOCS:
        ids = tokenizer.encode(doc)
        row = np.zeros((1, 64), np.int32)  # right padding: causal attention ignores it
        row[0, :len(ids)] = [prefix, *ids][:-1]
        logits = np.asarray(FORWARD(params, row)[0, :len(ids)], np.float64)
        top = logits.max(-1, keepdims=True)
        logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
        nats -= logp[np.arange(len(ids)), ids].sum()
        tokens += len(ids)
        num_bytes += len(tokenizer.decode(ids).encode("utf-8"))
    assert eval_set.num_tokens == tokens and eval_set.num_bytes == num_bytes
    assert loss == pytest.approx(nats / tokens, rel=1e-5)
    assert bpb == pytest.approx((nats / tokens) * tokens / (math.log(2) * num_bytes), rel=1e-5)
    assert eval_set.rows.num_rows < len(DOCS)


def test_long_documents_are_windows_predicting_each_token_once():
    ids = list(range(3, 40))
    windows = document_windows(ids, prefix=1, seq_len=16)
    assert [len(w.tokens) for w in windows] == [17, 17, 6]
    predicted = np.concatenate([w.tokens[w.loss] for w in windows])
    np.testing.assert_array_equal(predicted, ids)
    for a, b in zip(windows, windows[1:], strict=False):  # one token of overlap
        assert a.tokens[-1] == b.tokens[0] and not b.loss[0]
    np.testing.assert_array_equal(
        np.concatenate([w.tokens[w.loss] for w in document_windows(ids, None, 16)]), ids[1:])


def test_bad_eval_sets_are_one_line_before_training(tmp_path, texts):
    tokenizer = load_tokenizer(write_chatml_tokenizer(tmp_path / "tok", WORDS))
    with pytest.raises(ValueError, match=r"train\.eval_sets: 'nopath' is not NAME=PATH"):
        TrainConfig(eval_sets="nopath")
    with pytest.raises(ValueError, match=r"train\.eval_sets: the name 'a' is given twice"):
        TrainConfig(eval_sets="a=x.txt,a=y.txt")
    with pytest.raises(FileNotFoundError, match=r"train\.eval_sets: gone=.*gone\.txt: no such"):
        load_eval_sets(f"gone={tmp_path / 'gone.txt'}", tokenizer, 16)
    (tmp_path / "empty.txt").write_text("\n  \n")
    with pytest.raises(ValueError, match=r"train\.eval_sets: e=.*empty\.txt: the file holds no"):
        load_eval_sets(f"ok={texts / 'docs.jsonl'},e={tmp_path / 'empty.txt'}", tokenizer, 16)
    (tmp_path / "bad.jsonl").write_text('{"text": "the cat"}\n{"body": 1}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: needs a string \"text\""):
        load_eval_sets(f"b={tmp_path / 'bad.jsonl'}", tokenizer, 16)
    # In a run: the error comes before any step (no checkpoint is written).
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(DOCS) * 20)
    tc = TrainConfig(steps=2, batch_size=2, seq_len=16, eval_every=1, sample_tokens=0,
                     run_dir=str(tmp_path / "run"), eval_sets=f"gone={tmp_path / 'gone.txt'}")
    data = DataConfig(path=str(corpus), tokenizer="char", cache_dir=str(tmp_path / "cache"))
    with pytest.raises(FileNotFoundError, match="train.eval_sets: gone="):
        training.run(TINY.replace(max_seq_len=32), tc, data, progress=False)
    assert not list((tmp_path / "run").glob("checkpoints/*"))


def test_each_evaluation_logs_and_plots_each_set(tmp_path, texts):
    """What ``training.run`` does at each evaluation (``run_eval.evaluate_and_sample``), on
    a fresh state: every set's loss and bits per byte in metrics.jsonl and TensorBoard, and
    one bits-per-byte curve per set in loss.png."""
    tokenizer = load_tokenizer(write_chatml_tokenizer(tmp_path / "tok", WORDS))
    (tmp_path / "other.txt").write_text(DOCS[2])
    tc = TrainConfig(steps=2, batch_size=2, seq_len=16, warmup_steps=0, sample_tokens=0,
                     run_dir=str(tmp_path / "run"),
                     eval_sets=f"docs={texts / 'docs.jsonl'},other={tmp_path / 'other.txt'}")
    sets = load_eval_sets(tc.eval_sets, tokenizer, tc.seq_len)
    state = make_init_fn(CONFIG, tc)(jax.random.key(0))
    data = RunData(train_tokens=np.arange(64) % 17, val_tokens=np.arange(40) % 17)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    log = RunLog(run_dir, 0, tc, flops=1.0, peak=1.0, log_train=False)
    times = {"eval": 0.0, "sample": 0.0}
    for step in (1, 2):
        evaluate_and_sample(state, step, EVAL_STEP, data, dict(batch_size=2, seq_len=16),
                            tokenizer, CONFIG, tc, log, times, sets)
    log.close()
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [(r["step"], r["name"]) for r in records if r["split"] == "eval_set"]
    assert logged == [(1, "docs"), (1, "other"), (2, "docs"), (2, "other")]
    assert [r["step"] for r in records if r["split"] == "val"] == [1, 2]
    for r in records:
        if r["split"] == "eval_set":
            s = sets[0] if r["name"] == "docs" else sets[1]
            assert r["bpb"] == pytest.approx(s.bits_per_byte(r["loss"])) and r["loss"] > 0
    assert set(read_metrics(run_dir).eval_sets) == {"docs", "other"}
    plot_run(run_dir)
    assert (run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from tensorboardX.proto import event_pb2  # the events' own format: tags of the scalars

    tags = set()
    for path in (run_dir / "tb").iterdir():
        data = path.read_bytes()
        while data:  # TFRecord: length (8), crc (4), payload, crc (4)
            n = int.from_bytes(data[:8], "little")
            event = event_pb2.Event.FromString(data[12:12 + n])
            tags |= {v.tag for v in event.summary.value}
            data = data[16 + n:]
    assert {"eval/docs/bpb", "eval/other/loss"} <= tags
