"""``ops.attention``: every implementation that runs here against the einsum reference, outputs and
gradients, and the reference itself against a numpy loop."""

import functools
import logging
import math
import re
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FAST_COMPILE, numpy_attention

from transformer_jax.model.ops import attention as attn
from transformer_jax.model.ops import target


def _rng(seed=0):
    return np.random.default_rng(seed)


def _qkv(b=2, t=5, s=7, n=4, kv=2, h=8, seed=0, dtype=jnp.float32):
    r = _rng(seed)
    return (jnp.asarray(r.normal(size=(b, t, n, h)), dtype),
            jnp.asarray(r.normal(size=(b, kv, s, h)), dtype),
            jnp.asarray(r.normal(size=(b, kv, s, h)), dtype))


def test_reference_matches_numpy_loop():
    q, k, v = _qkv(kv=2)
    qp = jnp.broadcast_to(jnp.arange(5) + 2, (2, 5))
    seg_q = jnp.array([[1, 1, 1, 2, 0], [1, 1, 1, 1, 1]])
    seg_k = jnp.array([[1, 1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 1, 1, 1]])

    @functools.partial(jax.jit, compiler_options=FAST_COMPILE)  # one program, not op by op
    def mask_and_attention(q, k, v):
        return (attn.attention_mask(qp, jnp.broadcast_to(jnp.arange(7), (2, 7)),
                                    q_segments=seg_q, k_segments=seg_k, window=3),
                attn.attention(q, k, v, q_positions=qp, q_segments=seg_q, k_segments=seg_k,
                               window=3, impl="xla"))

    mask, got = mask_and_attention(q, k, v)
    mask = np.asarray(mask)
    assert not mask[0, 4].any()  # a padding query: no visible key
    np.testing.assert_allclose(got, numpy_attention(*map(np.asarray, (q, k, v)), mask),
                               rtol=1e-5, atol=1e-5)


def test_mask_rule_by_hand():
    pos = jnp.array([[0, 1, 2, 3, 4, 5]])
    seg = jnp.array([[1, 1, 2, 2, 2, 0]])
    m = np.asarray(attn.attention_mask(pos, pos, q_segments=seg, k_segments=seg))[0]
    want = np.array([[j <= i and seg[0, i] == seg[0, j] != 0 for j in range(6)]
                     for i in range(6)])
    np.testing.assert_array_equal(m, want)
    w = np.asarray(attn.attention_mask(pos, pos, window=2))[0]
    np.testing.assert_array_equal(w, np.tri(6, dtype=bool) & ~np.tri(6, k=-2, dtype=bool))
    full = np.asarray(attn.attention_mask(pos, pos, causal=False, window=2))[0]
    np.testing.assert_array_equal(full, ~np.tri(6, k=-2, dtype=bool))


def test_attention_weights_sum_to_one_over_visible_keys_and_zero_elsewhere():
    q, k, _ = _qkv()
    mask = _rng(3).random((2, 5, 7)) < 0.5
    mask[1, 0] = False
    w = np.asarray(attn.attention_weights(q, k, jnp.asarray(mask)))  # [B, N, T, S]
    assert np.isfinite(w).all()
    assert (w[np.broadcast_to(~mask[:, None], w.shape)] == 0).all()
    sums = w.sum(-1)
    has_key = np.broadcast_to(mask.any(-1)[:, None], sums.shape)
    np.testing.assert_allclose(sums[has_key], 1.0, rtol=1e-5)
    assert (sums[~has_key] == 0).all()


# Every implementation against the reference ------------------------------------------------------

def _segments(b, t, seed):
    """Packed rows: runs of segments 1, 2, 3 ending in padding (segment 0)."""
    r = _rng(seed)
    rows = []
    for _ in range(b):
        cuts = np.sort(r.choice(np.arange(1, t), 3, replace=False))
        rows.append(np.searchsorted(cuts, np.arange(t), side="right") % 4)
    return jnp.asarray(np.stack(rows))


# name: (T, S, N, K, H, first query position, structure kwargs)
CASES = {
    "causal": (40, 40, 4, 2, 64, 0, {}),
    "window_short": (40, 40, 4, 2, 64, 0, {"window": 7}),
    "window_longer_than_sequence": (40, 40, 4, 2, 64, 0, {"window": 100}),
    "packed_segments_with_padding": (40, 40, 4, 2, 64, 0, {"segments": True}),
    "mha_head_dim_128": (24, 24, 4, 4, 128, 0, {}),
    "mqa": (24, 24, 4, 1, 64, 0, {"window": 5}),
    "queries_into_partly_filled_cache": (9, 48, 4, 2, 64, 20, {}),
    "queries_before_every_key": (3, 16, 4, 2, 64, -3, {}),
    "decode_one_query": (1, 48, 4, 2, 64, 30, {"window": 16}),
    "not_causal": (24, 33, 4, 2, 64, 0, {"causal": False}),
}


def _structure(case, b=2):
    t, s, _, _, _, p, kw = CASES[case]
    kw = dict(kw)
    structure = {"q_positions": jnp.broadcast_to(jnp.arange(p, p + t), (b, t))}
    if kw.pop("segments", False):
        structure["q_segments"] = structure["k_segments"] = _segments(b, t, seed=1)
    return structure | kw


def _impls():
    """(name, function of q, k, v and structure) for every implementation that runs on CPU.

    "auto" is not among them: here it runs "xla" or "chunked" (``test_auto_*`` check which).
    """
    def via(impl):
        return lambda q, k, v, **kw: attn.attention(q, k, v, impl=impl, **kw)

    def small_blocks(q, k, v, **kw):  # several blocks, padded ones, and skipped ones
        return attn.chunked_attention(q, k, v, block_q=8, block_k=16, **kw)

    return [("xla", via("xla")), ("chunked", via("chunked")),
            ("chunked_small_blocks", small_blocks)]


def _value_and_grads(fn, q, k, v, structure):
    def loss(q, k, v):
        out = fn(q, k, v, **structure)
        return jnp.sum(jnp.sin(out.astype(jnp.float32))), out

    grad_fn = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
    (_, out), grads = jax.jit(grad_fn, compiler_options=FAST_COMPILE)(q, k, v)
    return out, grads


@pytest.mark.parametrize("case", list(CASES))
def test_every_impl_matches_reference_outputs_and_gradients(case):
    t, s, n, kv, h, _, _ = CASES[case]
    q, k, v = _qkv(t=t, s=s, n=n, kv=kv, h=h, seed=len(case))
    structure = _structure(case)
    impls = _impls()
    want_out, want_grads = _value_and_grads(impls[0][1], q, k, v, structure)
    assert np.isfinite(np.asarray(want_out)).all()
    for name, fn in impls[1:]:
        out, grads = _value_and_grads(fn, q, k, v, structure)
        np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5, err_msg=name)
        for arg, got, want in zip("qkv", grads, want_grads, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5,
                                       err_msg=f"{name}: d{arg}")


def test_bfloat16_matches_reference_loosely():
    # bfloat16 inputs: both paths round the probabilities to bfloat16 before the value matmul,
    # at different points (per block vs whole row), so they agree to bfloat16's ~3 digits.
    q, k, v = _qkv(t=40, s=40, n=4, kv=2, h=64, seed=7, dtype=jnp.bfloat16)
    structure = _structure("packed_segments_with_padding")
    impls = dict(_impls())
    want_out, want_grads = _value_and_grads(impls["xla"], q, k, v, structure)
    for name in ("chunked", "chunked_small_blocks"):
        out, grads = _value_and_grads(impls[name], q, k, v, structure)
        assert out.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want_out, np.float32),
                                   rtol=2e-2, atol=2e-2, err_msg=name)
        for got, want in zip(grads, want_grads, strict=True):
            assert got.dtype == jnp.bfloat16
            np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                       rtol=5e-2, atol=5e-2, err_msg=name)


def test_fully_masked_rows_are_exactly_zero_with_zero_gradients():
    q, k, v = _qkv(t=16, s=16, n=4, kv=2, h=64)
    seg = jnp.array([[1] * 8 + [0] * 8, [0] * 16])  # half a row, and a whole row, of padding
    structure = {"q_positions": jnp.broadcast_to(jnp.arange(16), (2, 16)),
                 "q_segments": seg, "k_segments": seg}
    for name, fn in _impls():
        out, (dq, _, _) = _value_and_grads(fn, q, k, v, structure)
        out, dq = np.asarray(out), np.asarray(dq)
        assert np.isfinite(out).all(), name
        assert (out[0, 8:] == 0).all() and (out[1] == 0).all(), name
        assert (dq[0, 8:] == 0).all() and (dq[1] == 0).all(), name


def test_default_key_positions_are_the_cache_slots():
    q, k, v = _qkv(t=3, s=10, n=4, kv=2, h=64)
    qp = jnp.broadcast_to(jnp.arange(4, 7), (2, 3))
    explicit = jax.jit(lambda q, k, v: attn.attention(  # one program, not op by op
        q, k, v, q_positions=qp, impl="xla", k_positions=jnp.broadcast_to(jnp.arange(10), (2, 10))),
        compiler_options=FAST_COMPILE)(q, k, v)
    for impl in ("xla", "chunked"):
        f = jax.jit(lambda q, k, v, impl=impl: attn.attention(q, k, v, q_positions=qp, impl=impl),
                    compiler_options=FAST_COMPILE)
        np.testing.assert_allclose(f(q, k, v), explicit, rtol=1e-6, atol=1e-6, err_msg=impl)


# Dispatch ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("impl", ["cudnn", "pallas", "mosaic"])
def test_accelerator_impls_refuse_to_run_on_cpu(impl):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=f"'{jax.default_backend()}'"):
        attn.attention(q, k, v, q_positions=jnp.zeros((2, 5), jnp.int32), impl=impl)


def test_unknown_impl_and_bad_shapes_are_rejected():
    q, k, v = _qkv()
    qp = jnp.zeros((2, 5), jnp.int32)
    with pytest.raises(ValueError, match="impl must be one of"):
        attn.attention(q, k, v, q_positions=qp, impl="flash")
    q, k, v = _qkv(n=5, kv=2)
    with pytest.raises(ValueError, match="multiple"):
        attn.attention(q, k, v, q_positions=qp)
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="together"):
        attn.attention(q, k, v, q_positions=qp, q_segments=qp)


def test_auto_logs_its_pick_once(caplog, monkeypatch):
    monkeypatch.setattr(attn, "_logged_choices", set())
    caplog.set_level(logging.INFO, logger=attn.__name__)
    q, k, v = _qkv()
    qp = jnp.broadcast_to(jnp.arange(5), (2, 5))
    for _ in range(2):
        out = attn.attention(q, k, v, q_positions=qp)
    np.testing.assert_array_equal(out, attn.attention(q, k, v, q_positions=qp, impl="xla"))
    picks = [r.getMessage() for r in caplog.records if "picked" in r.getMessage()]
    assert len(picks) == 1 and "'xla'" in picks[0] and "'cpu'" in picks[0]


def test_auto_choices_by_backend_and_size():
    small = jax.ShapeDtypeStruct((1, 128, 8, 64), jnp.bfloat16)
    small_k = jax.ShapeDtypeStruct((1, 2, 128, 64), jnp.bfloat16)
    long = jax.ShapeDtypeStruct((1, 4096, 8, 64), jnp.float32)
    long_k = jax.ShapeDtypeStruct((1, 2, 4096, 64), jnp.float32)
    assert attn.choose_impl(small, small_k, "cpu") == "xla"
    assert attn.choose_impl(long, long_k, "cpu") == "chunked"
    assert attn.choose_impl(small, small_k, "gpu") == "cudnn"
    assert attn.choose_impl(long, long_k, "gpu") == "chunked"  # float32: not cuDNN's


def test_auto_on_tpu_falls_back_to_jax_pallas_kernel_without_tokamax(monkeypatch, caplog):
    q = jax.ShapeDtypeStruct((1, 256, 8, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 2, 256, 64), jnp.bfloat16)
    longer_k = jax.ShapeDtypeStruct((1, 2, 512, 64), jnp.bfloat16)
    monkeypatch.setitem(sys.modules, "tokamax", types.SimpleNamespace())  # installed
    assert attn.choose_impl(q, k, "tpu") == "mosaic"
    assert attn.choose_impl(q, k, "tpu", window=64, aligned=False, softcap=5.0) == "mosaic"
    monkeypatch.setitem(sys.modules, "tokamax", None)  # as if not installed
    assert attn.choose_impl(q, k, "tpu") == "pallas"
    # What JAX's kernel (causal by index, no window, no cap) cannot do goes to the XLA paths.
    for kwargs in (dict(window=64), dict(aligned=False), dict(softcap=5.0)):
        assert attn.choose_impl(q, k, "tpu", **kwargs) == "xla", kwargs
    assert attn.choose_impl(q, longer_k, "tpu") == "xla"
    # attention() says which it picked and why; aligned = the keys' positions are the queries'.
    monkeypatch.setattr(attn, "_logged_choices", set())
    monkeypatch.setattr(attn, "_pallas_tpu_attention", lambda q, *a, **kw: q)
    caplog.set_level(logging.INFO, logger=attn.__name__)
    x = jnp.zeros((1, 128, 2, 8))
    pos = jnp.arange(128)[None]
    with target.targeting("tpu"):
        assert attn.attention(x, x.swapaxes(1, 2), x.swapaxes(1, 2), q_positions=pos,
                              k_positions=pos) is x
        attn.attention(x, x.swapaxes(1, 2), x.swapaxes(1, 2), q_positions=pos)  # reference
    picks = [r.getMessage() for r in caplog.records if "picked" in r.getMessage()]
    assert len(picks) == 2 and "'pallas'" in picks[0] and "tokamax" in picks[0], picks
    assert "'xla'" in picks[1], picks


# Memory and lowering -----------------------------------------------------------------------------

def test_chunked_gradient_does_not_store_the_score_matrix():
    # Compile only. At T = S = 2048 with N = 4 the reference's backward keeps [B, N, T, S] float32
    # arrays (64 MiB each); the chunked one holds one [B, N, 256, 512] block at a time.
    t, n, kv, h = 2048, 4, 2, 64
    q = jax.ShapeDtypeStruct((1, t, n, h), jnp.float32)
    k = jax.ShapeDtypeStruct((1, kv, t, h), jnp.float32)
    qp = jnp.arange(t)[None]

    def temp_bytes(impl):
        grad = jax.grad(lambda q, k, v: attn.attention(q, k, v, q_positions=qp, impl=impl).sum(),
                        argnums=(0, 1, 2))
        return jax.jit(grad).lower(q, k, k).compile().memory_analysis().temp_size_in_bytes

    xla, chunked = temp_bytes("xla"), temp_bytes("chunked")
    scores = 4 * n * t * t
    assert xla >= scores  # the reference does hold the [N, T, S] float32 scores
    assert chunked < scores / 4 and chunked * 8 < xla, (xla, chunked)


def test_chunked_attention_in_scanned_remat_layers_keeps_nothing_of_size_t_by_s():
    # The model's layout: layers under jax.checkpoint inside lax.scan (nn.scan over nn.remat),
    # positions shared by every layer. The gradient of that program must not hold any array with
    # T * S elements: scan's partial evaluation once hoisted each block's mask and -inf fill out
    # of the forward loops, stacked per block ([T/bq, S/bk, B, K, G, bq, bk], i.e. [B, N, T, S]).
    t, n, kv, h, d = 1024, 4, 2, 32, 64
    pos = jnp.arange(t)[None]

    def layer(x, w):
        q = jnp.einsum("BTD,DNH->BTNH", x, w[:, :n])
        k = jnp.einsum("BSD,DKH->BKSH", x, w[:, n:n + kv])
        out = attn.attention(q, k, k, q_positions=pos, k_positions=pos, impl="chunked")
        return x + jnp.einsum("BTNH,DNH->BTD", out, w[:, :n])

    def loss(ws, x):
        x, _ = jax.lax.scan(lambda x, w: (jax.checkpoint(layer)(x, w), None), x, ws)
        return x.sum()

    ws = jax.ShapeDtypeStruct((2, d, n + kv, h), jnp.float32)
    x = jax.ShapeDtypeStruct((1, t, d), jnp.float32)
    jaxpr = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(ws, x))
    sizes = {shape: math.prod(int(i) for i in shape.split(","))
             for shape in re.findall(r"\[(\d+(?:,\d+)*)\]", jaxpr)}
    largest = max(sizes, key=sizes.get)
    assert sizes[largest] < t * t, f"a [{largest}] value in the gradient (T = S = {t})"


def test_pallas_tpu_kernel_lowers_for_tpu():
    # Export for TPU from this CPU-only host: forward and backward must be Mosaic custom calls.
    q = jax.ShapeDtypeStruct((1, 256, 4, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 2, 256, 128), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((1, 256), jnp.int32)

    def f(q, k, v, seg):
        return attn._pallas_tpu_attention(q, k, v, seg, seg, causal=True, scale=None)

    def g(q, k, v, seg):
        return jax.grad(lambda *a: f(*a, seg).astype(jnp.float32).sum(), argnums=(0, 1, 2))(
            q, k, v)

    for fn in (f, g):
        exported = jax.export.export(jax.jit(fn), platforms=("tpu",))(q, k, k, seg)
        assert "tpu_custom_call" in exported.mlir_module()
