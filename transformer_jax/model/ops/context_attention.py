"""Context-parallel self-attention: under a mesh whose rules split ``length``, each device keeps
its queries and all-gathers the whole sequence's keys, values, positions and segments
(MaxText's default); masks are structure, so the sequence may be permuted first."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
from jax.sharding import PartitionSpec as P

from transformer_jax.model.ops.target import mesh_axes

#: (mesh, batch axes, kv-head axes, sequence axes) of a context-parallel call.
Split = tuple[jax.sharding.AbstractMesh, tuple[str, ...], tuple[str, ...], tuple[str, ...]]


def context_split(b: int, kv: int, t: int) -> Split | None:
    """How a self-attention call of B rows, K kv heads and T positions splits over the mesh in
    context (``target.mesh_axes``), or None when the logical rules do not split ``length``.

    Raises:
      ValueError: T does not split evenly over the sequence axes.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    batch_rule, heads_rule, length_rule = nn.logical_to_mesh_axes(("batch", "kv_heads", "length"))
    seq = mesh_axes(mesh, length_rule)
    if not seq:
        return None
    if t % math.prod(mesh.shape[a] for a in seq):
        raise ValueError(f"context parallelism: the sequence length {t} does not split over "
                         f"{' x '.join(f'{a}={mesh.shape[a]}' for a in seq)}")
    return mesh, mesh_axes(mesh, batch_rule, b), mesh_axes(mesh, heads_rule, kv), seq


def gathered_attention(split: Split, fn: Callable[..., jax.Array], q: jax.Array, k: jax.Array,
                       v: jax.Array, *, q_positions: jax.Array, k_positions: jax.Array,
                       q_segments: jax.Array | None, k_segments: jax.Array | None,
                       sinks: jax.Array | None, **static: Any) -> jax.Array:
    """``fn(q, k, v, ...)`` per device with its own queries and the whole sequence's keys.

    Args:
      split, fn: ``context_split``'s answer, the attention each device runs.
      q, k, v: [B, T, N, H] queries (T split over the sequence axes), [B, K, T, H] keys, values.
      q_positions, k_positions, q_segments, k_segments: [B, T] each (segments optional).
      sinks: optional [N] sink logits.
      **static: ``fn``'s other arguments (an array window is replicated).

    Returns:
      [B, T, N, H], split like q.
    """
    mesh, batch, heads, seq = split
    rows, by_head, by_seq = batch or None, heads or None, seq
    arrays = {"q_positions": q_positions, "k_positions": k_positions}
    if q_segments is not None:
        arrays.update(q_segments=q_segments, k_segments=k_segments)
    specs = {name: P(rows, by_seq) for name in arrays}
    extra = {name: x for name, x in static.items() if isinstance(x, jax.Array)}
    static = {name: x for name, x in static.items() if name not in extra}
    extra_specs = {name: P() for name in extra}
    sink_spec = None if sinks is None else P(by_head)

    def body(q, k, v, arrays, extra, sinks):
        gather = dict(axis_name=seq, tiled=True)
        k = jax.lax.all_gather(k, axis=2, **gather)
        v = jax.lax.all_gather(v, axis=2, **gather)
        arrays = {name: jax.lax.all_gather(x, axis=1, **gather) if name.startswith("k_") else x
                  for name, x in arrays.items()}
        return fn(q, k, v, **arrays, **extra, **static, sinks=sinks)

    return jax.shard_map(
        body, mesh=mesh, check_vma=False,
        in_specs=(P(rows, by_seq, by_head), P(rows, by_head, by_seq), P(rows, by_head, by_seq),
                  specs, extra_specs, sink_spec),
        out_specs=P(rows, by_seq, by_head))(q, k, v, arrays, extra, sinks)


__all__ = ["context_split", "gathered_attention"]
