"""The stack as layer groups (``model.stack``): how layers are cut into scanned groups, a
DeepSeek-shaped stack (dense layers, then sparse ones) scanned group by group with the unrolled
model's numbers and a program that does not grow with depth, and a Gemma-3-shaped cache that
holds per layer only what that layer reads."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from helpers import FAST_COMPILE, TINY, jaxpr_equations, jaxpr_primitives, random_params
from hypothesis import given, settings
from hypothesis import strategies as st

from transformer_jax.model.config import ModelConfig
from transformer_jax.model.fields import MoE
from transformer_jax.model.kv_cache import KVCache
from transformer_jax.model.stack import LayerSpec, block_paths, layer_groups
from transformer_jax.model.transformer import (
    Transformer,
    init_params,
    stack_blocks,
    unstack_blocks,
)
from transformer_jax.serving.paged_cache import PagedKVCache
from transformer_jax.train.loss import cross_entropy

L, G, D, M = (LayerSpec("local"), LayerSpec("global"), LayerSpec("global", "dense"),
              LayerSpec("global", "moe"))


def _cut(specs):
    return [(g.start, len(g.period), g.repeats) for g in layer_groups(tuple(specs))]


def test_stacks_are_cut_into_repeated_periods():
    gemma3 = ([L] * 5 + [G]) * 4 + [L] * 2  # 26 layers
    assert _cut(gemma3) == [(0, 6, 4), (24, 1, 2)]
    assert _cut([D] * 3 + [M] * 58) == [(0, 1, 3), (3, 1, 58)]  # DeepSeek-V3's 61
    assert _cut([M] * 7 + [D] + [M] * 4) == [(0, 1, 7), (7, 1, 1), (8, 1, 4)]
    assert _cut([D, M] * 12) == [(0, 2, 12)]
    assert _cut([G] * 32) == [(0, 1, 32)]
    groups = layer_groups(tuple(gemma3))
    # Each block's reference: its number, and its number among the layers of its kind.
    refs = [groups[0].ref(j, r) for r in range(4) for j in range(6)] + \
        [groups[1].ref(0, r) for r in range(2)]
    assert [r.index for r in refs] == list(range(26))
    assert [r.of_kind for r in refs if r.local] == list(range(22))
    assert [r.of_kind for r in refs if not r.local] == list(range(4))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([L, G, D, M]), min_size=1, max_size=40))
def test_groups_cover_every_layer_once_in_order(specs):
    groups = layer_groups(tuple(specs))
    rebuilt = [s for g in groups for s in g.period * g.repeats]
    assert rebuilt == specs
    assert [g.start for g in groups] == list(np.cumsum([0] + [g.size for g in groups])[:-1])


# A DeepSeek-shaped stack: 3 dense layers, then sparse ones (existing fields only).
def _deepseek(n_layers: int, scan: bool) -> ModelConfig:
    return TINY.replace(n_layers=n_layers, scan_layers=scan, d_model=32, n_heads=4,
                        n_kv_heads=2, d_ff=48, vocab_size=97, max_seq_len=32,
                        moe=MoE(n_experts=4, top_k=2, d_ff=16, dense_layers=(0, 1, 2)),
                        moe_impl="dense")  # every expert on every token: the quickest compile


def _loss(config: ModelConfig, params, tokens):
    logits = Transformer(config).apply({"params": params}, tokens[:, :-1]).logits
    return cross_entropy(logits, tokens[:, 1:])


# Jitted (one program each), not op by op: run eagerly, the restacking and the forward compile
# one small program per operation and shape (some 350 in the test below).
_stack = jax.jit(stack_blocks, static_argnums=1, compiler_options=FAST_COMPILE)
_unstack = jax.jit(unstack_blocks, compiler_options=FAST_COMPILE)


@functools.partial(jax.jit, static_argnums=0, compiler_options=FAST_COMPILE)
def _router_stats(config: ModelConfig, params, tokens):
    return Transformer(config).apply({"params": params}, tokens).moe


def test_a_dense_then_sparse_stack_trains_and_generates_scanned(fast_generate_compiles):
    from transformer_jax.decode.generation import generate

    unrolled = _deepseek(5, scan=False)
    scanned = unrolled.replace(scan_layers=True)
    # Every leaf random (numpy, helpers.random_params): no init program compiles.
    params = jax.device_put(random_params(unrolled, seed=0))
    stacked = _stack(params, scanned)
    assert [p for p, _ in block_paths(stacked)] == [("scan_0",), ("scan_1",)]
    assert stacked["scan_0"]["mlp"]["up"].shape[0] == 3  # three dense layers
    assert stacked["scan_1"]["moe"]["up"].shape[:2] == (2, 4)  # two sparse layers, 4 experts
    jax.tree.map(np.testing.assert_array_equal, _unstack(stacked), params)
    tokens = np.random.default_rng(0).integers(0, 97, (2, 12)).astype(np.int32)

    def grad(config):
        """The loss and its gradient, with the logits and router stats beside them: one
        program a layout, the unrolled one run again below as the reference forward."""
        def loss(p, tokens):
            out = Transformer(config).apply({"params": p}, tokens[:, :-1])
            return cross_entropy(out.logits, tokens[:, 1:]), (out.logits, out.moe)

        return jax.jit(jax.value_and_grad(loss, has_aux=True), compiler_options=FAST_COMPILE)

    unrolled_grad = grad(unrolled)
    (want_loss, (_, want_stats)), want_grad = unrolled_grad(params, tokens)
    (got_loss, (_, stats)), got_grad = grad(scanned)(stacked, tokens)
    # Scanned and unrolled programs fuse differently: float32 sums in another order.
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6),
                 _unstack(got_grad), want_grad)
    assert stats["load"].shape == (2, 4)  # the two sparse layers' stats, in layer order
    np.testing.assert_array_equal(stats["load"], want_stats["load"])  # counts: exact
    # The scanned model's cached decode is the unrolled model's greedy choice at every step:
    # each token the argmax of the unrolled forward over its prompt and the tokens before it
    # (right-padded: causal attention keeps the padding out of earlier positions).
    prompts = [[5, 9, 2, 7, 1], [4, 6]]
    got = generate(scanned, stacked, prompts, max_new_tokens=5).tokens
    seqs = np.zeros_like(tokens)
    for row, (prompt, new) in enumerate(zip(prompts, got, strict=True)):
        assert len(new) == 5
        seqs[row, :len(prompt) + 5] = prompt + list(new)
    (_, (logits, _)), _ = unrolled_grad(params, seqs)
    for row, (prompt, new) in enumerate(zip(prompts, got, strict=True)):
        steps = np.asarray(logits[row, len(prompt) - 1:len(prompt) + 4])
        assert np.argmax(steps, -1).tolist() == list(new), row


def test_a_periods_sparse_layers_report_their_router_stats_in_layer_order():
    """A period with several sparse blocks (2 local : 1 global, every FFN a mixture, scanned
    twice): the stacked router stats follow the layers, as the unrolled model gives them."""
    config = TINY.replace(n_layers=6, sliding_window=3, layer_pattern=("local", "local", "global"),
                          moe=MoE(n_experts=4, top_k=1, d_ff=16), moe_impl="dense")
    scanned = config.replace(scan_layers=True)
    assert [(len(g.period), g.repeats) for g in scanned.layer_groups()] == [(3, 2)]
    params = jax.device_put(random_params(config, seed=1))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 9)), jnp.int32)
    want = _router_stats(config, params, tokens)
    got = _router_stats(scanned, _stack(params, scanned), tokens)
    assert not np.array_equal(want["load"][0], want["load"][1])  # the layers route apart
    np.testing.assert_array_equal(got["load"], want["load"])  # counts: exact


def test_a_dense_then_sparse_program_does_not_grow_with_depth():
    """The train step's and a decode step's programs are the same at 8 and 64 layers: each
    group scans, nothing is unrolled per layer."""
    def programs(n_layers: int) -> tuple[int, int]:
        config = _deepseek(n_layers, scan=True)
        params = jax.eval_shape(lambda: init_params(config, 0))
        tokens = jax.ShapeDtypeStruct((2, 9), jnp.int32)
        train = jax.make_jaxpr(jax.grad(lambda p, t: _loss(config, p, t)))(params, tokens)
        cache = jax.eval_shape(lambda: KVCache.init(config, 2, 16))
        step = jax.make_jaxpr(lambda p, t, c: Transformer(config).apply(
            {"params": p}, t, cache=c).logits)(params, jax.ShapeDtypeStruct((2, 1), jnp.int32),
                                               cache)
        return jaxpr_equations(train.jaxpr), jaxpr_equations(step.jaxpr)

    assert programs(8) == programs(64)


def test_a_five_to_one_cache_holds_per_layer_only_what_it_reads():
    """Gemma-3-shaped (5 local : 1 global, 14 layers: two periods and two local layers): a
    local layer keeps W slots, a global one S_max, and the cache's leaves are exactly that
    sum; a scanned decode step selects nothing by a traced layer index (no ``cond``)."""
    w, s_max, b = 4, 32, 3
    config = TINY.replace(n_layers=14, sliding_window=w, max_seq_len=s_max,
                          layer_pattern=("local",) * 5 + ("global",))
    k, h = config.n_kv_heads, config.head_dim
    per_layer = [2 * b * k * h * 4 * (w if kind == "local" else s_max)
                 for kind in config.layer_kinds()]
    for scan in (False, True):
        c = config.replace(scan_layers=scan)
        cache = jax.eval_shape(lambda c=c: KVCache.init(c, b, s_max, "float32"))
        held = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(
            (cache.k, cache.v, cache.k_local, cache.v_local)))
        assert held == sum(per_layer), scan
        paged = jax.eval_shape(lambda c=c: PagedKVCache.init(c, 9, 4, b, 8, "float32",
                                                             slots=b))
        pages = sum(x.size * 4 for x in jax.tree.leaves((paged.k, paged.v)))
        rings = sum(x.size * 4 for x in jax.tree.leaves((paged.k_ring, paged.v_ring)))
        assert pages == 2 * config.layer_kinds().count("global") * 9 * 4 * k * h * 4  # bytes
        assert rings == sum(n for n, kind in zip(per_layer, config.layer_kinds(), strict=True)
                            if kind == "local")
    scanned = config.replace(scan_layers=True)
    params = jax.eval_shape(lambda: init_params(scanned, 0))
    cache = jax.eval_shape(lambda: KVCache.init(scanned, b, s_max))
    step = jax.make_jaxpr(lambda p, t, c: Transformer(scanned).apply(
        {"params": p}, t, cache=c).logits)(params, jax.ShapeDtypeStruct((b, 1), jnp.int32), cache)
    names = jaxpr_primitives(step.jaxpr)
    assert "scan" in names and "cond" not in names
