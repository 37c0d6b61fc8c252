"""Projections by a weight matrix stored in either orientation: every matmul of the model is an
einsum for in-first weights (``"BTD,DNH->BTNH"`` for q_proj [D, N, H]); ``dense`` computes it
for an ``OutFirst`` leaf too (a CPU target's prepared weights: docs/generation.md), an
optimization barrier keeping XLA from folding the transpose back into the dot."""

from typing import Any

import jax
import jax.numpy as jnp

from transformer_jax.model.ops.layouts import OutFirst, split_spec
from transformer_jax.model.ops.quantized import einsum
from transformer_jax.model.ops.row_lora import RowAdapters, row_delta


def dense(x: jax.Array, w: Any, spec: str, *,
          preferred_element_type: jnp.dtype | None = None) -> jax.Array:
    """``jnp.einsum(spec, x, w)`` for a weight stored as ``spec`` says or output axes first.

    Args:
      x: the activations, e.g. [B, T, D].
      w: the weight in ``spec``'s layout (e.g. [D, N, H]) or an ``OutFirst`` leaf ([N, H, D]);
        float or quantised, or either with per-row LoRA adapters (``ops.row_lora``).
      spec: the in-first einsum ``"<x>,<w>-><out>"`` (w's input axes: the letters x shares).
      preferred_element_type: the accumulation / output dtype.

    Returns:
      The product in ``spec``'s output layout.
    """
    adapters = w if isinstance(w, RowAdapters) else None
    if adapters is not None:
        w = adapters.w
    if not isinstance(w, OutFirst):
        y = einsum(spec, x, w, preferred_element_type=preferred_element_type)
        if adapters is not None:
            y = y + row_delta(x, adapters, spec).astype(y.dtype)
        return y
    x_axes, w_in, w_out, rows, out = split_spec(spec)
    y = einsum(f"{w_out}{w_in},{x_axes}->{w_out}{rows}", w.w, x,
               preferred_element_type=preferred_element_type)
    if adapters is not None:  # the update in the same [out..., rows...] layout
        y = y + row_delta(x, adapters, spec).astype(y.dtype)
    y = jax.lax.optimization_barrier(y)
    return jnp.einsum(f"{w_out}{rows}->{out}", y)
