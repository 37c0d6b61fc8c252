"""Many LoRA adapters over one matrix in one batch, each row picking its own (the BGMV form):
``y[b] = x[b] @ W + (x[b] @ A[ids[b] - 1]) @ B[ids[b] - 1]``, id 0 the base. Factors are
stored as the matrix is: in-first A [Na, in..., R], B [Na, R, out...]; out-first A [Na, R,
in...], B [out..., Na, R] (B scaled by ``alpha / rank``, ranks zero-padded to R)."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from transformer_jax.model.ops.layouts import OutFirst, Wrapped, split_spec


@flax.struct.dataclass
class RowAdapters(Wrapped):
    """A matrix as stored, beside Na adapters of it and each row's choice of one.

    Attributes:
      w: the base matrix as the model stores it (in-first or out-first, float or quantised).
      a, b: the adapters' factors in the module docstring's layout (B scaled by ``alpha / rank``).
      ids: [B] int32 the adapter of each batch row: 1 + its index in the stack, 0 = the base.
    """

    w: Any
    a: jax.Array
    b: jax.Array
    ids: jax.Array


def row_delta(x: jax.Array, adapters: RowAdapters, spec: str) -> jax.Array:
    """Each row's adapter update of the product ``spec`` describes, in float32.

    Args:
      x: the activations in ``spec``'s layout, batch first (e.g. [B, T, D]).
      adapters: the matrix with its adapters (``RowAdapters``).
      spec: the in-first einsum of the product (``ops.dense``'s), e.g. ``"BTD,DNH->BTNH"``.

    Returns:
      float32, in ``spec``'s output layout (e.g. [B, T, N, H]); for an out-first matrix in
      ``ops.dense``'s layout before its transpose (e.g. [N, H, B, T]).
    """
    a, b, ids = adapters.a, adapters.b, adapters.ids
    out_first = isinstance(adapters.w, OutFirst)
    x_axes, w_in, w_out, rows, out = split_spec(spec)
    batch = x_axes[0]
    if "r" in spec or "n" in spec or batch in w_in + w_out or rows[0] != batch:
        raise ValueError(f"row_delta needs an upper-case spec whose first x axis is the batch, "
                         f"got {spec!r}")
    f32 = jnp.float32
    n = a.shape[0]
    y = f"{w_out}{rows}" if out_first else out
    a_spec = f"nr{w_in}" if out_first else f"n{w_in}r"
    b_spec = f"{w_out}nr" if out_first else f"nr{w_out}"
    n_axis = len(w_out) if out_first else 0
    b = b.astype(f32)
    if ids.shape[0] == 1:  # one row (a prefill chunk): its adapter's factors, sliced
        index = jnp.maximum(ids - 1, 0)
        a_row = jnp.take(a, index, axis=0) * (ids[0] > 0).astype(a.dtype)  # the base adds 0
        xa = jnp.einsum(f"{x_axes},{a_spec}->{rows}nr", x, a_row, preferred_element_type=f32)
        return jnp.einsum(f"{rows}nr,{b_spec}->{y}", xa, jnp.take(b, index, axis=n_axis),
                          preferred_element_type=f32)
    # Several rows: every adapter's A product, each row's own kept by a one-hot mask (zeros
    # for the base), then one product with all the B factors.
    mask = jax.nn.one_hot(ids - 1, n, dtype=f32)  # [B, Na]
    if out_first:
        xa = jnp.einsum(f"{a_spec},{x_axes}->nr{rows}", a, x, preferred_element_type=f32)
        mask = mask.T.reshape(n, 1, ids.shape[0], *(1,) * (len(rows) - 1))
        return jnp.einsum(f"{b_spec},nr{rows}->{y}", b, xa * mask, preferred_element_type=f32)
    xa = jnp.einsum(f"{x_axes},{a_spec}->{rows}nr", x, a, preferred_element_type=f32)
    mask = mask.reshape(ids.shape[0], *(1,) * (len(rows) - 1), n, 1)
    return jnp.einsum(f"{rows}nr,{b_spec}->{y}", xa * mask, b, preferred_element_type=f32)
