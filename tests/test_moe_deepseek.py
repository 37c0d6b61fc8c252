"""DeepSeek-V3's routing as ``MoE`` fields: sigmoid scores, the correction bias that only
chooses, group-limited top-k, the routed scale and an ungated shared expert (against numpy and
against transformers' ``DeepseekV3MoE`` with the same random weights, in every experts impl),
and the auxiliary-loss-free balancing update of the bias in training (against numpy over a few
steps, with the optimizer leaving the bias alone)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FAST_COMPILE, TINY

from transformer_jax.model.fields import MoE
from transformer_jax.model.moe import CORRECTION_BIAS, SparseFFN, balance_correction_bias
from transformer_jax.model.ops import moe as moe_ops
from transformer_jax.model.transformer import Transformer
from transformer_jax.train.config import TrainConfig
from transformer_jax.train.step import make_init_fn, make_train_step

N, D, F, E, K = 24, 16, 8, 8, 3
GROUPS, TOP_GROUPS, SCALE = 4, 2, 2.5


def numpy_route(logits, bias, k, n_groups, top_groups, renormalize, scale, score="sigmoid"):
    """Per token, as DeepSeek-V3's reference describes it: biased scores, each group's two
    best summed, the best groups kept, the top k of their experts; weights unbiased."""
    logits = np.asarray(logits, np.float64)
    if score == "sigmoid":
        probs = 1 / (1 + np.exp(-logits))
    else:
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
    experts, weights = [], []
    size = logits.shape[1] // n_groups
    for p in probs:
        choice = p + bias
        groups = [sorted(choice[g * size:(g + 1) * size])[-2:] for g in range(n_groups)]
        best = np.argsort([-sum(g) for g in groups], kind="stable")[:top_groups]
        allowed = [e for e in range(len(p)) if e // size in best]
        top = sorted(allowed, key=lambda e: -choice[e])[:k]
        w = p[top] / (p[top].sum() if renormalize else 1.0) * scale
        experts.append(top)
        weights.append(w)
    return np.array(experts), np.array(weights)


@pytest.mark.parametrize("groups, top_groups, renormalize, score", [
    (GROUPS, TOP_GROUPS, True, "sigmoid"), (GROUPS, 1, False, "sigmoid"),
    (1, 1, True, "sigmoid"), (2, 1, True, "softmax")])
def test_route_matches_numpy(groups, top_groups, renormalize, score):
    rng = np.random.default_rng(groups + top_groups)
    logits = rng.normal(size=(N, E)).astype(np.float32)
    bias = rng.normal(size=E).astype(np.float32) * 0.5
    k = 2 if top_groups == 1 and groups > 1 else K
    r = moe_ops.route(jnp.asarray(logits), k, renormalize, score, choice_bias=jnp.asarray(bias),
                      n_groups=groups, top_groups=top_groups, scale=SCALE)
    experts, weights = numpy_route(logits, bias, k, groups, top_groups, renormalize, SCALE,
                                   score)
    np.testing.assert_array_equal(r.experts, experts)
    np.testing.assert_allclose(r.weights, weights, rtol=1e-5)
    # The bias changes the choice, so a test without it would not see it.
    plain = moe_ops.route(jnp.asarray(logits), k, renormalize, score, n_groups=groups,
                          top_groups=top_groups, scale=SCALE)
    assert (np.asarray(plain.experts) != experts).any()


def test_the_bias_gets_no_gradient_and_the_weights_do():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(N, E)), jnp.float32)

    def total(logits, bias):
        r = moe_ops.route(logits, K, True, "sigmoid", choice_bias=bias, n_groups=GROUPS,
                          top_groups=TOP_GROUPS, scale=SCALE)
        return jnp.sum(r.weights * jnp.arange(K))

    g_logits, g_bias = jax.grad(total, argnums=(0, 1))(logits, jnp.ones(E) * 0.1)
    assert float(jnp.abs(g_bias).max()) == 0.0
    assert float(jnp.abs(g_logits).max()) > 1e-3


@pytest.fixture(scope="module")
def torch_moe():
    """transformers' DeepseekV3MoE with random weights and bias, and ours as params."""
    torch = pytest.importorskip("torch")
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    hf = DeepseekV3Config(hidden_size=D, moe_intermediate_size=F, n_routed_experts=E,
                          num_experts_per_tok=K, n_group=GROUPS, topk_group=TOP_GROUPS,
                          norm_topk_prob=True, routed_scaling_factor=SCALE, n_shared_experts=2,
                          hidden_act="silu")
    torch.manual_seed(0)
    module = DeepseekV3MoE(hf).eval()
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.3)
        module.gate.e_score_correction_bias.normal_(0, 0.3)
    t = {k: v.detach().numpy() for k, v in module.state_dict().items()}
    gate_up = t["experts.gate_up_proj"]  # [E, 2F, D], gate rows first
    params = {"router": t["gate.weight"].T, CORRECTION_BIAS: t["gate.e_score_correction_bias"],
              "gate": gate_up[:, :F].transpose(0, 2, 1), "up": gate_up[:, F:].transpose(0, 2, 1),
              "down": t["experts.down_proj"].transpose(0, 2, 1),
              "shared": {n: t[f"shared_experts.{n}_proj.weight"].T
                         for n in ("gate", "up", "down")}}
    x = np.random.default_rng(1).normal(size=(2, N // 2, D)).astype(np.float32)
    with torch.no_grad():
        want = module(torch.from_numpy(x)).numpy()
    return params, x, want


@pytest.mark.parametrize("impl", ["dense", "gather", "tiled", "ragged"])
def test_sparse_ffn_matches_transformers_deepseek_v3_moe(torch_moe, impl):
    params, x, want = torch_moe
    moe = MoE(n_experts=E, top_k=K, d_ff=F, score="sigmoid", correction_bias=True,
              n_groups=GROUPS, top_groups=TOP_GROUPS, routed_scale=SCALE, shared_d_ff=2 * F)
    module = SparseFFN(moe=moe, impl=impl)
    shapes = jax.eval_shape(module.init, jax.random.key(0), x)["params"]
    shapes = jax.tree.map(lambda p: p.value.shape, shapes, is_leaf=lambda p: hasattr(p, "value"))
    assert shapes == jax.tree.map(np.shape, params)
    y, _ = jax.jit(module.apply)({"params": params}, x)
    np.testing.assert_allclose(y, want, atol=2e-5, rtol=1e-5)
    if impl != "dense":
        return
    # Each piece matters: without the bias, the groups or the scale the output moves.
    for change in (dict(correction_bias=False), dict(n_groups=1, top_groups=1),
                   dict(routed_scale=1.0)):
        other = SparseFFN(moe=dataclasses.replace(moe, **change), impl=impl)
        kept = {k: v for k, v in params.items() if k != CORRECTION_BIAS or "n_groups" in change
                or "routed_scale" in change}
        moved = np.abs(np.asarray(jax.jit(other.apply)({"params": kept}, x)[0]) - want).max()
        assert moved > 1e-2, change


@pytest.mark.parametrize("fields, message", [
    (dict(n_groups=3), "equal groups of at least 2"),
    (dict(n_groups=8), "equal groups of at least 2"),
    (dict(n_groups=4, top_groups=5), "top_groups (5) must be at most moe.n_groups (4)"),
    (dict(n_groups=4, top_groups=1), "top_k=3 is more than the 2 experts"),
    (dict(routed_scale=0.0), "routed_scale must be a positive finite number"),
    (dict(correction_bias=1), "correction_bias must be a bool"),
])
def test_bad_routing_fields_are_refused_in_one_line(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        MoE(n_experts=E, top_k=K, d_ff=F, **fields)


# --------------------------------------------------------------------- the balancing update

RATE, B, T = 0.01, 4, 8
SPARSE = dict(n_experts=E, top_k=2, d_ff=16, score="sigmoid", correction_bias=True,
              n_groups=GROUPS, top_groups=TOP_GROUPS, routed_scale=SCALE)
# first_k_dense_replace = 1: the dense layer, then the sparse ones (two groups when scanned).
MODEL = TINY.replace(n_layers=3, scan_layers=True, moe=MoE(**SPARSE, dense_layers=(0,)))


def _biases(params) -> np.ndarray:
    """[L_sparse, E]: the sparse layers' correction biases (the second group's stack)."""
    return np.asarray(params["scan_1"]["moe"][CORRECTION_BIAS])


def test_the_bias_update_equals_numpy_over_steps():
    groups = [(g.period, g.repeats) for g in MODEL.layer_groups()]
    assert len(groups) == 2 and groups[0][0][0].ffn == "dense" and groups[1][1] == 2
    tc = TrainConfig(batch_size=B, seq_len=T, lr=1e-2, min_lr=1e-2, warmup_steps=0,
                     weight_decay=0.5, moe_bias_update_rate=RATE)
    state = jax.jit(make_init_fn(MODEL, tc), compiler_options=FAST_COMPILE)(jax.random.key(0))
    step = jax.jit(make_train_step(MODEL, tc), compiler_options=FAST_COMPILE)
    forward = jax.jit(lambda p, x: Transformer(MODEL).apply({"params": p}, x).moe["load"],
                      compiler_options=FAST_COMPILE)
    rng = np.random.default_rng(0)
    bias = np.zeros((len(MODEL.sparse_layers), E), np.float32)
    assert (_biases(state.params) == bias).all()
    for _ in range(3):
        tokens = rng.integers(0, MODEL.vocab_size, (B, T + 1), np.int32)
        batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
        load = np.asarray(forward(state.params, batch["inputs"]), np.float64)  # [L_sparse, E]
        assert (load.sum(-1) == B * T * 2).all()
        bias = bias + np.float32(RATE) * np.sign(load.mean(-1, keepdims=True) - load
                                                 ).astype(np.float32)
        old = state.params
        state, _ = step(state, batch)
        # Exactly the update: the optimizer (Adam, weight decay 0.5) added nothing to it.
        np.testing.assert_array_equal(_biases(state.params), bias)
        changed = jax.tree.map(lambda a, b: bool((a != b).any()), old, state.params)
        assert all(jax.tree.leaves(changed))  # every other weight trained
    assert len(np.unique(bias)) > 2  # the layers' experts went their own ways
    # Adam's moments of the bias are still exactly 0 (no gradient ever reached it).
    moments = [(jax.tree_util.keystr(p), x) for p, x in
               jax.tree_util.tree_flatten_with_path(state.opt_state)[0]
               if CORRECTION_BIAS in jax.tree_util.keystr(p)]
    assert len(moments) == 2 and all(float(jnp.abs(x).max()) == 0.0 for _, x in moments)


def test_the_bias_update_reads_every_layout():
    """Unrolled, and a period of (dense, sparse) layers scanned: the same update per layer."""
    rng = np.random.default_rng(1)
    load = rng.integers(0, 9, (2, E)).astype(np.float32)  # layers 1 and 3
    step = RATE * np.sign(load.mean(-1, keepdims=True) - load)
    old = rng.normal(size=(2, E)).astype(np.float32)
    dense = {"mlp": {"up": np.zeros((2, 3), np.float32)}}
    unrolled = {"embed": {}, "blocks_0": dense, "blocks_2": dense,
                **{f"blocks_{i}": {"moe": {CORRECTION_BIAS: old[j]}} for j, i in enumerate((1, 3))}}
    got = balance_correction_bias(unrolled, jnp.asarray(load), RATE, (1, 3))
    np.testing.assert_allclose([got["blocks_1"]["moe"][CORRECTION_BIAS],
                                got["blocks_3"]["moe"][CORRECTION_BIAS]], old + step, rtol=1e-6)
    assert got["blocks_0"] is dense  # the input tree is left as it was
    np.testing.assert_array_equal(unrolled["blocks_1"]["moe"][CORRECTION_BIAS], old[0])
    scanned = {"blocks": {"layer_0": {"mlp": {"up": np.zeros((2, 2, 3), np.float32)}},
                          "layer_1": {"moe": {CORRECTION_BIAS: old}}}}
    got = balance_correction_bias(scanned, jnp.asarray(load), RATE, (1, 3))
    np.testing.assert_allclose(got["blocks"]["layer_1"]["moe"][CORRECTION_BIAS], old + step,
                               rtol=1e-6)


def test_lora_and_qlora_leave_the_bias_alone_and_the_rate_is_refused_with_them():
    from transformer_jax.model import lora

    model = MODEL
    tc = TrainConfig(batch_size=B, seq_len=T, lora_rank=2, lora_targets="q,experts.gate",
                     lora_base_quant="int8")
    state = jax.eval_shape(make_init_fn(model, tc), jax.random.key(0))
    adapters = jax.tree_util.tree_flatten_with_path(state.params[lora.ADAPTERS])[0]
    assert adapters and not any(CORRECTION_BIAS in jax.tree_util.keystr(p) for p, _ in adapters)
    base_bias = state.params[lora.BASE]["scan_1"]["moe"][CORRECTION_BIAS]
    assert (base_bias.shape, base_bias.dtype) == ((2, E), jnp.float32)  # not quantised
    with pytest.raises(ValueError, match="full sft training only"):
        dataclasses.replace(tc, moe_bias_update_rate=RATE)
    with pytest.raises(ValueError, match="moe_bias_update_rate must be >= 0"):
        TrainConfig(moe_bias_update_rate=-1.0)


def test_the_rate_needs_a_correction_bias_and_decode_keeps_it_float32():
    from transformer_jax.decode.weights import decode_params
    from transformer_jax.train.checks import check_config

    tc = TrainConfig(batch_size=B, seq_len=T, moe_bias_update_rate=RATE)
    with pytest.raises(ValueError, match="correction_bias=false"):
        check_config(TINY.replace(moe=MoE(n_experts=E, top_k=2, d_ff=16)), tc, 1)
    check_config(MODEL, tc, 1)
    model = MODEL.replace(dtype="bfloat16")
    params = jax.eval_shape(lambda: decode_params(
        model, jax.tree.map(jnp.zeros_like, jax.eval_shape(
            lambda: make_init_fn(model, tc)(jax.random.key(0)).params)), out_first=False))
    assert params["scan_1"]["moe"][CORRECTION_BIAS].dtype == jnp.float32
    assert params["scan_1"]["moe"]["router"].dtype == jnp.bfloat16
