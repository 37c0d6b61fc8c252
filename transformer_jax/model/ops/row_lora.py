"""Many LoRA adapters over one matrix in one batch: each row of the batch picks its own.

A serving step batches requests of different fine-tunes of one base. Merging an adapter into
the weights would need a copy of the model per adapter (and a program per mix of them); instead
the base product is computed once for every row and each row adds its own adapter's low-rank
update, chosen by the row's adapter id (the BGMV form, "batched gather matrix-vector"):

    y[b] = x[b] @ W + (x[b] @ A[ids[b]]) @ B[ids[b]]

with A [Na, in..., R] and B [Na, R, out...] for Na adapters (B already scaled by its adapter's
``alpha / rank``; a smaller rank zero-padded to R, which adds nothing). Adapter 0 is by
convention all zeros: the base model.

``RowAdapters`` carries the matrix with its adapters and the rows' ids, so ``ops.dense`` computes
the sum where the model computes the product: the model's code is the same with or without them
(as with quantised weights), and the per-row choice is data, so mixing adapters in a batch
compiles nothing new.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class RowAdapters:
    """A matrix as stored, beside Na adapters of it and each row's choice of one.

    Attributes:
      w: the base matrix as the model stores it (in-first or out-first, float or quantised).
      a: [Na, in..., R] the adapters' A factors (the matrix's input axes, in-first order).
      b: [Na, R, out...] their B factors, each scaled by its adapter's ``alpha / rank``.
      ids: [B] int32 the adapter of each batch row (0 = the base: zero factors).
    """

    w: Any
    a: jax.Array
    b: jax.Array
    ids: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """The base matrix's (stored) shape."""
        return tuple(self.w.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self) -> jnp.dtype:
        return self.w.dtype

    def astype(self, dtype: Any) -> RowAdapters:
        """The base matrix in ``dtype``; the factors keep theirs (the update is computed in
        float32 whatever the compute dtype)."""
        return self.replace(w=self.w.astype(dtype))


def is_row_adapters(w: Any) -> bool:
    """Whether ``w`` is a matrix with per-row adapters (``RowAdapters``)."""
    return isinstance(w, RowAdapters)


def row_delta(x: jax.Array, a: jax.Array, b: jax.Array, ids: jax.Array, spec: str) -> jax.Array:
    """Each row's adapter update of the product ``spec`` describes, in float32.

    Args:
      x: the activations in ``spec``'s layout, batch first (e.g. [B, T, D]).
      a: [Na, in..., R] A factors (the weight's input axes, as in ``spec``).
      b: [Na, R, out...] B factors (scaled).
      ids: [B] int32 adapter of each row.
      spec: the in-first einsum of the product, ``"<x>,<w>-><out>"`` (``ops.dense``'s), e.g.
        ``"BTD,DNH->BTNH"``; x's first letter is its batch axis.

    Returns:
      The update in ``spec``'s output layout (e.g. [B, T, N, H]), float32.
    """
    inputs, out = spec.split("->")
    x_axes, w_axes = inputs.split(",")
    w_in = "".join(c for c in w_axes if c in x_axes)
    w_out = "".join(c for c in w_axes if c not in x_axes)
    rows = "".join(c for c in x_axes if c not in w_in)
    batch = x_axes[0]
    if "r" in spec or batch in w_axes:
        raise ValueError(f"row_delta needs an upper-case spec whose first x axis is the batch, "
                         f"got {spec!r}")
    f32 = jnp.float32
    if ids.shape[0] == 1:  # one row (a prefill chunk): its adapter's factors, sliced
        xa = jnp.einsum(f"{x_axes},{batch}{w_in}r->{rows}r", x, jnp.take(a, ids, axis=0),
                        preferred_element_type=f32)
        return jnp.einsum(f"{rows}r,{batch}r{w_out}->{out}", xa,
                          jnp.take(b, ids, axis=0).astype(f32), preferred_element_type=f32)
    # Several rows: every adapter's A product at once (Na * R columns, a small matmul), each
    # row's own kept by a one-hot mask, then one product with all the B factors. Two dense
    # products, whatever the mix; gathering per-row factors instead ([B, in, R] and [B, R,
    # out]) ran a decode step of decode_25m (batch 8, 4 adapters of rank 16 on every dense
    # matrix, float32, 2-core CPU) at 3x the base's time, this form at 1.55x.
    n = a.shape[0]
    xa = jnp.einsum(f"{x_axes},n{w_in}r->{rows}nr", x, a, preferred_element_type=f32)
    mask = jax.nn.one_hot(ids, n, dtype=f32).reshape(ids.shape[0], *(1,) * (len(rows) - 1), n, 1)
    return jnp.einsum(f"{rows}nr,nr{w_out}->{out}", xa * mask, b.astype(f32),
                      preferred_element_type=f32)
