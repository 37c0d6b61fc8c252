"""Each claim of the math in ``transformer_jax.ops`` as a test, against independent numpy code."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import numpy_attention
from hypothesis import given, settings
from hypothesis import strategies as st

from transformer_jax.model import ops
from transformer_jax.model.config import RopeScaling

SETTINGS = settings(max_examples=30, deadline=None)


def _rng(seed=0):
    return np.random.default_rng(seed)


# Norms ------------------------------------------------------------------------------------------

def test_rms_norm_matches_formula():
    x = _rng().normal(size=(2, 3, 16)).astype(np.float32)
    scale = _rng(1).normal(size=16).astype(np.float32)
    want = x / np.sqrt(np.mean(x**2, -1, keepdims=True) + 1e-6) * scale
    np.testing.assert_allclose(ops.rms_norm(jnp.asarray(x), jnp.asarray(scale), 1e-6), want,
                               rtol=1e-5, atol=1e-6)


def test_layer_norm_matches_formula():
    x = _rng().normal(3.0, 2.0, size=(2, 3, 16)).astype(np.float32)
    scale, bias = _rng(1).normal(size=(2, 16)).astype(np.float32)
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    want = (x - mu) / np.sqrt(var + 1e-5) * scale + bias
    got = ops.layer_norm(jnp.asarray(x), jnp.asarray(scale), jnp.asarray(bias))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_norms_compute_in_float32_for_bfloat16_input(norm):
    # Large-magnitude bf16 inputs: squaring in bf16 would lose the statistics' precision.
    x32 = _rng().normal(100.0, 1.0, size=(1, 4, 64)).astype(np.float32)
    xb = jnp.asarray(x32, jnp.bfloat16)
    ones, zeros = jnp.ones(64), jnp.zeros(64)
    fn = {"rms": lambda x: ops.rms_norm(x, ones), "layer": lambda x: ops.layer_norm(x, ones, zeros)}
    got = fn[norm](xb)
    assert got.dtype == jnp.bfloat16
    want = fn[norm](xb.astype(jnp.float32))  # same input values, all in float32
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=1e-2,
                               atol=1e-2)


# RoPE -------------------------------------------------------------------------------------------

def _rotate(vec, pos, pairing="half", base=10000.0):
    x = jnp.asarray(vec, jnp.float32)[None, None, None, :]
    p = jnp.full((1, 1), pos, jnp.int32)
    return np.asarray(ops.apply_rope(x, p, base=base, pairing=pairing))[0, 0, 0]


def _rope_numpy_adjacent(vec, pos, base=10000.0):
    """The RoFormer formula written out pair by pair."""
    d = len(vec)
    out = np.empty(d)
    for i in range(d // 2):
        theta = base ** (-2 * i / d)
        c, s = math.cos(pos * theta), math.sin(pos * theta)
        out[2 * i] = c * vec[2 * i] - s * vec[2 * i + 1]
        out[2 * i + 1] = s * vec[2 * i] + c * vec[2 * i + 1]
    return out


@SETTINGS
@given(pos=st.integers(0, 5000), seed=st.integers(0, 2**16))
def test_rope_adjacent_matches_rotation_matrices(pos, seed):
    vec = _rng(seed).normal(size=16)
    # float32 angles: pos * theta is rounded to within pos * eps (theta <= 1), which moves each
    # output by up to that much times the pair's norm; the float64 formula has no such error.
    bound = 2 * pos * np.finfo(np.float32).eps * np.abs(vec).max()
    np.testing.assert_allclose(_rotate(vec, pos, "adjacent"), _rope_numpy_adjacent(vec, pos),
                               rtol=1e-5, atol=1e-5 + bound)


@SETTINGS
@given(m=st.integers(0, 2000), n=st.integers(0, 2000), shift=st.integers(0, 2000),
       seed=st.integers(0, 2**16), pairing=st.sampled_from(["half", "adjacent"]))
def test_rope_dot_product_depends_only_on_offset(m, n, shift, seed, pairing):
    q, k = _rng(seed).normal(size=(2, 32))
    a = _rotate(q, m, pairing) @ _rotate(k, n, pairing)
    b = _rotate(q, m + shift, pairing) @ _rotate(k, n + shift, pairing)
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-3)


@SETTINGS
@given(pos=st.integers(0, 10**5), seed=st.integers(0, 2**16),
       pairing=st.sampled_from(["half", "adjacent"]))
def test_rope_preserves_norm(pos, seed, pairing):
    vec = _rng(seed).normal(size=64)
    np.testing.assert_allclose(np.linalg.norm(_rotate(vec, pos, pairing)), np.linalg.norm(vec),
                               rtol=1e-5)


def test_rope_pairings_agree_after_permutation():
    h = 16
    perm = np.concatenate([np.arange(0, h, 2), np.arange(1, h, 2)])  # evens first, then odds
    x = jnp.asarray(_rng().normal(size=(2, 5, 3, h)), jnp.float32)
    pos = jnp.asarray(_rng(1).integers(0, 1000, size=(2, 5)), jnp.int32)
    adjacent = ops.apply_rope(x, pos, pairing="adjacent")
    half = ops.apply_rope(x[..., perm], pos, pairing="half")
    np.testing.assert_allclose(np.asarray(adjacent)[..., perm], half, rtol=1e-5, atol=1e-5)


def test_rope_position_zero_is_identity_and_positions_are_per_token():
    x = jnp.asarray(_rng().normal(size=(2, 3, 2, 8)), jnp.float32)
    pos = jnp.array([[0, 0, 0], [5, 9, 2]], jnp.int32)
    out = np.asarray(ops.apply_rope(x, pos))
    np.testing.assert_allclose(out[0], np.asarray(x)[0], atol=1e-6)
    for t, p in enumerate([5, 9, 2]):  # each token rotated by its own position
        np.testing.assert_allclose(out[1, t, 0], _rotate(np.asarray(x)[1, t, 0], p), atol=1e-5)


def test_rope_frequencies_and_scaling():
    h, base = 64, 500000.0
    plain = np.asarray(ops.rope_frequencies(h, base))
    np.testing.assert_allclose(plain, [base ** (-2 * i / h) for i in range(h // 2)], rtol=1e-6)
    linear = ops.rope_frequencies(h, base, RopeScaling("linear", 4.0))
    np.testing.assert_allclose(linear, plain / 4.0, rtol=1e-6)
    sc = RopeScaling("llama3", 8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                     original_max_len=8192)
    got = np.asarray(ops.rope_frequencies(h, base, sc))
    for f, g in zip(plain, got, strict=True):  # the Llama 3.1 rule, one frequency at a time
        wavelen = 2 * math.pi / f
        if wavelen < 8192 / 4.0:
            want = f
        elif wavelen > 8192 / 1.0:
            want = f / 8.0
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            want = (1 - smooth) * f / 8.0 + smooth * f
        assert g == pytest.approx(want, rel=1e-5)
    assert (got[:4] == plain[:4]).all() and got[-1] == pytest.approx(plain[-1] / 8)


# Sinusoidal positions ---------------------------------------------------------------------------

def test_sinusoidal_matches_paper_formula():
    pe = np.asarray(ops.sinusoidal_positions(jnp.arange(50)[None], 32))[0]
    for pos in (0, 1, 17, 49):
        for i in range(16):
            assert pe[pos, 2 * i] == pytest.approx(math.sin(pos / 10000 ** (2 * i / 32)), abs=1e-5)
            assert pe[pos, 2 * i + 1] == pytest.approx(math.cos(pos / 10000 ** (2 * i / 32)),
                                                       abs=1e-5)


@SETTINGS
@given(pos=st.integers(0, 3000), k=st.integers(0, 3000))
def test_sinusoidal_shift_is_a_fixed_rotation(pos, k):
    d = 32
    pe = np.asarray(ops.sinusoidal_positions(jnp.array([[pos, pos + k, k]]), d), np.float64)[0]
    at, shifted, by_k = pe[0], pe[1], pe[2]
    for i in range(d // 2):
        # [sin(a+b), cos(a+b)] = [[cos b, sin b], [-sin b, cos b]] @ [sin a, cos a], with the
        # rotation built from PE(k) alone: the same for every pos.
        sin_b, cos_b = by_k[2 * i], by_k[2 * i + 1]
        rot = np.array([[cos_b, sin_b], [-sin_b, cos_b]])
        np.testing.assert_allclose(rot @ at[2 * i: 2 * i + 2], shifted[2 * i: 2 * i + 2],
                                   atol=2e-3)


# Attention --------------------------------------------------------------------------------------

def _qkv(b=2, t=5, s=7, n=4, kv=2, h=8, seed=0):
    r = _rng(seed)
    return (r.normal(size=(b, t, n, h)).astype(np.float32),
            r.normal(size=(b, s, kv, h)).astype(np.float32),
            r.normal(size=(b, s, kv, h)).astype(np.float32))


def _attend(q, k, v, mask, scale=None):
    """``ops.reference_attention`` on k/v given [B, S, K, H] (it takes the cache's [B, K, S, H])."""
    k, v = (jnp.asarray(x).swapaxes(1, 2) for x in (k, v))
    return ops.reference_attention(jnp.asarray(q), k, v,
                                   None if mask is None else jnp.asarray(mask), scale)


@pytest.mark.parametrize("kv", [4, 2, 1])
def test_attention_matches_numpy_reference(kv):
    q, k, v = _qkv(kv=kv)
    mask = _rng(3).random((2, 5, 7)) < 0.7
    mask[0, 2] = False  # a fully-masked row
    got = _attend(q, k, v, mask)
    np.testing.assert_allclose(got, numpy_attention(q, k, v, mask, kv_layout="BSKH"),
                               rtol=1e-5, atol=1e-5)


def test_fully_masked_rows_are_zero_not_nan():
    q, k, v = _qkv()
    mask = np.zeros((2, 5, 7), bool)
    out = _attend(q, k, v, mask)
    assert np.isfinite(out).all() and (np.asarray(out) == 0).all()


def test_gqa_with_g_equal_h_is_mha_and_equals_repeated_heads():
    q, k, v = _qkv(n=6, kv=3)
    pos = jnp.broadcast_to(jnp.arange(7), (2, 7))
    mask = ops.attention_mask(pos[:, :5], pos)
    gqa = _attend(q, k, v, mask)
    # Repeat K/V by the group map group(r) = floor(r / (N/K)) and run plain MHA (K = N).
    group = np.arange(6) // 2
    mha = _attend(q, k[:, :, group], v[:, :, group], mask)
    np.testing.assert_allclose(gqa, mha, rtol=1e-6, atol=1e-6)
    # Per-head MHA: each query head alone against its own K/V head.
    for r in range(6):
        one = _attend(q[:, :, r:r + 1], k[:, :, group[r]:group[r] + 1],
                      v[:, :, group[r]:group[r] + 1], mask)
        np.testing.assert_allclose(gqa[:, :, r], one[:, :, 0], rtol=1e-6, atol=1e-6)


def test_mqa_is_gqa_with_one_kv_head():
    q, k, v = _qkv(n=4, kv=1)
    mask = jnp.ones((2, 5, 7), bool)
    mqa = _attend(q, k, v, mask)
    rep = _attend(q, np.repeat(k, 4, 2), np.repeat(v, 4, 2), mask)
    np.testing.assert_allclose(mqa, rep, rtol=1e-6, atol=1e-6)


def test_attention_mask_causal_segments_window():
    pos = jnp.array([[0, 1, 2, 3, 4, 5]])
    seg = jnp.array([[1, 1, 2, 2, 2, 0]])
    m = np.asarray(ops.attention_mask(pos, pos, q_segments=seg, k_segments=seg))[0]
    want = np.zeros((6, 6), bool)
    for i in range(6):
        for j in range(6):
            want[i, j] = j <= i and seg[0, i] == seg[0, j] and seg[0, i] != 0
    np.testing.assert_array_equal(m, want)
    w = np.asarray(ops.attention_mask(pos, pos, window=2))[0]
    np.testing.assert_array_equal(w, np.tril(np.ones((6, 6), bool)) & ~np.tril(np.ones((6, 6),
                                                                                     bool), -2))


def test_attention_scale_is_inverse_sqrt_head_dim():
    # Scaling q by c must match an explicit scale of c / sqrt(H).
    q, k, v = _qkv(h=16)
    mask = jnp.ones((2, 5, 7), bool)
    a = _attend(q * 3.0, k, v, mask)
    b = _attend(q, k, v, mask, scale=3.0 / 4.0)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_attention_rejects_bad_shapes():
    q, k, v = _qkv(n=5, kv=2)
    with pytest.raises(ValueError, match="multiple"):
        _attend(q, k, v, None)
    q, k, v = _qkv()
    with pytest.raises(AssertionError):
        _attend(q, k, v, jnp.ones((2, 5, 6), bool))


# Embedding and FFN ------------------------------------------------------------------------------

def test_embedding_and_tied_head():
    table = _rng().normal(size=(11, 6)).astype(np.float32)
    tokens = np.array([[0, 3, 10], [7, 7, 1]])
    emb = ops.embed(jnp.asarray(tokens), jnp.asarray(table))
    np.testing.assert_array_equal(emb, table[tokens])
    x = _rng(1).normal(size=(2, 3, 6)).astype(np.float32)
    logits = ops.tied_logits(jnp.asarray(x), jnp.asarray(table))
    chex.assert_type(logits, jnp.float32)
    np.testing.assert_allclose(logits, x @ table.T, rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError):
        ops.embed(jnp.asarray(tokens, jnp.float32), jnp.asarray(table))


def _gelu(x):
    return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


def test_ffn_variants_match_formulas():
    r = _rng()
    x = r.normal(size=(2, 3, 8))
    wg, wu = r.normal(size=(2, 8, 16)) * 0.3
    wd = r.normal(size=(16, 8)) * 0.3
    silu = lambda z: z / (1 + np.exp(-z))  # noqa: E731
    j = [jnp.asarray(a, jnp.float32) for a in (x, wg, wu, wd)]
    np.testing.assert_allclose(ops.swiglu(*j), (silu(x @ wg) * (x @ wu)) @ wd, rtol=1e-4,
                               atol=1e-4)
    np.testing.assert_allclose(ops.geglu(*j), (_gelu(x @ wg) * (x @ wu)) @ wd, rtol=1e-4,
                               atol=1e-4)
    np.testing.assert_allclose(ops.gelu_ffn(j[0], j[2], j[3]), _gelu(x @ wu) @ wd, rtol=1e-4,
                               atol=1e-4)
    np.testing.assert_allclose(ops.relu_ffn(j[0], j[2], j[3]), np.maximum(x @ wu, 0) @ wd,
                               rtol=1e-4, atol=1e-4)


def test_ops_are_jittable():
    q, k, v = _qkv()
    pos = jnp.broadcast_to(jnp.arange(5), (2, 5))

    @jax.jit
    def f(q, k, v):
        q = ops.apply_rope(q, pos)
        mask = ops.attention_mask(pos, jnp.broadcast_to(jnp.arange(7), (2, 7)))
        return _attend(q, k, v, mask)

    chex.assert_shape(f(q, k, v), (2, 5, 4, 8))
