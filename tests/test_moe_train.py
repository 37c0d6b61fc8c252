"""Training a mixture of experts: the router losses (``train.moe_balance_loss``,
``train.moe_z_loss``) against a numpy formula on a real forward's routing, in the objective and
its gradient, weighted by tokens over micro-batches; the router metrics; and a run that logs
them and resumes exactly (with DeepSeek-V3's routing and its correction biases' balancing
update)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import struct
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FAST_COMPILE, TINY, random_params

from transformer_jax.checkpoint.read import read_params
from transformer_jax.model.fields import MoE
from transformer_jax.model.transformer import Transformer
from transformer_jax.train import run as training
from transformer_jax.train.config import DataConfig, TrainConfig
from transformer_jax.train.perf import flops_per_token, param_counts
from transformer_jax.train.step import make_init_fn, make_loss_fn, make_train_step

E, K = 5, 2
# Layer 0 dense, layer 1 sparse: the metrics name the sparse layer only.
MODEL = TINY.replace(moe=MoE(n_experts=E, top_k=K, d_ff=24, dense_layers=(0,)))
B, T = 4, 16
TC = TrainConfig(batch_size=B, seq_len=T, warmup_steps=1, moe_balance_loss=0.3, moe_z_loss=0.05)


def _batch(seed: int, b: int = B) -> dict[str, np.ndarray]:
    tokens = np.random.default_rng(seed).integers(0, TINY.vocab_size, (b, T + 1), np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def _packed(seed: int) -> dict[str, np.ndarray]:
    """Two documents per row and padding (segment 0) at the end of each row."""
    batch = _batch(seed)
    segments = np.repeat(np.array([[1] * 7 + [2] * 5 + [0] * 4]), B, 0).astype(np.int32)
    positions = np.concatenate([np.arange(7), np.arange(5), np.zeros(4, int)])
    mask = (segments > 0).astype(np.float32)
    mask[:, :3] = 0  # a "prompt": not in the loss, but routed and counted by the model
    return {**batch, "segment_ids": segments, "mask": mask,
            "positions": np.repeat(positions[None], B, 0).astype(np.int32)}


def _init(model, seed: int):
    """Random parameters drawn with numpy (``helpers.random_params``): no init program compiles
    (a jitted ``init_params``' random draws cost some 0.8 CPU seconds here)."""
    return random_params(model, seed=seed)


def _full(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The batch with every key a packed one has (one pytree, so each jit compiles once)."""
    b, t = batch["inputs"].shape
    ones = np.ones((b, t), np.int32)
    return {"mask": ones.astype(np.float32), "segment_ids": ones,
            "positions": np.repeat(np.arange(t, dtype=np.int32)[None], b, 0), **batch}


@pytest.fixture(scope="module")
def state():
    # init_params' draws (output projections scaled by depth): the tolerances below hold for
    # them, not for numpy's ``_init`` at one spread (a relative 2e-5 missed by one element).
    return jax.jit(make_init_fn(MODEL, TC), compiler_options=FAST_COMPILE)(jax.random.key(0))


@pytest.fixture(scope="module")
def params(state):
    return state.params


@pytest.fixture(scope="module")
def steps():
    """The jitted train step without and with gradient accumulation (A = 2)."""
    return {a: jax.jit(make_train_step(MODEL, dataclasses.replace(TC, grad_accum=a)),
                       compiler_options=FAST_COMPILE) for a in (1, 2)}


@pytest.fixture(scope="module")
def forward():
    """The model's forward, with the intermediates it captured."""
    return jax.jit(lambda p, b: Transformer(MODEL).apply(
        {"params": p}, b["inputs"], positions=b["positions"], segment_ids=b["segment_ids"],
        capture_intermediates=True, mutable=["intermediates"]), compiler_options=FAST_COMPILE)


@pytest.fixture(scope="module")
def loss_fn():
    return jax.jit(make_loss_fn(MODEL, TC), compiler_options=FAST_COMPILE)


def _numpy_router_losses(x: np.ndarray, router: np.ndarray, valid: np.ndarray):
    """Switch's balance loss, ST-MoE's z-loss and the load, by hand from the router input."""
    logits = x.reshape(-1, x.shape[-1]).astype(np.float64) @ router
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    chosen = np.argsort(-probs, axis=-1, kind="stable")[:, :K]  # [N, k]
    v = valid.reshape(-1)
    load = np.array([np.sum((chosen == e) * v[:, None]) for e in range(E)], np.float64)
    f = load / v.sum()
    p = (probs * v[:, None]).sum(0) / v.sum()
    lse = np.log(np.exp(logits).sum(-1))
    return E * np.sum(f * p), np.sum(lse ** 2 * v) / v.sum(), load


def test_router_losses_and_load_equal_a_numpy_formula_on_a_forward(state, params, forward,
                                                                   loss_fn, steps):
    batch = _packed(0)
    # The sparse layer's router input: the output of its FFN norm, captured from the forward.
    out, inter = forward(params, batch)
    x = np.asarray(inter["intermediates"]["blocks_1"]["mlp_norm"]["__call__"][0])
    router = np.asarray(params["blocks_1"]["moe"]["router"], np.float64)
    balance, z, load = _numpy_router_losses(x, router, batch["segment_ids"] > 0)
    np.testing.assert_allclose(out.moe["balance"], [balance], rtol=1e-5)
    np.testing.assert_allclose(out.moe["z"], [z], rtol=1e-5)
    np.testing.assert_array_equal(out.moe["load"], [load])

    objective, (ce, lm_z, count, moe) = loss_fn(params, batch)
    assert float(count) == batch["mask"].sum()  # the loss mask counts targets, not routing
    np.testing.assert_allclose(objective - ce - lm_z,
                               count * (TC.moe_balance_loss * balance + TC.moe_z_loss * z),
                               rtol=1e-5)
    np.testing.assert_allclose(moe["balance"] / count, balance, rtol=1e-5)

    _, metrics = steps[1](state, batch)
    np.testing.assert_allclose(metrics["moe_balance"], balance, rtol=1e-5)
    np.testing.assert_allclose(metrics["moe_z"], z, rtol=1e-5)
    np.testing.assert_allclose(metrics["loss"], ce / count, rtol=1e-6)  # cross-entropy only
    assert set(k for k in metrics if k.startswith("moe_load")) == {"moe_load_max_mean/layer_1"}
    np.testing.assert_allclose(metrics["moe_load_max_mean/layer_1"], load.max() / load.mean(),
                               rtol=1e-6)


def test_the_chunked_loss_adds_the_same_router_losses(params, loss_fn):
    batch = _packed(0)
    chunked = jax.jit(make_loss_fn(MODEL, dataclasses.replace(TC, loss_chunk=7)),
                      compiler_options=FAST_COMPILE)(params, batch)
    chex.assert_trees_all_close(chunked, loss_fn(params, batch), rtol=1e-5)


def test_the_router_learns_from_the_router_losses_alone():
    """With top-1 routing renormalised, every token's weight is 1: the cross-entropy does not
    depend on the router, whose gradient is then that of the router losses, linear in their
    coefficients."""
    model = MODEL.replace(moe=MoE(n_experts=E, top_k=1, d_ff=24))
    params = _init(model, 1)
    batch = _batch(1)

    def objective(balance: float):
        tc = TrainConfig(batch_size=B, seq_len=T, moe_balance_loss=balance)
        return lambda p: make_loss_fn(model, tc)(p, batch)[0]

    def direct(p):  # count * mean over the sparse layers of the forward's balance, count = B*T
        return B * T * jnp.mean(Transformer(model).apply({"params": p}, batch["inputs"])
                                .moe["balance"])

    grads = jax.jit(lambda p: [jax.grad(f)(p)["blocks_1"]["moe"]["router"]
                               for f in (objective(0.0), objective(0.2), direct)],
                    compiler_options=FAST_COMPILE)(params)
    none, with_balance, balance = map(np.asarray, grads)
    scale = np.abs(with_balance).max()
    assert scale > 1e-3
    assert np.abs(none).max() < 1e-6 * scale
    np.testing.assert_allclose(with_balance, 0.2 * balance + none, rtol=1e-4, atol=1e-7 * scale)


def test_grad_accum_weights_the_router_losses_by_tokens(state, forward, steps):
    # Rows [r0, r0, r1, r1]: micro-batch a takes rows a and a + 2, so both micro-batches are
    # {r0, r1} and route as the whole batch does: accumulation must give the same step.
    half = _batch(2, b=2)
    batch = _full({k: np.repeat(v, 2, axis=0) for k, v in half.items()})
    (one, m1), (two, m2) = (steps[a](state, batch) for a in (1, 2))
    chex.assert_trees_all_close(two.params, one.params, rtol=2e-5, atol=1e-7)
    for key in m1:
        np.testing.assert_allclose(m2[key], m1[key], rtol=1e-5, err_msg=key)

    # Unequal micro-batches (a mask): the step's router losses are their token-weighted mean.
    batch = _full(dict(_batch(3), mask=np.array([[1] * T, [1] * 4 + [0] * 12] * 2,
                                                 np.float32)))
    _, metrics = steps[2](state, batch)
    # Each micro-batch's router losses from the forward (its rows twice: the batch's shape,
    # the same routing statistics), weighted by its targets.
    micro = [{k: v[a::2] for k, v in batch.items()} for a in (0, 1)]
    counts = np.array([m["mask"].sum() for m in micro])
    assert counts.tolist() == [2 * T, 8]
    outs = [forward(state.params, {k: np.repeat(v, 2, 0) for k, v in m.items()})[0].moe
            for m in micro]
    for name in ("balance", "z"):
        per_micro = np.array([float(o[name][0]) for o in outs])
        np.testing.assert_allclose(metrics[f"moe_{name}"],
                                   np.sum(counts * per_micro) / counts.sum(), rtol=1e-5)


def test_flops_and_active_params_count_k_of_e_experts():
    total, active = param_counts(MODEL)
    experts = 3 * E * MODEL.d_model * MODEL.moe.d_ff  # layer 1's gate, up, down
    assert total - active == experts * (E - K) // E
    dense = MODEL.replace(moe=None)
    # The active experts are 2 of width 24 = one dense FFN of width 48 (TINY's d_ff), plus the
    # router: the same FLOPs as the dense model's and the router's.
    router = MODEL.d_model * E
    assert flops_per_token(MODEL, T) == flops_per_token(dense, T) + 6 * router


def test_the_memory_estimate_counts_the_experts():
    from transformer_jax.parallel import sharding as sharding_lib
    from transformer_jax.train import memory

    mesh = sharding_lib.make_mesh(sharding_lib.MeshConfig.parse("1,1,1"), jax.devices()[:1])
    abstract = jax.eval_shape(make_init_fn(MODEL, TC), jax.random.key(0))
    shardings = sharding_lib.state_shardings(
        abstract, sharding_lib.param_shardings(MODEL, mesh))
    need = memory.estimate(MODEL, TC, abstract, shardings, dict(mesh.shape))
    # Layer 1's gate, up and down in float32, and Adam's two moments of each.
    assert need["experts"] == 3 * (3 * E * MODEL.d_model * MODEL.moe.d_ff) * 4
    # The sparse layer keeps k rows of D + 3F (and more) per token where the dense one kept 3F.
    dense = memory.activation_bytes(MODEL.replace(moe=None), TC, dict(mesh.shape))
    assert need["activations"] > dense


def _events(tb: Path) -> dict[str, list[float]]:
    """``tag -> values`` of the scalar summaries in a TensorBoard event directory."""
    from tensorboardX.proto import event_pb2

    out: dict[str, list[float]] = {}
    for path in sorted(tb.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        at = 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at:at + 8])
            event = event_pb2.Event.FromString(data[at + 12:at + 12 + length])
            at += 12 + length + 4
            for value in event.summary.value:
                out.setdefault(value.tag, []).append(value.simple_value)
    return out


@pytest.fixture
def compilation_cache(shared_compilation_cache):
    """A persistent compilation cache (conftest's), so the resumed run loads the first run's
    programs."""


def test_an_moe_run_logs_the_router_metrics_and_resumes_exactly(tmp_path, compilation_cache,
                                                                monkeypatch):
    corpus = tmp_path / "corpus.txt"
    words = ["def", "return", "x", "=", "+", "(", ")", "if", "else", "for", "in"]
    rng = np.random.default_rng(0)
    corpus.write_text("".join(" ".join(rng.choice(words, rng.integers(2, 9))) + "\n"
                              for _ in range(300)))
    data = DataConfig(path=str(corpus), tokenizer="char", cache_dir=str(tmp_path / "cache"),
                      val_fraction=0)  # no evaluation: not looked at
    # DeepSeek-V3's routing, with the correction biases updated by the balancing rule: the
    # resumed run must carry them on exactly.
    model = MODEL.replace(moe=MoE(n_experts=E, top_k=K, d_ff=24, score="sigmoid",
                                  correction_bias=True, routed_scale=2.0), scan_layers=True)

    monkeypatch.setattr(training, "_plot", lambda run_dir, times: None)  # loss.png: not looked at

    def run(name: str) -> Path:
        tc = TrainConfig(steps=4, batch_size=4, seq_len=16, warmup_steps=1, eval_every=0,
                         log_every=1, ckpt_every=2, sample_tokens=0,
                         run_dir=str(tmp_path / name), peak_flops=1e9, moe_balance_loss=0.1,
                         moe_z_loss=0.01, grad_accum=2, moe_bias_update_rate=0.05)
        training.run(model, tc, data, progress=False, memory_check=False)
        return tmp_path / name

    straight = run("straight")
    # The run as if killed after its step-2 checkpoint: the step-4 one gone, then resumed.
    shutil.copytree(straight, tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "4")
    resumed = run("resumed")

    def records(path: Path) -> list[dict]:
        lines = (path / "metrics.jsonl").read_text().splitlines()
        return [r for r in map(json.loads, lines) if r["split"] == "train"]

    expected = records(straight)
    assert [r["step"] for r in expected] == [1, 2, 3, 4]
    keys = {"moe_balance", "moe_z", "moe_load_max_mean/layer_0", "moe_load_max_mean/layer_1"}
    assert keys <= set(expected[0])
    timing = {"tokens_per_s", "mfu"}
    for got, want in zip(records(resumed), expected, strict=True):
        assert {k: v for k, v in got.items() if k not in timing} == \
            {k: v for k, v in want.items() if k not in timing}
    biases = [read_params(run / "checkpoints" / "4", None)[0]["blocks"]["moe"]["correction_bias"]
              for run in (straight, resumed)]
    np.testing.assert_array_equal(biases[1], biases[0])
    # 4 steps of +-0.05 (or 0) from 0, not all alike: the loads moved them.
    assert np.abs(biases[0]).max() > 0.09 and len(np.unique(np.round(biases[0] / 0.05))) > 2
    tags = _events(straight / "tb")
    assert {f"train/{k}" for k in keys} <= set(tags)
    assert tags["train/moe_balance"] == pytest.approx([r["moe_balance"] for r in expected])
