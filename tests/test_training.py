"""Tests for transformer_jax.training: loss, optimizer, train step, accumulation, run()."""

from __future__ import annotations

import json
import math
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transformer_jax.checkpoint.manager import CheckpointManager
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.transformer import Transformer
from transformer_jax.train import context, perf
from transformer_jax.train import run as training
from transformer_jax.train import step as train_step
from transformer_jax.train.config import DataConfig, TrainConfig, build_configs
from transformer_jax.train.log import NonFiniteLossError
from transformer_jax.train.loss import cross_entropy
from transformer_jax.train.optim import decay_mask, lr_schedule, make_optimizer
from transformer_jax.train.step import make_init_fn, make_train_step

MODEL = ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64,
                    max_seq_len=16)


def random_batch(seed: int, batch: int, length: int, vocab: int = MODEL.vocab_size):
    tokens = np.random.default_rng(seed).integers(0, vocab, (batch, length + 1)).astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


# The runs of this module build new closures: they share compiled programs through a cache.
pytestmark = pytest.mark.usefixtures("shared_compilation_cache")


# Loss --------------------------------------------------------------------------------------------

@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**31 - 1), st.floats(0.0, 0.1))
def test_cross_entropy_matches_log_softmax_and_mask(seed, z_weight):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(2, 5, 7)).astype(np.float32) * 3
    targets = rng.integers(0, 7, (2, 5))
    mask = rng.integers(0, 2, (2, 5)).astype(np.float32)
    mask[0, 0] = 1.0  # at least one target counts
    # Independent computation in float64 numpy.
    lse = np.log(np.exp(logits.astype(np.float64)).sum(-1))
    nll = lse - np.take_along_axis(logits, targets[..., None], -1)[..., 0]
    expected = ((nll + z_weight * lse ** 2) * mask).sum() / mask.sum()
    got = cross_entropy(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(mask), z_weight)
    np.testing.assert_allclose(float(got), expected, rtol=1e-5)


def test_masked_tokens_do_not_change_the_loss():
    logits = np.random.default_rng(0).normal(size=(1, 4, 6)).astype(np.float32)
    targets = np.array([[1, 2, 3, 4]])
    mask = np.array([[1, 1, 0, 0]])
    other = np.where(np.arange(4) >= 2, 0, targets)
    loss = jax.jit(cross_entropy)  # a program per signature, not one per op and shape
    chex.assert_trees_all_close(loss(logits, targets, mask), loss(logits, other, mask))
    chex.assert_trees_all_close(loss(logits, targets, mask),
                                loss(logits[:, :2], targets[:, :2]))


# Optimizer ---------------------------------------------------------------------------------------

def test_no_weight_decay_on_norms_biases_and_embedding():
    config = MODEL.replace(norm="layer", qkv_bias=True, tie_embeddings=False)
    params = jax.eval_shape(lambda: Transformer(config).init(
        jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))["params"]
    params = jax.tree.map(lambda x: x.value if hasattr(x, "value") else x, params,
                          is_leaf=lambda x: hasattr(x, "value"))
    mask = decay_mask(params)
    flat = {"/".join(str(k.key) for k in path): v
            for path, v in jax.tree_util.tree_flatten_with_path(mask)[0]}
    no_decay = sorted(k for k, v in flat.items() if not v)
    decay = sorted(k for k, v in flat.items() if v)
    for name in no_decay:
        assert name.split("/")[-1] in ("scale", "bias", "q_bias", "k_bias", "v_bias",
                                       "embedding"), name
    assert "embed/embedding" in no_decay and "final_norm/scale" in no_decay
    assert "blocks_0/attn/q_bias" in no_decay and "blocks_1/mlp_norm/bias" in no_decay
    assert set(decay) == {k for k in flat if k.split("/")[-1] in
                          ("q_proj", "k_proj", "v_proj", "o_proj", "gate", "up", "down",
                           "lm_head")}
    # The optimizer applies it: with zero gradients only the decayed leaves move.
    tc = TrainConfig(lr=0.1, min_lr=0.1, weight_decay=0.5, warmup_steps=0, grad_clip=0.0,
                     steps=10)
    real = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), params)
    tx = make_optimizer(tc)
    # In one program (op by op, each of the update's primitives compiles apart).
    updates = jax.jit(lambda p: tx.update(jax.tree.map(jnp.zeros_like, p), tx.init(p), p)[0])(
        real)
    for path, u in jax.tree_util.tree_flatten_with_path(updates)[0]:
        name = "/".join(str(k.key) for k in path)
        expected = -0.1 * 0.5 if name in decay else 0.0
        np.testing.assert_allclose(np.asarray(u), expected, rtol=1e-6, err_msg=name)


def test_lr_schedule_warmup_then_cosine_to_min():
    tc = TrainConfig(steps=100, lr=1e-3, min_lr=1e-4, warmup_steps=10)
    sched = lr_schedule(tc)
    lrs = np.array([float(sched(i)) for i in range(100)])
    np.testing.assert_allclose(lrs[:10], 1e-3 * np.arange(1, 11) / 10, rtol=1e-5)
    # Cosine from lr at update 9 to min_lr at update 99 (the last).
    progress = (np.arange(10, 100) + 1 - 10) / 90
    cosine = 1e-4 + 0.5 * (1e-3 - 1e-4) * (1 + np.cos(np.pi * progress))
    np.testing.assert_allclose(lrs[10:], cosine, rtol=1e-4)
    assert lrs[-1] == pytest.approx(1e-4)


def test_train_config_validation_names_the_field():
    with pytest.raises(ValueError, match="grad_accum"):
        TrainConfig(batch_size=6, grad_accum=4)
    with pytest.raises(ValueError, match="warmup_steps"):
        TrainConfig(steps=10, warmup_steps=10)
    with pytest.raises(ValueError, match="steps"):
        TrainConfig(steps=0)
    with pytest.raises(ValueError, match="val_fraction"):
        DataConfig(val_fraction=1.0)
    for bad in ("3", "a,b", "0,2", "5,4", "1,2,3"):
        with pytest.raises(ValueError, match="profile_steps"):
            TrainConfig(steps=10, profile_steps=bad)
    with pytest.raises(ValueError, match="ends after the last step"):
        TrainConfig(steps=10, profile_steps="5,11")
    assert TrainConfig(steps=10, profile_steps=" 2,4").profile_range == (2, 4)


def test_warmup_follows_the_run_length_unless_given():
    assert TrainConfig(steps=50).warmup_steps == 5
    assert TrainConfig(steps=5000).warmup_steps == 100
    assert TrainConfig(steps=5000, decay_steps=300).warmup_steps == 30
    assert TrainConfig(steps=1).warmup_steps == 0
    assert TrainConfig(steps=50, warmup_steps=7).warmup_steps == 7
    # A preset's warmup (tiny's 50) too long for a shorter run gives way; an override stays.
    shortened = build_configs("tiny", ["train.steps=20"])[1]
    assert shortened.warmup_steps == TrainConfig(steps=20).warmup_steps < 20
    assert build_configs("tiny", ["train.steps=20", "train.warmup_steps=3"])[1].warmup_steps == 3


# Train step --------------------------------------------------------------------------------------

def test_tiny_model_overfits_one_batch():
    tc = TrainConfig(steps=80, batch_size=4, seq_len=16, lr=1e-2, min_lr=1e-3, warmup_steps=5,
                     weight_decay=0.0)
    init = jax.jit(make_init_fn(MODEL, tc))
    step = jax.jit(make_train_step(MODEL, tc), donate_argnums=0)
    state = init(jax.random.key(0))
    batch = random_batch(0, 4, 16)
    losses = []
    for _ in range(tc.steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[0] == pytest.approx(math.log(MODEL.vocab_size), abs=0.3)
    assert losses[-1] < 0.1, losses[::10]
    assert int(state.step) == tc.steps


def test_gradient_accumulation_equals_one_big_batch():
    """k micro-batches of B/k give the same gradient, loss and update as one batch of B."""
    base = dict(steps=10, batch_size=8, seq_len=8, warmup_steps=1, z_loss=1e-3)
    batch = random_batch(1, 8, 8)
    batch["mask"] = (np.random.default_rng(2).random((8, 8)) > 0.3).astype(np.float32)
    init = jax.jit(make_init_fn(MODEL, TrainConfig(**base)))
    results = []
    for accum in (1, 4):
        tc = TrainConfig(**base, grad_accum=accum)
        state = init(jax.random.key(3))
        new_state, metrics = jax.jit(make_train_step(MODEL, tc))(state, batch)
        results.append((new_state, metrics))
    (s1, m1), (s4, m4) = results
    for key in ("loss", "z_loss", "grad_norm", "tokens"):
        np.testing.assert_allclose(float(m1[key]), float(m4[key]), rtol=2e-6, err_msg=key)
    # Adam's first update is ~lr * sign(g), so compare the moments (mu = (1 - b1) g).
    mu1 = s1.opt_state[1][0].mu
    mu4 = s4.opt_state[1][0].mu
    chex.assert_trees_all_close(mu1, mu4, rtol=1e-5, atol=1e-9)
    chex.assert_trees_all_close(s1.params, s4.params, rtol=1e-5, atol=1e-6)


# run() -------------------------------------------------------------------------------------------

def write_corpus(path, seed=0, lines=400):
    rng = np.random.default_rng(seed)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "ran", "to", "red", "house"]
    text = "".join(" ".join(rng.choice(words, rng.integers(3, 9))) + ".\n"
                   for _ in range(lines))
    path.write_text(text)
    return path


def small_run_configs(tmp_path, **train):
    corpus = write_corpus(tmp_path / "corpus.txt")
    model = MODEL.replace(max_seq_len=32)
    # One decay length whatever the steps: the update does not depend on train.steps, so the
    # runs of this module (6 then 8 steps, 3, 9) share one compiled train step (the cache).
    tc = dict(steps=6, decay_steps=6, batch_size=4, seq_len=16, warmup_steps=1, eval_every=3,
              eval_batches=2, log_every=1, ckpt_every=3, run_dir=str(tmp_path / "run"),
              sample_tokens=0)
    tc.update(train)
    data = DataConfig(path=str(corpus), tokenizer="char", cache_dir=str(tmp_path / "cache"),
                      val_fraction=0.1)
    return model, TrainConfig(**tc), data


def test_run_trains_logs_and_checkpoints(tmp_path, monkeypatch):
    model, tc, data = small_run_configs(tmp_path, sample_tokens=4)
    plots, plot = [], training._plot

    def counted(*args):  # every redraw counted; the first drawn (loss.png and its time), the
        plots.append(args)  # others not: matplotlib's draws are test_plot's subject, and the
        if len(plots) == 1:  # costliest part of this run
            plot(*args)

    monkeypatch.setattr(training, "_plot", counted)
    summary = training.run(model, tc, data, progress=False)
    assert len(plots) == 2  # at each evaluation (3, 6): the last step's is not drawn again
    run_dir = tmp_path / "run"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"]
    val = [r for r in records if r["split"] == "val"]
    assert [r["step"] for r in train] == list(range(1, 7))
    assert [r["step"] for r in val] == [3, 6]
    assert [r["step"] for r in records if r["split"] == "sample"] == [3, 6]
    assert summary.final_step == 6 and summary.val_loss == pytest.approx(val[-1]["loss"])
    assert summary.train_loss == pytest.approx(train[-1]["loss"])
    assert summary.tokens_seen == 6 * 4 * 16 and summary.loss_unit == "nats/char"
    saved = json.loads((run_dir / "summary.json").read_text())
    assert saved["final_step"] == 6
    # The wall time, split: every part measured, and together no more than the whole.
    assert set(saved["time_s"]) == set(training.TIME_PARTS)
    assert all(saved["time_s"][k] > 0 for k in ("startup", "compile", "train", "eval",
                                                 "sample", "plot", "checkpoint"))
    assert sum(saved["time_s"].values()) <= saved["wall_time_s"] + 1e-3
    assert (run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The run keeps its tokenizer, and records where and which.
    config = json.loads((run_dir / "config.json").read_text())
    assert config["tokenizer_dir"] == "tokenizer"
    from transformer_jax.tokenizer import Tokenizer, load_tokenizer

    copy = Tokenizer.load(run_dir / "tokenizer" / "tokenizer.model")
    assert copy.fingerprint == config["tokenizer_fingerprint"]
    assert load_tokenizer(run_dir / "tokenizer").vocab_size == copy.vocab_size
    assert list((run_dir / "tb").iterdir())
    with CheckpointManager(run_dir / "checkpoints", keep=3) as ckpt:
        assert ckpt.all_steps() == [3, 6]
    # Running again with more steps resumes at 6 instead of starting over.
    tc2 = TrainConfig(**{**tc.__dict__, "steps": 8, "sample_tokens": 0})
    summary2 = training.run(model, tc2, data, progress=False)
    assert summary2.start_step == 6 and summary2.final_step == 8
    assert len(plots) == 3


@pytest.fixture(scope="module")
def three_steps(tmp_path_factory):
    """A 3-step run without evaluations (a checkpoint at step 3) that profiled its steps 2-3:
    its (model, train, data) configs. The profile test reads its trace; the non-finite loss
    test continues it (it adds checkpoint 4 only)."""
    tmp_path = tmp_path_factory.mktemp("three_steps")
    model, tc, data = small_run_configs(tmp_path, steps=3, eval_every=0, profile_steps="2,3")
    with pytest.MonkeyPatch.context() as patch:  # no loss plot (test_run_trains' subject)
        patch.setattr(training, "_plot", lambda *args: None)
        training.run(model, tc, data, progress=False, memory_check=False)
    return model, tc, data


def test_profile_steps_write_a_trace(three_steps):
    traces = list((Path(three_steps[1].run_dir) / "profile").rglob("*.xplane.pb"))
    assert traces and traces[0].stat().st_size > 0


def test_eval_batches_are_up_to_four_micro_batches_over_the_same_windows():
    tc = TrainConfig(batch_size=8, grad_accum=2, seq_len=16, eval_batches=20)
    assert training.eval_batching(tc, 10_000) == (16, 5)  # 20 micro-batches of 4 in 5
    assert training.eval_batching(tc, 100) == (4, 20)  # the split fills no larger batch
    tc = TrainConfig(batch_size=4, seq_len=16, eval_batches=3)
    assert training.eval_batching(tc, 10_000) == (12, 1)
    assert training.eval_batching(TrainConfig(batch_size=4, eval_batches=0), 10_000) == (16, None)


def test_progress_shows_the_latest_logged_loss_and_a_training_eta(tmp_path):
    from transformer_jax.train import log as run_log

    tc = TrainConfig(steps=10, batch_size=2, seq_len=4, log_every=2)
    log = run_log.RunLog(tmp_path, 0, tc, flops=1.0, peak=1e9, log_train=False)
    log.start_timer()
    for step in (1, 2, 3):
        log.push(step, {"loss": jnp.float32(step), "grad_norm": jnp.float32(1.0),
                        "lr": jnp.float32(0.1)})
        log.flush()
    log.close()
    assert log.postfix().startswith("loss 2.0000, ")  # step 3 is not logged (log_every=2)
    assert "step/s" in log.postfix() and "ETA" in log.postfix()
    assert log.eta_s() == pytest.approx((10 - 3) / log.steps_per_s())


def test_mfu_peak_is_per_device():
    from transformer_jax.train import log as run_log

    devices = jax.devices()
    peak, source = run_log.mesh_peak_flops(devices, per_device=2e12)
    assert peak == 2e12 * len(devices) and "train.peak_flops" in source
    assert run_log.published_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert run_log.published_peak_flops("NVIDIA H100 PCIe") == 756e12
    assert run_log.published_peak_flops("TPU v5 lite") == 197e12
    assert run_log.published_peak_flops("Some new chip") is None
    # On CPU the devices of the host share its cores: the host's measured peak counts once.
    peak, source = run_log.mesh_peak_flops(devices)
    assert peak > 0 and "shared by its devices" in source
    # A process measures its device once: a second run's figure is the first's.
    assert run_log.mesh_peak_flops(devices) == (peak, source)


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(three_steps, monkeypatch):
    model, tc, data = three_steps  # a run at step 3, its checkpoint of step 3 on disk
    ckpt_dir = Path(tc.run_dir) / "checkpoints"
    before = {p.name: p.stat().st_mtime_ns for p in ckpt_dir.rglob("*")}

    real = train_step.make_train_step

    def poisoned(model_config, train_config):
        step_fn = real(model_config, train_config)

        def step(state, batch):
            new_state, metrics = step_fn(state, batch)
            bad = state.step >= 4  # the update from step 4 to 5 goes wrong
            metrics["loss"] = jnp.where(bad, jnp.nan, metrics["loss"])
            return new_state, metrics
        return step

    monkeypatch.setattr(context, "make_train_step", poisoned)  # SFT's step
    tc2 = TrainConfig(**{**tc.__dict__, "steps": 9, "ckpt_every": 1})
    with pytest.raises(NonFiniteLossError, match="at step 5"):
        training.run(model, tc2, data, progress=False, memory_check=False)
    with CheckpointManager(ckpt_dir, keep=3) as ckpt:
        assert ckpt.all_steps() == [3, 4]  # step 4 was good; nothing after it was saved
    after = {p.name: p.stat().st_mtime_ns for p in (ckpt_dir / "3").rglob("*")}
    assert all(before[name] == t for name, t in after.items())


@pytest.mark.parametrize("case", ["missing", "empty", "bad_tokenizer", "seq_len", "ckpt_dir",
                                  "small_val"])
def test_bad_input_is_a_clear_error_and_keeps_checkpoints(tmp_path, case):
    model, tc, data = small_run_configs(tmp_path)
    ckpt_dir = tmp_path / "run" / "checkpoints"
    marker = ckpt_dir / "keep-me.txt"  # stands in for existing checkpoints
    marker.parent.mkdir(parents=True)
    marker.write_text("keep me")
    if case == "missing":
        data = DataConfig(**{**data.__dict__, "path": str(tmp_path / "nope.txt")})
        error, match = FileNotFoundError, "nope.txt"
    elif case == "empty":
        (tmp_path / "empty.txt").write_text("")
        data = DataConfig(**{**data.__dict__, "path": str(tmp_path / "empty.txt")})
        error, match = ValueError, "empty"
    elif case == "bad_tokenizer":
        (tmp_path / "bad.model").write_bytes(b"not a sentencepiece model")
        data = DataConfig(**{**data.__dict__, "tokenizer": str(tmp_path / "bad.model")})
        error, match = ValueError, "bad.model"
    elif case == "seq_len":
        tc = TrainConfig(**{**tc.__dict__, "seq_len": 64})
        error, match = ValueError, "seq_len=64 is above the model's max_seq_len=32"
    elif case == "ckpt_dir":
        (tmp_path / "file").write_text("x")
        tc = TrainConfig(**{**tc.__dict__, "run_dir": str(tmp_path / "file" / "run")})
        error, match = PermissionError, "not writable"
    else:
        data = DataConfig(**{**data.__dict__, "val_fraction": 0.004})  # < one eval batch
        error, match = ValueError, "eval batch"
    with pytest.raises(error, match=match):
        training.run(model, tc, data, progress=False)
    assert marker.read_text() == "keep me"


def test_batch_not_divisible_by_devices_is_a_clear_error():
    tc = TrainConfig(batch_size=6, grad_accum=2, seq_len=8)
    with pytest.raises(ValueError, match="not divisible by the number of devices \\(2\\)"):
        training.check_run(MODEL, tc, num_train_tokens=1000, num_devices=2)
    training.check_run(MODEL, TrainConfig(batch_size=8, seq_len=8), 1000, num_devices=2)


def test_flops_per_token_counts_matmul_weights():
    config = MODEL.replace(tie_embeddings=True)
    d, f, v, h, n, k, layers = 32, 64, 32, 16, 2, 1, 2
    per_layer = d * n * h * 2 + d * k * h * 2 + 3 * d * f
    expected = 6 * (layers * per_layer + v * d) + 12 * layers * 16 * n * h
    assert perf.flops_per_token(config, 16) == expected
    untied = MODEL.replace(tie_embeddings=False)
    assert perf.flops_per_token(untied, 16) == expected  # lm_head replaces the tied table
    assert optax is not None


def test_the_run_log_writes_tensorboard_events_without_importing_torch(tmp_path):
    """tensorboardX imports torch (and google-cloud-storage) when installed, seconds of every
    run's start; the run's writer is imported without them, writes events, and leaves both
    importable afterwards. A fresh process: this one has torch loaded already."""
    import subprocess
    import sys

    script = f"""
import sys
from transformer_jax.train.log import _summary_writer_class
writer = _summary_writer_class()({str(tmp_path / "tb")!r})
writer.add_scalar("train/loss", 1.5, 1)
writer.add_text("sample", "hi", 1)
writer.close()
# Neither imported, and neither left blocked (a blocked name is a None entry in sys.modules).
assert "torch" not in sys.modules and "google.cloud.storage" not in sys.modules
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
    (events,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    assert events.stat().st_size > 0
