"""The TPU Pallas flash-attention path, run here in Pallas's TPU interpret mode on the CPU.

``attention(..., impl="pallas")`` on a TPU calls ``ops.attention._pallas_tpu_attention``: the
same kernel interpreted here must give the reference's outputs and gradients (q, k, v) for
packed segments with padding (segment 0), causal, with GQA (the wrapper repeats K/V heads for
the kernel). That it lowers to a Mosaic custom call for TPU is
``test_attention.py::test_pallas_tpu_kernel_lowers_for_tpu``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.model.ops import attention as attn

pltpu = pytest.importorskip("jax.experimental.pallas.tpu")

T, H = 256, 128  # the kernel's default blocks are 128 positions; head dim 128 as on TPU


def _inputs(n: int, kv: int, packed: bool):
    ks = jax.random.split(jax.random.key(n * 10 + kv), 3)
    q = jax.random.normal(ks[0], (1, T, n, H), jnp.float32)
    k = jax.random.normal(ks[1], (1, kv, T, H), jnp.float32)
    v = jax.random.normal(ks[2], (1, kv, T, H), jnp.float32)
    if packed:  # two documents, then padding
        lengths = (100, 120, T - 220)
        seg = jnp.concatenate([jnp.full((n_,), s)
                               for s, n_ in zip((1, 2, 0), lengths, strict=True)])
        pos = jnp.concatenate([jnp.arange(n_) for n_ in lengths])
        return q, k, v, seg[None].astype(jnp.int32), pos[None]
    return q, k, v, None, jnp.arange(T)[None]


def _outputs_and_grads(fn, q, k, v):
    # A weighting of the output's features makes every gradient entry matter. One jitted
    # program: op by op, the interpreter dispatches each operation of every block apart.
    weights = jnp.linspace(-1.0, 1.0, H)

    @jax.jit
    def both(q, k, v):
        out = fn(q, k, v)
        grads = jax.grad(lambda *a: (fn(*a) * weights).sum(), argnums=(0, 1, 2))(q, k, v)
        return out, *grads

    return [np.asarray(x) for x in both(q, k, v)]


def test_pallas_tpu_kernel_interpreted_equals_reference():
    # One case (interpreting the kernel is slow): GQA, whose K/V the wrapper repeats for the
    # kernel, two packed documents and padding, causal within each.
    packed = True
    q, k, v, seg, pos = _inputs(4, 2, packed)

    def reference(q, k, v):
        return attn.attention(q, k, v, q_positions=pos, k_positions=pos, q_segments=seg,
                              k_segments=seg, impl="xla")

    def kernel(q, k, v):
        return attn._pallas_tpu_attention(q, k, v, seg, seg, causal=True, scale=None)

    want = _outputs_and_grads(reference, q, k, v)
    with pltpu.force_tpu_interpret_mode():
        got = _outputs_and_grads(kernel, q, k, v)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        # float32 throughout; relative to the largest entry (gradients reach ~1e2).
        np.testing.assert_allclose(g, w, atol=1e-5 * np.abs(w).max(), err_msg=name)
    if packed:  # padding rows are zeros, as in the reference
        assert not np.any(got[0][0, np.asarray(seg[0]) == 0])
