"""The assembled Transformer: causality, layouts, remat, dtypes, cache, logical axes."""

import functools
import logging
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import random_params
from hypothesis import given, settings
from hypothesis import strategies as st

from transformer_jax import KVCache, ModelConfig, Transformer, init_params
from transformer_jax.model import remat as remat_lib
from transformer_jax.model.config import REMATS
from transformer_jax.model.fields import MLA, MoE
from transformer_jax.model.kv_cache import cache_bytes
from transformer_jax.model.ops import target
from transformer_jax.model.transformer import logical_axes, stack_blocks, unstack_blocks

SMALL = ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                    max_seq_len=64)


def _outputs(out):
    """The logits, or (logits, cache) when the forward was given a cache."""
    return out.logits if out.cache is None else (out.logits, out.cache)


@functools.cache
def _apply(config):
    """A jitted forward of the model with this config (eager flax would compile op by op),
    one per config: tests of the same config and shapes (most use ``T`` tokens of 2 rows) run
    one compiled program."""
    return jax.jit(lambda params, *args, **kw: _outputs(
        Transformer(config).apply({"params": params}, *args, **kw)))


def _params(config, seed):
    """Random parameters drawn with numpy (helpers.random_params, every leaf random):
    ``init_params`` op by op compiles each of its ops (the public-API and parameter-dtype
    tests below still call it)."""
    return jax.device_put(random_params(config, seed))


#: The length of most tests' token batches (2 rows): one compiled forward per config.
T = 14


def _tokens(b, t, seed=0, vocab=97):
    return jnp.asarray(_np_tokens(b, t, seed, vocab))


def _np_tokens(b, t, seed=0, vocab=97):
    return np.random.default_rng(seed).integers(0, vocab, (b, t)).astype(np.int32)


@pytest.fixture(scope="module")
def initialised():
    """``init_params(SMALL, 0)`` (the public-API and dtype tests), in one program: op by op
    it compiles a program per op (~2 s here; other modules call it so, e.g.
    test_eval_sets.py)."""
    return jax.jit(init_params, static_argnums=(0, 1))(SMALL, 0)


def test_public_api_shapes_and_dtypes(initialised):
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(initialised))
    logits = _apply(SMALL)(initialised, _tokens(2, T))
    chex.assert_shape(logits, (2, T, 97))
    chex.assert_type(logits, jnp.float32)
    chex.assert_tree_all_finite(logits)


@functools.cache
def _causal_params():
    """Fixed random weights, made on first use (not at import, which every pytest-xdist
    worker does for every module, whether it runs this one or not)."""
    return _params(SMALL, 1)


@settings(max_examples=15, deadline=None)
@given(i=st.integers(0, T - 1), seed=st.integers(0, 2**16))
def test_future_tokens_never_change_past_logits(i, seed):
    # Tokens changed and logits compared in numpy: slices of device arrays of each i's shape
    # would each compile a program.
    tokens = _np_tokens(2, T, seed)
    changed = tokens.copy()
    changed[:, i + 1:] = _np_tokens(2, T, seed + 1)[:, i + 1:]
    forward = _apply(SMALL)
    a = np.asarray(forward(_causal_params(), jnp.asarray(tokens)))
    b = np.asarray(forward(_causal_params(), jnp.asarray(changed)))
    np.testing.assert_array_equal(a[:, : i + 1], b[:, : i + 1])
    if i < T - 1 and not np.array_equal(tokens, changed):
        assert not np.allclose(a[:, i + 1:], b[:, i + 1:])  # the test can see a change


@pytest.mark.parametrize("variant", [
    {}, {"n_kv_heads": 1, "tie_embeddings": True, "qkv_bias": True},
    {"norm": "layer", "ffn": "gelu", "norm_position": "post", "position": "sinusoidal"},
])
def test_scanned_stack_equals_unrolled(variant):
    c = SMALL.replace(**variant)
    params = _params(c, 2)
    tokens = _tokens(2, T)
    unrolled = _apply(c)(params, tokens)
    scanned_c = c.replace(scan_layers=True)
    # Jitted (one program each): op by op, the restacking compiles a program per op and shape.
    scanned_params = jax.jit(stack_blocks, static_argnums=1)(params, c)
    scanned = _apply(scanned_c)(scanned_params, tokens)
    np.testing.assert_allclose(unrolled, scanned, rtol=1e-5, atol=1e-5)
    # The scanned layout is what the scanned model initialises to, and round-trips.
    chex.assert_trees_all_equal_shapes(scanned_params,
                                       jax.eval_shape(lambda: init_params(scanned_c, 0)))
    chex.assert_trees_all_equal(jax.jit(unstack_blocks)(scanned_params), params)


# A mixture (a shared expert, a dense first layer) with latent attention: every name the
# policies go by (``model.remat``) is computed by one of SMALL or it.
MIXED = SMALL.replace(moe=MoE(4, 2, 32, shared_d_ff=16), n_layers=1, n_kv_heads=4,
                      mla=MLA(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                              v_head_dim=8), head_dim=4)


def _loss_and_grad(config, params, tokens, jaxpr=False):
    def loss(p):
        logits = Transformer(config).apply({"params": p}, tokens).logits
        return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 0])

    step = jax.value_and_grad(loss)
    return str(jax.make_jaxpr(step)(params)) if jaxpr else jax.jit(step)(params)


@functools.cache
def _no_remat(name, scan):
    # One block each: a policy acts block by block (and MIXED has one layer too); each block
    # less is a fifth less to trace and compile in every policy's gradient program.
    base = {"small": SMALL.replace(n_layers=1), "mixed": MIXED}[name].replace(scan_layers=scan)
    params, tokens = _params(base, 3), _tokens(2, 12)
    return base, params, tokens, _loss_and_grad(base, params, tokens)


@pytest.mark.parametrize("name, remat, scan", [
    *[("small", r, i % 2 == 0) for i, r in enumerate(REMATS[1:])],
    ("mixed", "offload_dots", False)])
def test_remat_changes_neither_outputs_nor_gradients(name, remat, scan):
    base, params, tokens, (l0, g0) = _no_remat(name, scan)
    l1, g1 = _loss_and_grad(base.replace(remat=remat), params, tokens)
    np.testing.assert_allclose(l0, l1, rtol=1e-6)
    chex.assert_trees_all_close(g0, g1, rtol=1e-5, atol=1e-6)


def test_offloading_policies_offload_for_a_device_target_only(caplog):
    """Traced for a TPU target, the step moves the policy's names to host memory (its
    backward reads them back; run here, where XLA:CPU lowers the moves as copies: the same
    loss and gradients). Traced for the CPU they stay in place, said in one log line."""
    base, params, tokens, (l0, g0) = _no_remat("small", True)
    c = base.replace(remat="offload_dots", attention_impl="xla")
    remat_lib._warned.clear()
    with target.targeting("tpu"):
        on_tpu = _loss_and_grad(c, params, tokens, jaxpr=True)
        l1, g1 = _loss_and_grad(c, params, tokens)
    with caplog.at_level(logging.INFO, "transformer_jax.model.remat"):
        on_cpu = _loss_and_grad(c, params, tokens, jaxpr=True)
    assert "MemorySpace.Host" in on_tpu and "MemorySpace.Host" not in on_cpu
    assert "stay in place" in caplog.text
    np.testing.assert_allclose(l0, l1, rtol=1e-6)
    chex.assert_trees_all_close(g0, g1, rtol=1e-5, atol=1e-6)


def test_every_name_a_policy_goes_by_is_computed():
    """The names the policies save (``model.remat.NAMES``) are those the forward computes."""
    def names(config):
        params = jax.eval_shape(lambda: random_params(config, 0))
        jaxpr = jax.make_jaxpr(lambda p: Transformer(config).apply(
            {"params": p}, _tokens(1, 4)).logits)(params)
        return set(re.findall(r"name\[name=(\w+)\]", str(jaxpr)))

    assert names(SMALL) | names(MIXED) == set(remat_lib.NAMES)


def test_bfloat16_compute_with_float32_params_returns_float32_logits(initialised):
    c = SMALL.replace(dtype="bfloat16")
    # init_params of the bfloat16 model makes float32 params (their dtypes, from the trace)
    abstract = jax.eval_shape(lambda: init_params(c, 4))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(abstract))
    params = initialised  # the same leaves (shapes and dtypes), random values
    chex.assert_trees_all_equal_shapes_and_dtypes(params, abstract)
    logits = _apply(c)(params, _tokens(2, T))
    chex.assert_type(logits, jnp.float32)
    full = _apply(SMALL)(params, _tokens(2, T))
    np.testing.assert_allclose(logits, full, atol=0.05)  # same model, bf16 rounding only


def test_explicit_positions_shift_invariance_with_rope():
    # With RoPE alone, shifting every position by the same offset leaves the logits unchanged.
    params = _params(SMALL, 5)
    tokens = _tokens(1, 10)
    pos = jnp.arange(10)[None]
    fwd = _apply(SMALL)
    a = fwd(params, tokens, pos)
    b = fwd(params, tokens, pos + 37)
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("variant", [{}, {"n_kv_heads": 1, "sliding_window": 4},
                                     {"scan_layers": True}])
def test_prefill_then_decode_equals_full_forward(variant):
    c = SMALL.replace(**variant)
    params = _params(c, 6)
    # numpy tokens and logits: eager slices of device arrays would compile a program each
    tokens = _np_tokens(2, T)
    fwd = _apply(c)
    full = np.asarray(fwd(params, tokens))
    cache = KVCache.init(c, batch=2, max_len=20)
    logits, cache = fwd(params, tokens[:, :9], cache=cache)
    np.testing.assert_allclose(logits, full[:, :9], rtol=1e-5, atol=1e-5)
    for t in range(9, 14):
        step, cache = fwd(params, tokens[:, t:t + 1], cache=cache)
        np.testing.assert_allclose(np.asarray(step)[:, 0], full[:, t], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(cache.lengths, [14, 14])


def test_ragged_positions_in_one_batch():
    # Row 1 continues from a shorter prefix than row 0; each equals its own full forward (the
    # causal forward of the whole row at that position: test_future_tokens_never_change_past_
    # logits). The shapes of test_prefill_then_decode_equals_full_forward: its programs.
    params = _params(SMALL, 7)
    fwd = _apply(SMALL)
    tokens = _np_tokens(2, T)
    cache = KVCache.init(SMALL, batch=2, max_len=20)
    _, cache = fwd(params, jnp.asarray(tokens[:, :9]), cache=cache)
    # row 1's prompt was 5 long: its cache's positions 5-8 are stale, to be overwritten or
    # left unread
    cache = cache.replace(lengths=jnp.array([9, 5], jnp.int32))
    nxt = jnp.asarray([[tokens[0, 9]], [tokens[1, 5]]])
    step, cache = fwd(params, nxt, cache=cache)
    step = np.asarray(step)
    full = np.asarray(fwd(params, jnp.asarray(tokens)))
    np.testing.assert_allclose(step[0, 0], full[0, 9], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(step[1, 0], full[1, 5], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(cache.lengths, [10, 6])


def test_cache_size_formula():
    c = SMALL.replace(dtype="bfloat16")
    cache = KVCache.init(c, batch=3, max_len=40)
    want = 2 * c.n_layers * 3 * 40 * c.n_kv_heads * c.head_dim * 2
    assert cache.nbytes == want == cache_bytes(c, 3, 40)
    # One row of slots per (sequence, kv head): [L, B, K, S, H] stacked for a scanned model,
    # L arrays [B, K, S, H] otherwise; keys optionally [H, S].
    keys = (8, 40) if cache.slots_last else (40, 8)
    stacked = KVCache.init(c.replace(scan_layers=True), batch=3, max_len=40)
    chex.assert_shape(stacked.v, (2, 3, 2, 40, 8))
    chex.assert_shape(jax.tree.leaves(stacked.k)[0], (2, 3, 2, *keys))
    assert stacked.nbytes == cache.nbytes
    unrolled = KVCache.init(c.replace(scan_layers=False), batch=3, max_len=40)
    chex.assert_shape(jax.tree.leaves(unrolled.k), [(3, 2, *keys)] * 2)  # (sequence, kv head)
    one = KVCache.init(c.replace(scan_layers=False), batch=1, max_len=40)  # no size-1 axis
    chex.assert_shape(jax.tree.leaves(one.k), [(2, *keys)] * 2)
    chex.assert_shape(jax.tree.leaves(one.layer(1)[0])[0], (1, 2, *keys))
    chex.assert_shape(jax.tree.leaves(unrolled.layer(1)[0])[0], (3, 2, *keys))


def test_latent_entries_are_written_at_their_slots_in_every_layout():
    """A latent layer's cache write (``KVCache.attend_latent``): per-layer or stacked buffers,
    one row (a dynamic-update-slice when per-layer) or two, each row from its own start."""
    rng = np.random.default_rng(0)
    for scan, batch in ((False, 1), (False, 2), (True, 1), (True, 2)):
        cache = KVCache.init(MIXED.replace(n_layers=2, scan_layers=scan), batch=batch, max_len=8)
        entries = rng.normal(size=(batch, 3, MIXED.mla.entry_dim)).astype(np.float32)
        positions = (np.arange(batch) + 2)[:, None] + np.arange(3)
        want = np.zeros((batch, 8, MIXED.mla.entry_dim), np.float32)
        want[np.arange(batch)[:, None], positions] = entries
        got, cache = cache.attend_latent(1, jnp.asarray(entries), jnp.asarray(positions))
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(cache.latent[1], want)
        assert not np.asarray(cache.latent[0]).any(), (scan, batch)  # the other layer untouched


def test_every_parameter_has_logical_axes():
    for scan in (False, True):
        c = SMALL.replace(scan_layers=scan, qkv_bias=True)
        axes = logical_axes(c)
        params = jax.eval_shape(lambda c=c: init_params(c, 0))
        names = {"vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "norm", "layers"}
        for spec, leaf in zip(jax.tree.leaves(axes, is_leaf=lambda x: isinstance(
                x, jax.sharding.PartitionSpec)), jax.tree.leaves(params), strict=True):
            assert len(spec) == leaf.ndim and set(spec) <= names
        if scan:
            assert axes["blocks"]["attn"]["q_proj"][0] == "layers"


def test_wrong_parameter_shapes_are_rejected():
    params = _params(SMALL, 0)
    bigger = SMALL.replace(d_ff=128)
    # flax checks the shapes as it traces (abstractly here: nothing compiles, as it would op
    # by op eagerly)
    with pytest.raises(Exception, match="shape"):
        jax.eval_shape(lambda p: Transformer(bigger).apply({"params": p}, _tokens(1, 4)), params)
