"""Context parallelism: every training sequence split over the ``context`` mesh axis.

The batch's [B, T] arrays and every activation split along T (``sharding.CONTEXT_RULES``), and
attention gathers the keys and values (``model.ops.context_attention``). ``balance_batch``
permutes every sequence inside the jitted step (as MaxText: 2C chunks, device i holds chunks i
and 2C - 1 - i) so that every device has the same causal work.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType


def context_parts() -> int:
    """Into how many parts the mesh and rules in context split the sequence (1 without)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return 1
    rule = nn.logical_to_mesh_axes(("length",))[0]
    names = () if rule is None else (rule,) if isinstance(rule, str) else tuple(rule)
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    return math.prod(mesh.shape[a] for a in names
                     if a in types and types[a] != AxisType.Manual)


def balanced_order(t: int, parts: int) -> np.ndarray:
    """The load-balancing permutation of T positions over ``parts`` devices.

    Args:
      t: the sequence length, a multiple of ``2 * parts``.
      parts: the number of devices the sequence splits over.

    Returns:
      [T] int32: position j of the permuted sequence is ``order[j]`` of the natural one.

    Raises:
      ValueError: T is not a multiple of ``2 * parts``.
    """
    if t % (2 * parts):
        raise ValueError(f"context parallelism over {parts} devices needs a sequence length "
                         f"that is a multiple of {2 * parts} (2 x context), got {t}")
    size = t // (2 * parts)
    chunks = [c for i in range(parts) for c in (i, 2 * parts - 1 - i)]
    return np.concatenate([np.arange(c * size, (c + 1) * size) for c in chunks]).astype(np.int32)


def balance_batch(batch: dict[str, Any]) -> dict[str, Any]:
    """The batch's sequences in load-balanced order for the context split in force, if any.

    Args:
      batch: ``{"inputs": [B, T], ...}``; every [B, T] array is permuted alike, and natural
        ``positions`` are added first when missing.

    Returns:
      The permuted batch, its [B, T] arrays constrained to (batch, length).

    Raises:
      ValueError: T is not a multiple of ``2 * context``.
    """
    parts = context_parts()
    if parts == 1:
        return batch
    b, t = batch["inputs"].shape
    order = balanced_order(t, parts)
    batch = dict(batch)
    if batch.get("positions") is None:
        batch["positions"] = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))

    def one(x):
        if x is None or getattr(x, "ndim", 0) != 2 or x.shape != (b, t):
            return x
        return nn.with_logical_constraint(jnp.take(x, order, axis=1), ("batch", "length"))

    return {name: one(x) for name, x in batch.items()}


def per_part_loss(loss: Callable[..., tuple[jax.Array, ...]], hidden: jax.Array, head: Any,
                  targets: jax.Array, mask: jax.Array | None) -> tuple[jax.Array, ...]:
    """A chunked loss ``loss(hidden, head, targets, mask) -> sums`` run by each device on its
    own rows and part of the sequence ([B, C, T / C]), the sums added up.

    Args:
      loss: a tuple of float32 sums for [b, t, D] hidden, [b, t] targets and optional mask.
      hidden: [B, T, D] final hidden states.
      head: the output projection (closed over: the same for every part).
      targets: [B, T] target ids.
      mask: optional [B, T] weights.

    Returns:
      The tuple of sums over the whole batch.
    """
    parts = context_parts()
    if parts == 1:
        return loss(hidden, head, targets, mask)
    b, t = targets.shape

    def fold(x: jax.Array) -> jax.Array:
        x = x.reshape(b, parts, t // parts, *x.shape[2:])
        axes = ("batch", "length", None, "act_embed")[:x.ndim]
        return nn.with_logical_constraint(x, axes)

    def one(h, tg, m):
        return loss(h[None], head, tg[None], None if m is None else m[None])

    folded_mask = None if mask is None else fold(mask)
    in_axes = (0, 0, None if mask is None else 0)
    sums = jax.vmap(jax.vmap(one, in_axes=in_axes), in_axes=in_axes)(
        fold(hidden), fold(targets), folded_mask)
    return tuple(jnp.sum(x) for x in sums)


__all__ = ["balance_batch", "balanced_order", "context_parts", "per_part_loss"]
