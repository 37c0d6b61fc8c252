"""The KV cache: one explicit, fixed-size pytree passed into the model and returned updated.

Training, prefill and every decode step run the same ``Transformer``; with a cache each block
calls ``cache.attend``, which writes the chunk's keys/values at their positions and attends over
the whole layer: the one interface the model's attention uses (``Cache``), so the layout below
is the cache's own business and another cache (a paged one) plugs in without a branch in the
model. Its layers
follow the model's: stacked ([L, ...]) for a scanned model, which carries the cache through its
layer scan and indexes it with the (traced) layer number, so the decode program does not grow
with depth; one array per layer for an unrolled model, so a layer reads its own buffer (XLA:CPU
copied a static slice of a stacked cache before every attention: decode_25m at batch 8 with
1024 slots took 80 ms per step that way, against 25-35 ms with one array per layer).

Layout. One row per (sequence, kv head): values are [L, B, K, S, H], so attention's batch
dimensions (B, K) lead and each row's slots are contiguous, which is what the accelerator
kernels and XLA's batched dots read without a transpose. Keys are the same, or with
``keys_transposed`` stored [L, B, K, H, S]: on XLA:CPU, q [G, H] @ keys [H, S] streams the cache
in storage order, while keys [S, H] were read 2-4x slower (decode_25m, batch 8, 1024 slots: a
decode step over [S, H] keys took about twice as long). It is the default on CPU only
(``default_keys_transposed``); GPUs and TPUs keep [B, K, S, H].

int8 (``dtype="int8"``). Each token's row of each kv head is stored as its int8 values and its
scale, H + 2 bytes in the place of H (``ops.kv_quant``), written in the same write and
dequantised just before attention.

Local layers. When the model has sliding-window layers (``Architecture.layer_kinds``) and the
window is shorter than S_max, each local layer keeps a ring of W slots per row instead of S_max
(``kv_ring``): ``k``/``v`` then hold the global layers only and ``k_local``/``v_local`` the
rings, in the same layouts; ``ring`` (static) says which layer is where. Without local layers
(``ring`` None) the cache and its program are what they were.
"""

from __future__ import annotations

from typing import Any, Protocol

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from transformer_jax.model import kv_ring
from transformer_jax.model.config import Architecture, ModelConfig
from transformer_jax.model.kv_ring import RingLayout
from transformer_jax.model.ops import kv_quant
from transformer_jax.model.ops.attention import attention
from transformer_jax.model.stack import LayerRef

#: Logical axis names of the cache's [L, B, K, S, H] arrays (the mesh rules shard kv heads over
#: the tensor axis, as they shard the k/v projections).
CACHE_AXES = ("layers", "batch", "kv_heads", None, None)


def default_keys_transposed() -> bool:
    """Whether caches store keys [H, S] per row by default: on the CPU backend only."""
    return jax.default_backend() == "cpu"


@flax.struct.dataclass
class KVCache:
    """Keys and values of every layer for up to S_max positions per sequence.

    Slot s of sequence b holds the key/value of the token at position s, so the causal mask
    over slot indices is also the validity mask: slots past a sequence's length are never seen.
    A local layer with a ring (``ring``) holds position p in slot ``p % W`` of its own arrays.

    Attributes:
      k: [L, B, K, S_max, H] keys (already rotated by RoPE), or [L, B, K, H, S_max] when
        ``keys_transposed``; for an unrolled model a tuple of L arrays [B * K, S_max, H] (or
        [B * K, H, S_max]), rows (sequence, kv head) merged (``layer`` gives [B, K, ...]).
        With rings, L counts the global layers only.
      v: [L, B, K, S_max, H] values (a tuple of L [B * K, S_max, H] for an unrolled model).
      lengths: [B] int32 number of positions written per sequence (the next write position).
      k_local: None, or the local layers' key rings: [L_local, B, K, W, H] ([L_local, B, K, H,
        W] when ``keys_transposed``), a tuple of L_local [B * K, W, H] for an unrolled model.
      v_local: None, or the local layers' value rings, [L_local, B, K, W, H] (or a tuple).
      ring_end: None, or [B] int32: the rings take no position at or past it (a right-padded
        prefill sets each prompt's length, so its padding does not overwrite the window).
      keys_transposed: static; the keys' layout (see the module docstring).
      ring: static; which layers are rings (``kv_ring.RingLayout``), None without.
    """

    k: jax.Array | tuple[jax.Array, ...]
    v: jax.Array | tuple[jax.Array, ...]
    lengths: jax.Array
    k_local: jax.Array | tuple[jax.Array, ...] | None = None
    v_local: jax.Array | tuple[jax.Array, ...] | None = None
    ring_end: jax.Array | None = None
    keys_transposed: bool = flax.struct.field(pytree_node=False, default=False)
    ring: RingLayout | None = flax.struct.field(pytree_node=False, default=None)

    @classmethod
    def init(cls, config: ModelConfig, batch: int, max_len: int,
             dtype: jnp.dtype | str | None = None,
             keys_transposed: bool | None = None, *, window_rings: bool = True) -> KVCache:
        """An empty cache.

        Args:
          config: the model's config (gives L, K, H and the layers' kinds).
          batch: B.
          max_len: S_max, the largest number of positions it can hold.
          dtype: storage dtype (a float dtype, or ``"int8"``: values and a scale per token
            and kv head, ``ops.kv_quant``); the model's compute dtype by default.
          keys_transposed: the keys' layout; default ``default_keys_transposed()``.
          window_rings: local layers keep a ring of their window (``kv_ring``) when it is
            shorter than S_max; False gives every layer S_max slots.
        """
        if batch <= 0 or max_len <= 0:
            raise ValueError(f"batch and max_len must be positive, got {batch} and {max_len}")
        if keys_transposed is None:
            keys_transposed = default_keys_transposed()
        dtype = jnp.dtype(dtype or config.dtype)
        ring = RingLayout.of(config, max_len) if window_rings else None
        rows = (batch, config.n_kv_heads)
        h = kv_quant.stored_head_dim(config.head_dim, dtype)

        def arrays(n_layers: int, slots: int) -> tuple[Any, Any]:
            k_shape = (*rows, h, slots) if keys_transposed else (*rows, slots, h)
            v_shape = (*rows, slots, h)
            if config.scan_layers:
                return (jnp.zeros((n_layers, *k_shape), dtype),
                        jnp.zeros((n_layers, *v_shape), dtype))
            # rows (sequence, kv head) merged: [B * K, ...] per layer (see _write_rows)
            return (tuple(jnp.zeros((batch * config.n_kv_heads, *k_shape[2:]), dtype)
                          for _ in range(n_layers)),
                    tuple(jnp.zeros((batch * config.n_kv_heads, *v_shape[2:]), dtype)
                          for _ in range(n_layers)))

        lengths = jnp.zeros((batch,), jnp.int32)
        if ring is None:
            k, v = arrays(config.n_layers, max_len)
            return cls(k=k, v=v, lengths=lengths, keys_transposed=keys_transposed)
        k, v = arrays(ring.n_global, max_len)
        k_local, v_local = arrays(ring.n_local, ring.size)
        return cls(k=k, v=v, lengths=lengths, k_local=k_local, v_local=v_local,
                   keys_transposed=keys_transposed, ring=ring)

    @property
    def stacked(self) -> bool:
        """Whether the layers are one [L, ...] array (a scanned model) or a tuple."""
        return not isinstance(self.v if self.ring is None else self.v_local, tuple)

    @property
    def max_len(self) -> int | None:
        """S_max, the slots of the full layers (None when every layer is a ring)."""
        if self.stacked:
            return self.v.shape[3]
        return self.v[0].shape[1] if self.v else None

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    @property
    def int8(self) -> bool:
        """Whether rows are stored int8 with their scales (``ops.kv_quant``)."""
        v = self.v if self.ring is None else self.v_local
        return kv_quant.is_int8((v if self.stacked else v[0]).dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of K and V (rings included): ``2 * L * B * S_max * K * H * bytes_per_element``
        without rings."""
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(
            (self.k, self.v, self.k_local, self.v_local)))

    def layer(self, i: int | jax.Array | LayerRef) -> tuple[jax.Array, jax.Array]:
        """Layer i's (keys, values): [B, K, S, H] each (keys [B, K, H, S] when transposed);
        a ring layer's S is its W slots. ``i`` as ``kv_ring.locate`` takes it."""
        ring, j = kv_ring.locate(self.ring, i)
        if ring:
            return _layer_of(self.k_local, self.v_local, j, self.stacked, self.batch)
        return _layer_of(self.k, self.v, j, self.stacked, self.batch)

    def attend(self, i: int | jax.Array | LayerRef, q: jax.Array, k: jax.Array, v: jax.Array,
               positions: jax.Array, *, window: int | jax.Array | None, impl: str,
               scale: float | None = None, softcap: float | None = None
               ) -> tuple[jax.Array, KVCache]:
        """Layer i's attention with this cache: writes the chunk's keys/values, then attends
        the queries over every slot of the layer.

        Slot s holds position s, so the causal structure also hides slots not written yet. This
        is the one call the model's attention makes (``Cache``): another cache (paged, say)
        plugs in by giving the same. A ring layer attends as ``kv_ring.attend`` says.

        Args:
          i: the layer: its number (a Python int, or traced when every layer is alike), or a
            scanned block's ``LayerRef`` (``kv_ring.locate``).
          q: [B, T, N, H] queries (rotated).
          k: [B, T, K, H] new keys (rotated) for ``positions``.
          v: [B, T, K, H] new values.
          positions: [B, T] int positions, consecutive per row; row b is written at slots
            ``positions[b, 0] ..``.
          window: optional sliding window length.
          impl: the attention implementation (``ops.attention.attention``).
          scale: the logits' scale (default ``1/sqrt(H)``).
          softcap: optional logit soft-cap (``ops.softcap``).

        Returns:
          ([B, T, N, H] attention output, the cache with layer i written).
        """
        logits = dict(impl=impl, scale=scale, softcap=softcap)
        ring, j = kv_ring.locate(self.ring, i)
        if ring:
            return kv_ring.attend(
                self, j, self.ring, q, k, v, positions,
                read_ring=lambda c, j: _layer_of(c.k_local, c.v_local, j, c.stacked, c.batch),
                write_ring=lambda c, j: c._write_ring(j, k, v, positions),
                keys_transposed=self.keys_transposed, **logits)
        cache = self._write_full(j, k, v, positions[:, 0])
        keys, values = _layer_of(cache.k, cache.v, j, cache.stacked, cache.batch)
        if self.int8:  # dequantised for the reference attention, each row with its own scale
            keys = kv_quant.decode(keys, q.dtype, axis=-2 if self.keys_transposed else -1)
            values = kv_quant.decode(values, q.dtype)
        return attention(q.astype(keys.dtype), keys, values, q_positions=positions,
                         window=window, keys_transposed=self.keys_transposed,
                         **logits), cache

    def write(self, i: int | jax.Array | LayerRef, k: jax.Array, v: jax.Array,
              start: jax.Array) -> KVCache:
        """Writes a chunk of T new keys/values of each sequence at its own start slot.

        Slots past S_max must not be written (callers check capacity): the write promises XLA
        that indices are in bounds, which keeps it an in-place update of the loop-carried cache.
        A ring layer takes the chunk's last W positions (``ring_end`` applies).

        Args:
          i: the layer, as ``attend`` takes it.
          k: [B, T, K, H] new keys for positions ``start[b] .. start[b] + T - 1``.
          v: [B, T, K, H] new values.
          start: [B] int32 first slot per sequence.

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
        """``write`` into full layer i (of ``k``/``v``)."""
        if self.int8:
            k, v = kv_quant.encode(k), kv_quant.encode(v)
        if self.stacked:
            return self.replace(k=_write_stacked(self.k, i, k, start, self.keys_transposed),
                                v=_write_stacked(self.v, i, v, start, False))
        new_k, new_v = list(self.k), list(self.v)
        new_k[i] = _write_rows(self.k[i], k, start, self.keys_transposed)
        new_v[i] = _write_rows(self.v[i], v, start, False)
        return self.replace(k=tuple(new_k), v=tuple(new_v))

    def _write_ring(self, j: int | jax.Array, k: jax.Array, v: jax.Array,
                    positions: jax.Array) -> KVCache:
        """Writes the chunk's last W positions (below ``ring_end``) into ring j."""
        t = positions.shape[1]
        if self.ring_end is None and isinstance(t, int) and t == 1:
            # A decode step: the in-place writes of the full layers, at slot p % W.
            if self.int8:
                k, v = kv_quant.encode(k), kv_quant.encode(v)
            start, tr = jnp.mod(positions[:, 0], self.ring.size), self.keys_transposed
            if self.stacked:
                return self.replace(k_local=_write_stacked(self.k_local, j, k, start, tr),
                                    v_local=_write_stacked(self.v_local, j, v, start, False))
            new_k, new_v = list(self.k_local), list(self.v_local)
            new_k[j] = _write_rows(self.k_local[j], k, start, tr)
            new_v[j] = _write_rows(self.v_local[j], v, start, False)
            return self.replace(k_local=tuple(new_k), v_local=tuple(new_v))
        k_local, v_local = kv_ring.write_rings(
            self.k_local, self.v_local, j, k, v, positions, end=self.ring_end,
            keys_transposed=self.keys_transposed, merged=True)
        return self.replace(k_local=k_local, v_local=v_local)

    def constrain(self) -> KVCache:
        """The cache with its logical sharding pinned (kv heads over the tensor axis).

        A no-op unless logical-axis rules and a mesh are in context (``sharding.jit_sharded``).
        """
        if not self.stacked:
            # Merged (sequence, kv head) rows do not split by kv head in one block per device:
            # the partitioner places them from the weights' shardings.
            return self
        pinned = {name: nn.with_logical_constraint(getattr(self, name), CACHE_AXES)
                  for name in ("k", "v", "k_local", "v_local")
                  if getattr(self, name) is not None}
        return self.replace(**pinned)


class Cache(Protocol):
    """What the model needs of a cache: ``KVCache`` is one, a paged cache would be another.

    ``lengths`` [B] are the positions written per sequence (the model continues from them and
    sets them after a chunk, through ``replace``); ``attend`` stores a layer's chunk and
    attends over the layer's keys and values, in whatever layout the cache keeps them.
    """

    lengths: jax.Array

    def attend(self, i: int | jax.Array | LayerRef, q: jax.Array, k: jax.Array, v: jax.Array,
               positions: jax.Array, *, window: int | jax.Array | None, impl: str,
               scale: float | None = None, softcap: float | None = None
               ) -> tuple[jax.Array, Cache]: ...

    def replace(self, **changes: Any) -> Cache: ...


def _in_storage_order(new: jax.Array, keys_transposed: bool) -> jax.Array:
    """A chunk [B, T, K, H] -> [B, K, T, H], or [B, K, H, T] for keys stored transposed."""
    return new.transpose(0, 2, 3, 1) if keys_transposed else new.transpose(0, 2, 1, 3)


def _write_stacked(cache: jax.Array, i: int | jax.Array, new: jax.Array, start: jax.Array,
                   keys_transposed: bool) -> jax.Array:
    """Layer i's write into a stacked [L, B, K, S, H] (or [L, B, K, H, S]) buffer.

    At B = 1 one dynamic-update-slice (the scatter below would become a bounds-checked select
    that copies the whole cache there); else a scatter of [B, T] (row, slot) pairs.
    """
    b, t = new.shape[:2]
    new = new.astype(cache.dtype)
    slot_axis = 4 if keys_transposed else 3
    if isinstance(b, int) and b == 1:
        at = [i, 0, 0, 0, 0]
        at[slot_axis] = start[0]
        update = _in_storage_order(new, keys_transposed)[None]
        return jax.lax.dynamic_update_slice(cache, update, tuple(at))
    rows = jnp.arange(b)[:, None]
    slots = start[:, None] + jnp.arange(t, dtype=start.dtype)  # [B, T]
    index = [i, rows, slice(None), slice(None), slice(None)]
    index[slot_axis] = slots
    # The advanced indices (i, rows, slots) broadcast to [B, T] and lead: updates [B, T, K, H].
    return cache.at[tuple(index)].set(new, mode="promise_in_bounds", unique_indices=True)


def _write_rows(cache: jax.Array, new: jax.Array, start: jax.Array,
                keys_transposed: bool) -> jax.Array:
    """One layer's write into a buffer of merged (sequence, kv head) rows.

    Args:
      cache: [B * K, S, H] (or [B * K, H, S] for transposed keys).
      new: [B, T, K, H].
      start: [B] int32 first slot per sequence.

    A dynamic-update-slice per (sequence, kv head) row, which XLA keeps in place in the loop
    carry (at B = 1 one plain dynamic-update-slice: the batched form becomes a select copying
    the whole cache there).
    """
    b, t, kv, h = new.shape
    rows = _in_storage_order(new.astype(cache.dtype), keys_transposed)
    at = (lambda s: (0, s)) if keys_transposed else (lambda s: (s, 0))
    # The carried buffers are stored with rows merged: reshaping a [B, K, ...] buffer around
    # the update kept XLA from doing it in place at B = 1 (about 8 ms of a 16 ms decode_25m
    # step over 1024 slots was a copy of the cache).
    rows = rows.reshape(b * kv, *rows.shape[2:])
    if isinstance(b, int) and b == 1:
        return jax.lax.dynamic_update_slice(cache, rows, (0, *at(start[0])))
    row_starts = jnp.repeat(start, kv)

    def one(c: jax.Array, n: jax.Array, s: jax.Array) -> jax.Array:
        return jax.lax.dynamic_update_slice(c, n, at(s))

    return jax.vmap(one)(cache, rows, row_starts)


def cache_bytes(config: Architecture, batch: int, max_len: int,
                dtype: jnp.dtype | str | None = None, *, window_rings: bool = True) -> int:
    """Size of K and V of a ``KVCache.init(config, batch, max_len, dtype)``, without
    allocating it (int8: values and scales; local layers' rings of W slots, as ``init`` makes
    them with ``window_rings``)."""
    dtype = jnp.dtype(dtype or config.dtype)
    h = kv_quant.stored_head_dim(config.head_dim, dtype)
    ring = RingLayout.of(config, max_len) if window_rings else None
    full = config.n_layers if ring is None else ring.n_global
    return (2 * full * batch * max_len * config.n_kv_heads * h * dtype.itemsize
            + kv_ring.ring_bytes(config, batch, dtype, ring))


def _layer_of(k: Any, v: Any, i: int | jax.Array, stacked: bool, b: int
              ) -> tuple[jax.Array, jax.Array]:
    """Layer i of stacked ([L, B, K, ...]) or merged-row ([B * K, ...] per layer) arrays, as
    [B, K, ...] each."""
    if stacked:
        return k[i], v[i]
    return k[i].reshape(b, -1, *k[i].shape[1:]), v[i].reshape(b, -1, *v[i].shape[1:])
