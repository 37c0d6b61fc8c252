"""Grouped-matmul kernels for ``ops.moe``'s ``"megablox"`` (JAX's Pallas TPU grouped matmul,
TPU only; A and C multiples of 128, rows padded here) and ``"tokamax"`` (``tokamax.ragged_dot``,
the ``kernels`` extra; it checks the backend when called, so it cannot be lowered from a CPU
host), each with its own backward kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from transformer_jax.model.ops import target

#: The tile megablox multiplies in (rows, contracted, output columns).
MEGABLOX_TILE = 128


def kernel_grouped_matmul(impl: str, x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    """The grouped product by kernel ``impl`` (``"megablox"`` or ``"tokamax"``).

    Args:
      impl: which kernel.
      x, w, sizes: [M, A] rows grouped by expert, [E, A, C] matrices, [E] int32 rows each.

    Returns:
      [M, C] in x's dtype.

    Raises:
      ValueError: megablox off TPU or with A, C not multiples of 128; tokamax not installed.
    """
    backend = target.platform()
    if impl == "megablox":
        if backend != "tpu":
            raise ValueError(f"moe_impl='megablox' runs on TPU only, not {backend!r}; use "
                             "'auto' (or 'tiled' on CPU, 'ragged' anywhere)")
        return megablox_matmul(x, w, sizes)
    if impl == "tokamax":
        try:
            import tokamax
        except ImportError:
            raise ValueError("moe_impl='tokamax' needs tokamax (pip install "
                             "'transformer-jax[kernels]'); or use 'auto'") from None
        return tokamax.ragged_dot(x, w, sizes, preferred_element_type=x.dtype)
    raise ValueError(f"no grouped-matmul kernel named {impl!r}")


def megablox_matmul(x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    """megablox's ``gmm``, rows padded to whole tiles (no backend check: lowers from a CPU host)."""
    from jax.experimental.pallas.ops.tpu import megablox

    m, a = x.shape
    c = w.shape[-1]
    if a % MEGABLOX_TILE or c % MEGABLOX_TILE:
        raise ValueError(f"moe_impl='megablox' needs the model width and expert d_ff to be "
                         f"multiples of {MEGABLOX_TILE}, got a product [{m}, {a}] x [{a}, {c}]; "
                         "use 'ragged'")
    pad = -m % MEGABLOX_TILE
    rows = jnp.pad(x, ((0, pad), (0, 0))) if pad else x
    y = megablox.gmm(rows, w.astype(x.dtype), sizes, preferred_element_type=x.dtype,
                     tiling=(MEGABLOX_TILE,) * 3)
    return y[:m]
