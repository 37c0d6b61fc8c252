"""The KV cache: one explicit, fixed-size pytree passed into the model and returned updated.
Each block calls ``cache.attend`` (the ``Cache`` interface), so the layout (per-layer arrays,
``SlotsLast`` keys on CPU, int8 rows, window rings, latent entries) is the cache's business."""

from __future__ import annotations

from typing import Any, Protocol

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from transformer_jax.model import kv_ring
from transformer_jax.model.config import Architecture, ModelConfig
from transformer_jax.model.kv_ring import RingLayout
from transformer_jax.model.ops import kv_quant, target
from transformer_jax.model.ops.attention import attention
from transformer_jax.model.ops.layouts import SlotsLast, stored_keys
from transformer_jax.model.stack import LayerRef

#: Logical axis names of the cache's [L, B, K, S, H] arrays (the mesh rules shard kv heads over
#: the tensor axis, as they shard the k/v projections).
CACHE_AXES = ("layers", "batch", "kv_heads", None, None)


def slots_last_for(platform: str | None = None) -> bool:
    """Whether a cache for ``platform`` (default: the traced target's) stores keys ``SlotsLast``."""
    return (platform or target.platform()) == "cpu"


@flax.struct.dataclass
class KVCache:
    """Keys and values of every layer for up to S_max positions per sequence: slot s holds position
    s (ring layers: slot ``p % W`` of their own arrays), so causality also hides unwritten slots.

    Attributes:
      k: [L, B, K, S_max, H] keys (rotated); unrolled, a tuple of L [B, K, S_max, H] ([K, S_max,
        H] for one sequence); ``SlotsLast`` on CPU. With rings, L counts the global layers only.
      v: [L, B, K, S_max, H] values (a tuple of L [B, K, S_max, H] for an unrolled model).
      lengths: [B] int32 number of positions written per sequence.
      k_local, v_local: None, or the ring layers' [L_local, B, K, W, H] (laid out as k and v).
      ring_end: None, or [B] int32: the rings take no position at or past it.
      ring: static; which layers are rings (``kv_ring.RingLayout``), None without.
      latent: None, or the latent layers' entries [L, B, S_max, R + P] (or a tuple of L).
    """

    k: jax.Array | tuple[jax.Array, ...] | SlotsLast
    v: jax.Array | tuple[jax.Array, ...]
    lengths: jax.Array
    k_local: jax.Array | tuple[jax.Array, ...] | SlotsLast | None = None
    v_local: jax.Array | tuple[jax.Array, ...] | None = None
    ring_end: jax.Array | None = None
    ring: RingLayout | None = flax.struct.field(pytree_node=False, default=None)
    latent: jax.Array | tuple[jax.Array, ...] | None = None

    @classmethod
    def init(cls, config: ModelConfig, batch: int, max_len: int,
             dtype: jnp.dtype | str | None = None, *, platform: str | None = None,
             window_rings: bool = True) -> KVCache:
        """An empty cache.

        Args:
          config: the model's config.
          batch, max_len: B and S_max, the positions it can hold per sequence.
          dtype: a float storage dtype or ``"int8"`` (``ops.kv_quant``); default the compute dtype.
          platform: the platform the cache is for (picks the key layout, ``slots_last_for``).
          window_rings: local layers keep a ring of their window when it is shorter than S_max.
        """
        if batch <= 0 or max_len <= 0:
            raise ValueError(f"batch and max_len must be positive, got {batch} and {max_len}")
        slots_last = slots_last_for(platform)
        dtype = jnp.dtype(dtype or config.dtype)
        ring = RingLayout.of(config, max_len) if window_rings else None
        rows = (batch, config.n_kv_heads)
        h = kv_quant.stored_head_dim(config.head_dim, dtype)

        def arrays(n_layers: int, slots: int) -> tuple[Any, Any]:
            def zeros(shape: tuple[int, ...]) -> Any:
                if config.scan_layers:
                    return jnp.zeros((n_layers, *shape), dtype)
                # One array per layer, [B, K, ...], or [K, ...] at B = 1 (see _write).
                return tuple(jnp.zeros(shape[int(batch == 1):], dtype) for _ in range(n_layers))

            k = zeros((*rows, h, slots) if slots_last else (*rows, slots, h))
            return SlotsLast(k) if slots_last else k, zeros((*rows, slots, h))

        lengths = jnp.zeros((batch,), jnp.int32)
        if config.mla is not None:
            if kv_quant.is_int8(dtype):
                raise ValueError("a latent (MLA) cache stores floats: int8 is not supported, "
                                 "use the compute dtype or bfloat16")
            k, v = arrays(0, max_len)
            shape = (batch, max_len, config.mla.entry_dim)
            latent = (jnp.zeros((config.n_layers, *shape), dtype) if config.scan_layers else
                      tuple(jnp.zeros(shape, dtype) for _ in range(config.n_layers)))
            return cls(k, v, lengths, latent=latent)
        if ring is None:
            return cls(*arrays(config.n_layers, max_len), lengths)
        k, v = arrays(ring.n_global, max_len)
        k_local, v_local = arrays(ring.n_local, ring.size)
        return cls(k=k, v=v, lengths=lengths, k_local=k_local, v_local=v_local, ring=ring)

    @property
    def stacked(self) -> bool:
        """Whether the layers are one [L, ...] array (a scanned model) or a tuple."""
        return not isinstance(self.v if self.ring is None else self.v_local, tuple)

    @property
    def max_len(self) -> int | None:
        """S_max, the slots of the full layers (None when every layer is a ring)."""
        if self.latent is not None:
            return self.latent.shape[-2] if self.stacked else self.latent[0].shape[-2]
        if self.stacked:
            return self.v.shape[3]
        return self.v[0].shape[-2] if self.v else None

    @property
    def slots_last(self) -> bool:
        """Whether the keys are stored [H, S] per row (``ops.layouts.SlotsLast``)."""
        return isinstance(self.k if self.ring is None else self.k_local, SlotsLast)

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    @property
    def int8(self) -> bool:
        """Whether rows are stored int8 with their scales (``ops.kv_quant``)."""
        if self.latent is not None:
            return False
        v = self.v if self.ring is None else self.v_local
        return kv_quant.is_int8((v if self.stacked else v[0]).dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of K and V (rings and latents included)."""
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(
            (self.k, self.v, self.k_local, self.v_local, self.latent)))

    def layer(self, i: int | jax.Array | LayerRef) -> tuple[jax.Array, jax.Array]:
        """Layer i's (keys, values): [B, K, S, H] each (rings: S = W; keys maybe ``SlotsLast``)."""
        ring, j = kv_ring.locate(self.ring, i)
        k, v = (self.k_local, self.v_local) if ring else (self.k, self.v)
        return _layer_of(k, v, j, self.batch)

    def attend(self, i: int | jax.Array | LayerRef, q: jax.Array, k: jax.Array, v: jax.Array,
               positions: jax.Array, *, window: int | jax.Array | None, impl: str,
               scale: float | None = None, softcap: float | None = None,
               sinks: jax.Array | None = None, chunk: int | None = None
               ) -> tuple[jax.Array, KVCache]:
        """Layer i's attention with this cache: writes the chunk's keys/values, then attends the
        queries over every slot of the layer.

        Args:
          i: the layer: its number, or a scanned block's ``LayerRef`` (``kv_ring.locate``).
          q, k, v: [B, T, N, H] queries, [B, T, K, H] new keys (both rotated) and values.
          positions: [B, T] int positions, consecutive per row.
          window, impl, scale, softcap, sinks, chunk: as ``ops.attention.attention`` takes them.

        Returns:
          ([B, T, N, H] attention output, the cache with layer i written).
        """
        logits = dict(impl=impl, scale=scale, softcap=softcap, sinks=sinks, chunk=chunk)
        ring, j = kv_ring.locate(self.ring, i)
        if ring:
            return kv_ring.attend(
                self, j, self.ring, q, k, v, positions,
                read_ring=lambda c, j: _layer_of(c.k_local, c.v_local, j, c.batch),
                write_ring=lambda c, j: c._write_ring(j, k, v, positions), **logits)
        cache = self._write_full(j, k, v, positions[:, 0])
        keys, values = _layer_of(cache.k, cache.v, j, cache.batch)
        if self.int8:  # dequantised for the reference attention, each row with its own scale
            raw, slots_last = stored_keys(keys)
            raw = kv_quant.decode(raw, q.dtype, axis=-2 if slots_last else -1)
            keys, values = SlotsLast(raw) if slots_last else raw, kv_quant.decode(values, q.dtype)
        return attention(q.astype(values.dtype), keys, values, q_positions=positions,
                         window=window, **logits), cache

    def attend_latent(self, i: int | jax.Array | LayerRef, entries: jax.Array,
                      positions: jax.Array) -> tuple[jax.Array, KVCache]:
        """Latent layer i's cache: writes the chunk's entries and returns every slot's.

        Args:
          i, positions: as ``attend`` takes them.
          entries: [B, T, R + P] the chunk's [latent, rope key] per token.

        Returns:
          ([B, S_max, R + P] the layer's entries, the cache with them written).
        """
        _, j = kv_ring.locate(None, i)
        start = positions[:, 0]
        buf = self.latent
        if isinstance(buf, tuple):
            layer = _write_entries(buf[j], (), entries, start)
            return layer, self.replace(latent=(*buf[:j], layer, *buf[j + 1:]))
        buf = _write_entries(buf, (j,), entries, start)
        return buf[j], self.replace(latent=buf)

    def write(self, i: int | jax.Array | LayerRef, k: jax.Array, v: jax.Array,
              start: jax.Array) -> KVCache:
        """Writes a chunk of T new keys/values of each sequence at its own start slot (below S_max).

        Args:
          i: the layer, as ``attend`` takes it.
          k, v, start: [B, T, K, H] new keys and values, [B] int32 first slot per sequence.

        Returns:
          The cache with layer i updated (lengths unchanged: the model sets them).
        """
        ring, j = kv_ring.locate(self.ring, i)
        if ring:
            positions = start[:, None] + jnp.arange(k.shape[1], dtype=start.dtype)
            return self._write_ring(j, k, v, positions)
        return self._write_full(j, k, v, start)

    def _write_full(self, i: int | jax.Array, k: jax.Array, v: jax.Array, start: jax.Array
                    ) -> KVCache:
        if self.int8:
            k, v = kv_quant.encode(k), kv_quant.encode(v)
        return self.replace(k=_write(self.k, i, k, start), v=_write(self.v, i, v, start))

    def _write_ring(self, j: int | jax.Array, k: jax.Array, v: jax.Array,
                    positions: jax.Array) -> KVCache:
        """Writes the chunk's last W positions (below ``ring_end``) into ring j."""
        t = positions.shape[1]
        if self.ring_end is None and isinstance(t, int) and t == 1:
            # A decode step: the in-place writes of the full layers, at slot p % W.
            if self.int8:
                k, v = kv_quant.encode(k), kv_quant.encode(v)
            start = jnp.mod(positions[:, 0], self.ring.size)
            return self.replace(k_local=_write(self.k_local, j, k, start),
                                v_local=_write(self.v_local, j, v, start))
        k_local, v_local = kv_ring.write_rings(
            self.k_local, self.v_local, j, k, v, positions, end=self.ring_end)
        return self.replace(k_local=k_local, v_local=v_local)

    def constrain(self) -> KVCache:
        """The cache with its logical sharding pinned (a no-op without a mesh and rules)."""
        if jax.sharding.get_abstract_mesh().empty:
            return self
        def pin(x: jax.Array) -> jax.Array:  # per layer [B, K, ...] or [K, ...]
            return nn.with_logical_constraint(x, CACHE_AXES[len(CACHE_AXES) - x.ndim:])

        pinned = {name: jax.tree.map(pin, getattr(self, name))
                  for name in ("k", "v", "k_local", "v_local")
                  if getattr(self, name) is not None}
        if self.latent is not None:  # [L, B, S, E] or per layer [B, S, E]
            pinned["latent"] = jax.tree.map(lambda x: nn.with_logical_constraint(
                x, ("layers", "batch", None, None)[4 - x.ndim:]), self.latent)
        return self.replace(**pinned)


class Cache(Protocol):
    """What the model needs of a cache: ``lengths`` [B], ``attend`` (and ``replace``)."""

    lengths: jax.Array

    def attend(self, i: int | jax.Array | LayerRef, q: jax.Array, k: jax.Array, v: jax.Array,
               positions: jax.Array, *, window: int | jax.Array | None, impl: str,
               scale: float | None = None, softcap: float | None = None,
               sinks: jax.Array | None = None, chunk: int | None = None
               ) -> tuple[jax.Array, Cache]: ...

    def attend_latent(self, i: int | jax.Array | LayerRef, entries: jax.Array,
                      positions: jax.Array) -> tuple[jax.Array, Cache]: ...

    def replace(self, **changes: Any) -> Cache: ...


def _write_entries(buf: jax.Array, lead: tuple[Any, ...], entries: jax.Array, start: jax.Array
                   ) -> jax.Array:
    """[B, T, E] entries written into latent layer ``buf[lead]`` ([B, S, E]) at each row's start."""
    b, t = entries.shape[:2]
    entries = entries.astype(buf.dtype)
    if isinstance(b, int) and b == 1 and not lead:
        return jax.lax.dynamic_update_slice(buf, entries, (0, start[0], 0))
    rows = jnp.arange(b)[:, None]
    slots = start[:, None] + jnp.arange(t, dtype=start.dtype)
    return buf.at[(*lead, rows, slots)].set(entries, mode="promise_in_bounds", unique_indices=True)


def _write(cache: Any, i: int | jax.Array, new: jax.Array, start: jax.Array) -> Any:
    """Layer i's write into stacked [L, B, K, S, H] buffers or a tuple of per-layer ones ([B, K, S,
    H]; [K, S, H] at B = 1, which XLA:CPU writes without copying), in their layout."""
    buf, slots_last = stored_keys(cache)
    if not isinstance(buf, tuple):
        return _write_rows(cache, (i,), new, start)
    layer = SlotsLast(buf[i]) if slots_last else buf[i]
    if buf[i].ndim == 4:
        written = _write_rows(layer, (), new, start)
    else:  # one sequence: [K, T, H] (SlotsLast: [K, H, T]) at its start slot
        update = (new[0].transpose(1, 2, 0) if slots_last else new[0].transpose(1, 0, 2))
        at = (0, 0, start[0]) if slots_last else (0, start[0], 0)
        written = jax.lax.dynamic_update_slice(buf[i], update.astype(buf[i].dtype), at)
    out = (*buf[:i], stored_keys(written)[0], *buf[i + 1:])
    return SlotsLast(out) if slots_last else out


def _write_rows(cache: jax.Array | SlotsLast, lead: tuple[Any, ...], new: jax.Array,
                start: jax.Array) -> jax.Array | SlotsLast:
    """Writes the [B, T, K, H] chunk ``new`` into buffer ``cache[lead]`` ([B, K, S, H], or
    ``SlotsLast``) at each row's ``start`` slot, in place: a dynamic-update-slice at B = 1 (a
    scatter would copy the whole cache there), else a scatter; returns the whole buffer."""
    buf, slots_last = stored_keys(cache)
    b, t = new.shape[:2]
    new = new.astype(buf.dtype)
    slot_axis = len(lead) + (3 if slots_last else 2)
    if isinstance(b, int) and b == 1:
        at = [*lead, 0, 0, 0, 0]
        at[slot_axis] = start[0]
        update = new.transpose(0, 2, 3, 1) if slots_last else new.transpose(0, 2, 1, 3)
        out = jax.lax.dynamic_update_slice(buf, update.reshape((1,) * len(lead) + update.shape),
                                           tuple(at))
    else:
        rows = jnp.arange(b)[:, None]
        slots = start[:, None] + jnp.arange(t, dtype=start.dtype)  # [B, T]
        index = [*lead, rows, slice(None), slice(None), slice(None)]
        index[slot_axis] = slots
        out = buf.at[tuple(index)].set(new, mode="promise_in_bounds", unique_indices=True)
    return SlotsLast(out) if slots_last else out


def cache_bytes(config: Architecture, batch: int, max_len: int,
                dtype: jnp.dtype | str | None = None, *, window_rings: bool = True) -> int:
    """Bytes of ``KVCache.init(config, batch, max_len, dtype, window_rings=...)``, unallocated."""
    dtype = jnp.dtype(dtype or config.dtype)
    if config.mla is not None:  # one [latent, rope key] entry per token per layer
        return config.n_layers * batch * max_len * config.mla.entry_dim * dtype.itemsize
    h = kv_quant.stored_head_dim(config.head_dim, dtype)
    ring = RingLayout.of(config, max_len) if window_rings else None
    full = config.n_layers if ring is None else ring.n_global
    return (2 * full * batch * max_len * config.n_kv_heads * h * dtype.itemsize
            + kv_ring.ring_bytes(config, batch, dtype, ring))


def _layer_of(k: Any, v: Any, i: int | jax.Array, b: int) -> tuple[Any, jax.Array]:
    """Layer i of stacked ([L, B, K, ...]) or per-layer buffers, as [B, K, ...] each."""
    return jax.tree.map(lambda x: x.reshape(b, *x.shape[-3:]), (k[i], v[i]))
