"""The mixture-of-experts ops: routing, every expert implementation against the dense
reference (values and gradients), the tile layout, the router losses, and the kernels."""

from __future__ import annotations

import sys
import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transformer_jax.model.ops import moe, moe_kernels

D, F = 16, 24


def _weights(e: int, seed: int = 0):
    # From numpy: jax.random.normal op by op would compile a program per expert count.
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal(shape, np.float32) * np.float32(0.3))
                 for shape in ((e, D, F), (e, D, F), (e, F, D)))


def _routing(rng: np.random.Generator, n: int, k: int, e: int, experts_used: int) -> moe.Routing:
    """k distinct experts per token drawn from the first ``experts_used`` (the rest receive no
    token), with random positive weights."""
    experts = np.stack([rng.choice(experts_used, size=k, replace=False) for _ in range(n)])
    weights = rng.uniform(0.1, 1.0, size=(n, k)).astype(np.float32)
    logits = rng.normal(size=(n, e)).astype(np.float32)
    return moe.Routing(jnp.asarray(weights), jnp.asarray(experts, jnp.int32),
                       jax.nn.softmax(jnp.asarray(logits)), jnp.asarray(logits))


@jax.jit
def _all_impls(x, routing, wg, wu, wd):
    return {impl: moe.experts_ffn(x, routing, wg, wu, wd, impl=impl)
            for impl in ("dense", "ragged", "tiled", "gather")}


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), shape=st.sampled_from(
    [(12, 2, 5, 5), (12, 2, 5, 2), (7, 1, 3, 1), (12, 3, 3, 3), (7, 1, 5, 4)]))
def test_every_impl_equals_the_dense_reference(seed, shape):
    n, k, e, used = shape
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(n, D)), jnp.float32)
    out = _all_impls(x, _routing(rng, n, k, e, used), *_weights(e, seed % 7))
    for impl in ("ragged", "tiled", "gather"):
        np.testing.assert_allclose(out[impl], out["dense"], atol=2e-5, rtol=1e-5, err_msg=impl)


def test_an_empty_slot_adds_nothing_in_every_impl():
    """An expert id of E (an expert-parallel shard's slot for another shard's expert) adds
    nothing, whatever its weight: the output of the routing with that slot's weight 0."""
    n, k, e = 12, 2, 5
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(n, D)), jnp.float32)
    routing, w = _routing(rng, n, k, e, e), _weights(e, 3)
    empty = jnp.asarray(rng.random((n, k)) < 0.3)
    got = _all_impls(x, routing.replace(experts=jnp.where(empty, e, routing.experts)), *w)
    want = _all_impls(x, routing.replace(weights=jnp.where(empty, 0.0, routing.weights)), *w)
    for impl, y in got.items():
        np.testing.assert_allclose(y, want["dense"], atol=2e-5, rtol=1e-5, err_msg=impl)


def _loss(impl):
    def loss(x, weights, wg, wu, wd, experts):
        logits = jnp.zeros((x.shape[0], wg.shape[0]))
        routing = moe.Routing(weights, experts, jax.nn.softmax(logits), logits)
        y = moe.experts_ffn(x, routing, wg, wu, wd, impl=impl)
        return jnp.sum(jnp.sin(y) * jnp.arange(y.size).reshape(y.shape) / y.size)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))


@pytest.mark.parametrize("impl", ["ragged", "tiled", "gather"])
def test_gradients_through_sort_and_gather_equal_the_reference(impl):
    rng = np.random.default_rng(3)
    n, k, e = 20, 2, 5
    routing = _routing(rng, n, k, e, 4)  # expert 4 gets no token: its gradient is 0
    x = jnp.asarray(rng.normal(size=(n, D)), jnp.float32)
    args = (x, routing.weights, *_weights(e, 1), routing.experts)
    want, got = _loss("dense")(*args), _loss(impl)(*args)
    for name, a, b in zip(("x", "routing weights", "gate", "up", "down"), want, got, strict=True):
        np.testing.assert_allclose(b, a, atol=2e-5, rtol=1e-4, err_msg=name)
    assert float(jnp.abs(got[2][4]).max()) == 0.0


@pytest.mark.parametrize("tile", [4, 8])
def test_tile_layout_groups_each_tile_by_one_expert(tile):
    rng = np.random.default_rng(0)
    n, k, e = 23, 2, 5
    experts = jnp.asarray(np.stack([rng.choice(e, 2, replace=False) for _ in range(n)]))
    lay = moe.tile_layout(experts, e, tile)
    pair_row, row_pair = np.asarray(lay.pair_row), np.asarray(lay.row_pair)
    flat = np.asarray(experts).reshape(-1)
    assert len(set(pair_row.tolist())) == n * k  # every pair has its own row
    np.testing.assert_array_equal(row_pair[pair_row], np.arange(n * k))  # and inverse
    tile_of = pair_row // tile
    np.testing.assert_array_equal(np.asarray(lay.tile_expert)[tile_of], flat)
    sizes = np.bincount(flat, minlength=e)
    assert int(lay.used) == int(np.sum(-(-sizes // tile)))
    assert row_pair.size == (n * k // tile + e) * tile  # the static bound


def test_one_expert_takes_every_token_and_one_each():
    # The tile bound's extremes: all pairs to one expert (no padding) and one pair per expert.
    x = jax.random.normal(jax.random.key(0), (9, D))
    for experts in (jnp.zeros((9, 1), jnp.int32), jnp.arange(9, dtype=jnp.int32)[:, None] % 5):
        logits = jnp.zeros((9, 5))
        routing = moe.Routing(jnp.ones((9, 1)), experts, jax.nn.softmax(logits), logits)
        out = _all_impls(x, routing, *_weights(5))
        np.testing.assert_allclose(out["tiled"], out["dense"], atol=2e-5, rtol=1e-5)


def test_route_matches_torch_topk_and_renormalises():
    torch = pytest.importorskip("torch")
    logits = np.random.default_rng(1).normal(size=(64, 7)).astype(np.float32)
    for k, score in ((1, "softmax"), (2, "softmax"), (7, "softmax"), (1, "sigmoid"),
                     (3, "sigmoid")):
        scores = (torch.softmax(torch.from_numpy(logits), dim=-1) if score == "softmax"
                  else torch.sigmoid(torch.from_numpy(logits)))
        values, indices = torch.topk(scores, k, dim=-1)
        probs = scores
        for renorm in (False, True):
            r = moe.route(jnp.asarray(logits), k, renorm, score)
            np.testing.assert_array_equal(r.experts, indices.numpy())
            want = values / values.sum(-1, keepdim=True) if renorm else values
            np.testing.assert_allclose(r.weights, want.numpy(), atol=1e-6)
            chex.assert_trees_all_close(r.probs, probs.numpy(), atol=1e-6)


def test_route_breaks_ties_towards_the_lower_index():
    r = moe.route(jnp.asarray([[0.0, 1.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0]]), 2, True)
    np.testing.assert_array_equal(r.experts, [[1, 2], [0, 1]])
    np.testing.assert_allclose(r.weights, 0.5)


def test_balance_z_and_load_against_direct_formulas():
    rng = np.random.default_rng(5)
    n, k, e = 30, 2, 5
    logits = rng.normal(size=(n, e)).astype(np.float32) * 2
    valid = rng.uniform(size=n) > 0.3
    r = moe.route(jnp.asarray(logits), k, True)
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    chosen = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    load = np.zeros(e)
    for t in np.flatnonzero(valid):
        load[chosen[t]] += 1
    np.testing.assert_allclose(moe.expert_load(r.experts, jnp.asarray(valid), e), load)
    f, p = load / valid.sum(), probs[valid].mean(0)
    np.testing.assert_allclose(moe.balance_loss(r, jnp.asarray(valid)), e * np.sum(f * p),
                               rtol=1e-5)
    lse = np.log(np.exp(logits).sum(-1))
    np.testing.assert_allclose(moe.router_z_loss(r, jnp.asarray(valid)),
                               np.mean(lse[valid] ** 2), rtol=1e-5)
    # A uniform router's balance loss is its minimum, k.
    flat = moe.route(jnp.zeros((8, 4)), 2, True)
    even = moe.Routing(flat.weights, jnp.asarray([[0, 1], [2, 3]] * 4, jnp.int32), flat.probs,
                       flat.logits)
    np.testing.assert_allclose(moe.balance_loss(even, jnp.ones(8, bool)), 2.0, rtol=1e-6)


def test_auto_picks_per_backend_and_size():
    assert moe.choose_impl("auto", 2, 2, 8, "cpu") == "gather"  # decode: 4 pairs, 8 experts
    assert moe.choose_impl("auto", 64, 2, 8, "cpu") == "tiled"
    assert moe.choose_impl("auto", 64, 2, 8, "tpu", (256, 512)) == "megablox"
    assert moe.choose_impl("auto", 64, 2, 8, "tpu", (96, 512)) == "ragged"
    assert moe.choose_impl("auto", 64, 2, 8, "gpu", (256, 512)) == "ragged"
    assert moe.choose_impl("dense", 2, 2, 8, "cpu") == "dense"
    with pytest.raises(ValueError, match="moe impl must be one of"):
        moe.experts_ffn(jnp.zeros((2, D)), moe.route(jnp.zeros((2, 3)), 1, True),
                        *_weights(3), impl="fast")


def test_megablox_lowers_for_tpu_forward_and_backward():
    x = jax.ShapeDtypeStruct((200, 128), jnp.bfloat16)  # rows padded to a whole tile inside
    w = jax.ShapeDtypeStruct((4, 128, 256), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((4,), jnp.int32)

    def grads(x, w, sizes):
        return jax.grad(lambda x, w: moe_kernels.megablox_matmul(x, w, sizes).astype(
            jnp.float32).sum(), argnums=(0, 1))(x, w)

    for fn in (moe_kernels.megablox_matmul, grads):
        exported = jax.export.export(jax.jit(fn), platforms=("tpu",))(x, w, sizes)
        assert "tpu_custom_call" in exported.mlir_module()


def test_kernels_refuse_clearly_where_they_cannot_run(monkeypatch):
    x, routing = jnp.zeros((16, D)), moe.route(jnp.zeros((16, 3)), 1, True)
    with pytest.raises(ValueError, match="runs on TPU only"):
        moe.experts_ffn(x, routing, *_weights(3), impl="megablox")
    with pytest.raises(ValueError, match="multiples of 128"):
        moe_kernels.megablox_matmul(jnp.zeros((8, 16)), jnp.zeros((2, 16, 24)),
                                    jnp.asarray([4, 4]))
    monkeypatch.setitem(sys.modules, "tokamax", None)  # as if not installed
    with pytest.raises(ValueError, match="kernels"):
        moe.experts_ffn(x, routing, *_weights(3), impl="tokamax")


def test_tokamax_gets_the_grouped_rows(monkeypatch):
    """tokamax checks the backend when called, so it cannot run or lower here: a stand-in
    module records what the sort passes it and answers with ragged_dot."""
    calls = []

    def ragged_dot(x, w, sizes, preferred_element_type=None):
        calls.append((x.shape, w.shape, sizes))
        return jax.lax.ragged_dot(x, w, sizes, preferred_element_type=preferred_element_type)

    monkeypatch.setitem(sys.modules, "tokamax", types.SimpleNamespace(ragged_dot=ragged_dot))
    rng = np.random.default_rng(2)
    routing = _routing(rng, 10, 2, 3, 3)
    x = jnp.asarray(rng.normal(size=(10, D)), jnp.float32)
    ws = _weights(3)
    got = moe.experts_ffn(x, routing, *ws, impl="tokamax")
    np.testing.assert_allclose(got, moe.experts_ffn(x, routing, *ws, impl="dense"), atol=2e-5)
    assert [c[:2] for c in calls] == [((20, D), (3, D, F)), ((20, D), (3, D, F)),
                                      ((20, F), (3, F, D))]
    np.testing.assert_array_equal(calls[0][2], np.bincount(np.asarray(routing.experts).ravel(),
                                                           minlength=3))
