"""Sliding-window layers keep only their window: the KV caches' rings of R = W slots per row
(position p in slot ``p % R``; never written: ``INVALID``) for local layers (window W) and
chunked ones (chunk C = W). A decode step is written first and attends over the ring; a longer
chunk attends over the ring and its own keys, then its last R positions are written."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.model.config import Architecture
from transformer_jax.model.ops import kv_quant
from transformer_jax.model.ops.attention import attention
from transformer_jax.model.ops.layouts import SlotsLast, stored_keys
from transformer_jax.model.stack import RING_KINDS, LayerRef

#: The position of a ring slot never written: past every query, so causality hides it.
INVALID = int(np.iinfo(np.int32).max)


@dataclasses.dataclass(frozen=True)
class RingLayout:
    """Which layers of a cache are rings, and where each layer is stored (static, hashable).

    Attributes:
      window: W, the local layers' window (chunked layers' chunk), also the ring's R slots.
      local: per layer, whether it is a ring layer (local or chunked).
    """

    window: int
    local: tuple[bool, ...]

    @classmethod
    def of(cls, config: Architecture, max_len: Any) -> RingLayout | None:
        """The rings of a cache of ``max_len`` slots per row; None: no local layer, or W >= it."""
        kinds = config.layer_kinds()
        window = config.sliding_window if "local" in kinds else (
            config.attention_chunk if "chunked" in kinds else None)
        if window is None:
            return None
        try:
            if max_len <= window:
                return None
        except jax.errors.InconclusiveDimensionOperation:  # symbolic: rings hold any length
            pass
        return cls(window, tuple(k in RING_KINDS for k in kinds))

    @property
    def size(self) -> int:
        """R, the ring's slots per row."""
        return self.window

    @property
    def n_local(self) -> int:
        return sum(self.local)

    @property
    def n_global(self) -> int:
        return len(self.local) - self.n_local

    @property
    def index(self) -> tuple[int, ...]:
        """Per layer, its index among the layers of its own kind."""
        return tuple(self.local[:i].count(kind) for i, kind in enumerate(self.local))


def locate(layout: RingLayout | None, i: int | jax.Array | LayerRef
           ) -> tuple[bool, int | jax.Array]:
    """(whether layer i is a ring, its index among its kind); ``i`` a number or a ``LayerRef``."""
    if isinstance(i, LayerRef):
        return (False, i.index) if layout is None else (i.local, i.of_kind)
    if layout is None:
        return False, i
    if isinstance(i, int):
        return layout.local[i], layout.index[i]
    if not all(layout.local) and any(layout.local):
        raise ValueError("a cache of rings and full layers reads a layer by its number (a "
                         "Python int) or its LayerRef")
    return all(layout.local), i


def ring_positions(last: jax.Array, size: int) -> jax.Array:
    """[B] last position written per row -> [B, R] position of each slot (unwritten: INVALID)."""
    slots = jnp.arange(size, dtype=jnp.int32)
    last = last.astype(jnp.int32)[:, None]
    held = last - jnp.mod(last - slots, size)
    return jnp.where(held >= 0, held, INVALID)


def write_slots(positions: jax.Array, size: int, end: jax.Array | None = None) -> jax.Array:
    """The ring slot each chunk position is written to.

    Args:
      positions, size, end: [B, T] consecutive positions, R, optional [B] end (not written past).

    Returns:
      [B, T] int32: ``p % R`` for each row's last R written positions, else R (dropped).
    """
    ok = jnp.ones(positions.shape, bool)
    if end is not None:
        ok &= positions < end[:, None]
    last_end = jnp.max(jnp.where(ok, positions + 1, 0), axis=1, keepdims=True)
    ok &= positions >= last_end - size
    return jnp.where(ok, jnp.mod(positions, size), size).astype(jnp.int32)


def stored(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Chunk rows [..., H] as a cache of storage ``dtype`` holds them (int8: encoded)."""
    return kv_quant.encode(x) if kv_quant.is_int8(dtype) else x.astype(dtype)


def writes_first(t: Any, size: int, window: int) -> bool:
    """Whether a chunk of T (static) positions is written before its queries attend."""
    return isinstance(t, int) and t <= size - window + 1


def ring_attention(keys: jax.Array | SlotsLast, values: jax.Array, q: jax.Array, k: jax.Array,
                   v: jax.Array, positions: jax.Array, *, written: bool, window: int,
                   impl: str, scale: float | None = None, softcap: float | None = None,
                   sinks: jax.Array | None = None, chunk: int | None = None) -> jax.Array:
    """A local layer's queries over its ring rows (see the module docstring).

    Args:
      keys, values: [B, K, R, H] the chunk rows' ring keys (maybe ``SlotsLast``) and values as
        stored, after the chunk's write when ``written``, before it otherwise.
      q, k, v: [B, T, N, H] queries, [B, T, K, H] the chunk's keys (both rotated) and values.
      positions: [B, T] consecutive positions per row.
      written, window: whether the ring holds the chunk already (``writes_first``); W.
      impl, scale, softcap, sinks, chunk: as ``ops.attention.attention`` takes them.

    Returns:
      [B, T, N, H] attention output.
    """
    size = values.shape[-2]
    keys, slots_last = stored_keys(keys)
    if written:
        k_positions = ring_positions(positions[:, 0] + q.shape[1] - 1, size)
    else:
        new_k, new_v = stored(k, keys.dtype), stored(v, values.dtype)
        new_k = new_k.transpose(0, 2, 3, 1) if slots_last else new_k.transpose(0, 2, 1, 3)
        keys = jnp.concatenate([keys, new_k], axis=-1 if slots_last else -2)
        values = jnp.concatenate([values, new_v.transpose(0, 2, 1, 3)], axis=-2)
        k_positions = jnp.concatenate(
            [ring_positions(positions[:, 0] - 1, size), positions.astype(jnp.int32)], axis=1)
    if kv_quant.is_int8(values.dtype):
        keys = kv_quant.decode(keys, q.dtype, axis=-2 if slots_last else -1)
        values = kv_quant.decode(values, q.dtype)
    return attention(q.astype(keys.dtype), SlotsLast(keys) if slots_last else keys, values,
                     q_positions=positions, k_positions=k_positions, window=window, impl=impl,
                     scale=scale, softcap=softcap, sinks=sinks, chunk=chunk)


def attend(cache: Any, j: int | jax.Array, layout: RingLayout, q: jax.Array, k: jax.Array,
           v: jax.Array, positions: jax.Array, *,
           read_ring: Callable[[Any, Any], tuple[jax.Array, jax.Array]],
           write_ring: Callable[[Any, Any], Any], **kwargs: Any) -> tuple[jax.Array, Any]:
    """Ring j's attention: the chunk written and attended.

    Args:
      cache, j, layout: the cache (a pytree the callbacks take), the ring, its ``RingLayout``.
      q, k, v, positions: the chunk, as ``ring_attention`` takes it.
      read_ring: (cache, j) -> ring j's keys and values of the chunk's rows, as stored.
      write_ring: (cache, j) -> the cache with the chunk written into ring j.
      **kwargs: the rest of ``ring_attention``'s arguments.

    Returns:
      ([B, T, N, H] attention output, the cache with the chunk written).
    """
    first = writes_first(q.shape[1], layout.size, layout.window)
    if first:
        cache = write_ring(cache, j)
    out = ring_attention(*read_ring(cache, j), q, k, v, positions, written=first,
                         window=layout.window, **kwargs)
    return out, cache if first else write_ring(cache, j)


def write_rings(k_ring: Any, v_ring: Any, j: int | jax.Array, k: jax.Array, v: jax.Array,
                positions: jax.Array, *, rows: jax.Array | None = None,
                end: jax.Array | None = None) -> tuple[Any, Any]:
    """Writes each row's last R positions (below ``end``) of a chunk into ring j.

    Args:
      k_ring, v_ring: stacked key and value rings [L, B', K, R, H], or tuples of L
        [B', K, R, H] ([K, R, H] at B' = 1); the keys may be a ``SlotsLast``.
      j: the ring (traced only when stacked).
      k, v, positions: [B, T, K, H] new keys and values, their [B, T] consecutive positions.
      rows, end: optional [B] ring row of each chunk row (default b), end of its writes.

    Returns:
      (key rings, value rings) with ring j written.
    """
    first = v_ring[0] if isinstance(v_ring, tuple) else v_ring  # the first layer, or the stack
    k, v = stored(k, first.dtype), stored(v, first.dtype)
    slots = write_slots(positions, first.shape[-2], end)
    rows = jnp.arange(k.shape[0]) if rows is None else rows
    if not isinstance(v_ring, tuple):
        return (scatter_stacked(k_ring, j, rows, k, slots),
                scatter_stacked(v_ring, j, rows, v, slots))
    out = []
    for typed, new in ((k_ring, k), (v_ring, v)):
        ring, slots_last = stored_keys(typed)
        layer = ring[j].reshape(-1, *ring[j].shape[-3:])  # [B', K, ...]
        index = [rows[:, None], slice(None), slice(None), slice(None)]
        index[3 if slots_last else 2] = slots
        written = layer.at[tuple(index)].set(new, mode="drop").reshape(ring[j].shape)
        ring = (*ring[:j], written, *ring[j + 1:])
        out.append(SlotsLast(ring) if slots_last else ring)
    return out[0], out[1]


def scatter_stacked(ring: jax.Array | SlotsLast, j: int | jax.Array, rows: jax.Array,
                    new: jax.Array, slots: jax.Array) -> jax.Array | SlotsLast:
    """Writes chunk rows into one layer of stacked rings, dropping slots out of range.

    Args:
      ring, j: the rings [L, B', K, R, H] (or ``SlotsLast``), the layer.
      rows, new, slots: [B] ring rows, [B, T, K, H] chunk rows, [B, T] slots (R: not written).

    Returns:
      The rings with layer j written, in their layout.
    """
    ring, slots_last = stored_keys(ring)
    index = [j, rows[:, None], slice(None), slice(None), slice(None)]
    index[4 if slots_last else 3] = slots
    ring = ring.at[tuple(index)].set(new.astype(ring.dtype), mode="drop")
    return SlotsLast(ring) if slots_last else ring


def ring_bytes(config: Architecture, rows: int, dtype: jnp.dtype | str,
               layout: RingLayout | None) -> int:
    """Bytes of K and V of the local layers' rings for ``rows`` rows (0 without rings)."""
    if layout is None:
        return 0
    dtype = jnp.dtype(dtype)
    h = kv_quant.stored_head_dim(config.head_dim, dtype)
    return 2 * layout.n_local * rows * layout.size * config.n_kv_heads * h * dtype.itemsize
