"""Context-parallel self-attention: the sequence split over mesh axes, keys and values gathered.

Under a mesh whose logical rules split the sequence (``length``: the ``context`` axis of
``parallel.sharding.CONTEXT_RULES``), each device holds T / C of every sequence's queries, keys
and values. ``attention`` then runs per device under ``shard_map``: the device all-gathers the
keys, values, key positions and key segments of the whole sequence over the context axes
(``lax.all_gather``; its transpose, a reduce-scatter, returns their gradients), keeps its own
queries, and attends with the local implementation (``"xla"``, ``"chunked"`` or a kernel) over
the explicit positions and segments. MaxText's default context-parallel strategy.

Because the masks are structure (positions and segment ids, never indices), the sequence may be
permuted before it is split, positions and segments alike: ``parallel.context`` permutes it so
that every device holds two chunks, i and 2C - 1 - i, and has the same causal work. The chunked
path's block skipping is decided by each block's min and max positions, which stays exact for
permuted positions (a block that spans two chunks only skips less).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

#: (mesh, batch axes, kv-head axes, sequence axes) of a context-parallel call.
Split = tuple[jax.sharding.AbstractMesh, tuple[str, ...], tuple[str, ...], tuple[str, ...]]


def context_split(b: int, kv: int, t: int) -> Split | None:
    """How a self-attention call of B rows, K kv heads and T positions splits over the mesh in
    context, or None when the logical rules do not split ``length`` over any mesh axis of more
    than one device (or it is already manual: inside a ``shard_map``).

    Batch and kv-head splits that do not divide B or K are left out (XLA gathers them).

    Raises:
      ValueError: T does not split evenly over the sequence axes.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))

    def axes(value: Any) -> tuple[str, ...]:
        names = () if value is None else (value,) if isinstance(value, str) else tuple(value)
        return tuple(a for a in names if a in types and mesh.shape[a] > 1)

    batch_rule, heads_rule, length_rule = nn.logical_to_mesh_axes(("batch", "kv_heads", "length"))
    seq = axes(length_rule)
    if not seq or any(types[a] == AxisType.Manual for a in seq):
        return None
    parts = math.prod(mesh.shape[a] for a in seq)
    if t % parts:
        raise ValueError(f"context parallelism: the sequence length {t} does not split over "
                         f"{' x '.join(f'{a}={mesh.shape[a]}' for a in seq)}")

    def dividing(names: tuple[str, ...], size: int) -> tuple[str, ...]:
        if any(types[a] == AxisType.Manual for a in names):
            return ()
        return names if size % math.prod(mesh.shape[a] for a in names) == 0 else ()

    return mesh, dividing(axes(batch_rule), b), dividing(axes(heads_rule), kv), seq


def gathered_attention(split: Split, fn: Callable[..., jax.Array], q: jax.Array, k: jax.Array,
                       v: jax.Array, *, q_positions: jax.Array, k_positions: jax.Array,
                       q_segments: jax.Array | None, k_segments: jax.Array | None,
                       sinks: jax.Array | None, **static: Any) -> jax.Array:
    """``fn(q, k, v, ...)`` per device with its own queries and the whole sequence's keys.

    Args:
      split: ``context_split``'s answer.
      fn: the attention to run on each device (``ops.attention.attention``; called inside the
        ``shard_map``, where every mesh axis is manual, it runs its local implementation).
      q: [B, T, N, H] queries, T split over the sequence axes.
      k, v: [B, K, T, H] keys and values of the same positions.
      q_positions, k_positions: [B, T] positions of the queries and keys.
      q_segments, k_segments: optional [B, T] segment ids (given together).
      sinks: optional [N] sink logits.
      **static: the rest of ``fn``'s arguments (window, causal, scale, impl, softcap); a window
        given as an array is replicated.

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
