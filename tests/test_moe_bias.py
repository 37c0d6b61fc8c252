"""Experts with biases, a biased router and the clamped SwiGLU, against numpy per token."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.model.config import ModelConfig
from transformer_jax.model.moe import SparseFFN
from transformer_jax.model.ops import moe as moe_ops
from transformer_jax.model.ops.ffn import swiglu_glu

N, D, F, E, K = 12, 8, 6, 4, 2
LIMIT, ALPHA = 1.5, 1.702


def numpy_glu(gate, up):
    gate = np.minimum(gate, LIMIT)
    up = np.clip(up, -LIMIT, LIMIT)
    return gate / (1 + np.exp(-ALPHA * gate)) * (up + 1)


def numpy_moe(*arrays):
    """Per token: logits + bias, top-k, softmax over the chosen, each expert's biased FFN."""
    x, router, router_bias, wg, wu, wd, bg, bu, bd = map(np.asarray, arrays)
    out = np.zeros_like(x)
    for i, row in enumerate(x):
        logits = row @ router + router_bias
        top = np.argsort(-logits)[:K]
        w = np.exp(logits[top] - logits[top].max())
        w /= w.sum()
        for e, we in zip(top, w, strict=True):
            h = numpy_glu(row @ wg[e] + bg[e], row @ wu[e] + bu[e])
            out[i] += we * (h @ wd[e] + bd[e])
    return out


@pytest.fixture(scope="module")
def weights():
    keys = jax.random.split(jax.random.key(0), 9)
    shapes = [(N, D), (D, E), (E,), (E, D, F), (E, D, F), (E, F, D), (E, F), (E, F), (E, D)]
    return [jax.random.normal(k, s) for k, s in zip(keys, shapes, strict=True)]


def test_swiglu_glu_clamps():
    gate, up = jnp.array([-9.0, 0.5, 9.0]), jnp.array([-9.0, 0.5, 9.0])
    got = swiglu_glu(gate, up, limit=LIMIT, alpha=ALPHA, up_offset=1.0)
    np.testing.assert_allclose(got, numpy_glu(np.asarray(gate), np.asarray(up)), rtol=1e-6)
    np.testing.assert_allclose(swiglu_glu(gate, up), jax.nn.silu(gate) * up, rtol=1e-6)


@pytest.mark.parametrize("impl", ["dense", "gather", "tiled", "ragged"])
def test_biased_experts_match_numpy(weights, impl):
    x, router, rb, wg, wu, wd, bg, bu, bd = weights
    logits = x @ router + rb
    routing = moe_ops.route(logits, K, True)  # renormalised top-k = softmax over the chosen
    glu = functools.partial(swiglu_glu, limit=LIMIT, alpha=ALPHA, up_offset=1.0)
    got = moe_ops.experts_ffn(x, routing, wg, wu, wd, impl=impl, glu=glu,
                              biases=(bg, bu, bd))
    np.testing.assert_allclose(got, numpy_moe(*weights), atol=1e-4)


def test_sparse_ffn_module(weights):
    """The module's parameters (router_bias, gate/up/down_bias) and its swiglu fields."""
    x, router, rb, wg, wu, wd, bg, bu, bd = weights
    config = ModelConfig(d_model=D, swiglu_limit=LIMIT, swiglu_alpha=ALPHA,
                         swiglu_up_offset=1.0,
                         moe=dict(n_experts=E, top_k=K, d_ff=F, router_bias=True,
                                  expert_bias=True))
    module = SparseFFN(moe=config.moe, swiglu=config.swiglu, impl="dense")
    params = {"router": router, "router_bias": rb, "gate": wg, "up": wu, "down": wd,
              "gate_bias": bg, "up_bias": bu, "down_bias": bd}
    shapes = jax.eval_shape(module.init, jax.random.key(0), x[None])["params"]
    shapes = jax.tree.map(lambda p: p.value, shapes, is_leaf=lambda p: hasattr(p, "value"))
    assert {k: v.shape for k, v in shapes.items()} == {k: v.shape for k, v in params.items()}
    y, _ = module.apply({"params": params}, x[None])
    np.testing.assert_allclose(y[0], numpy_moe(*weights), atol=1e-4)
