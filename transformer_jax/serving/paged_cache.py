"""The paged KV cache: a second implementation of the model's ``Cache`` interface.

Each layer's keys and values live in a pool of P fixed-size pages, [K, P, page_size, H]
(stacked [L, ...] for a scanned model, a tuple for an unrolled one, as in ``KVCache``). Row b of
the page table [B, W] lists its pages in position order: position p lives in page
``page_table[b, p // page_size]`` at offset ``p % page_size``. Page 0 is the null page: never
handed out, it takes the writes that belong to no page (idle rows, a padded chunk's tail). The
engine builds the page table and lengths per step (``with_table``).

``attend`` writes the chunk's keys/values into the row's pages, then attends through a view:

- ``"gather"`` (the reference): the row's W pages gathered into a [B, K, W * page_size, H] view;
- ``"pool"``: the queries of all rows against the whole pool read once in place, each row seeing
  only its own pages' slots;
- ``"blocks"``: each row's own pages, ``BLOCK_POSITIONS`` at a time (a row costs its own length).

``"auto"`` takes ``"blocks"`` for decode rows with the reference implementation on CPU; elsewhere
``"pool"`` for them when the pool is under twice the gathered view, and ``"gather"`` for other
chunks (docs/benchmarks.md). With ``attention_impl="pallas"`` on a GPU or TPU, ``"auto"`` reads
the pages with the Pallas paged kernels (``ops/paged_attention.py``).

int8 pages hold each token's row as int8 values and a scale (``ops.kv_quant``). Latent layers
page one entry per token (key pages [L, 1, P, page_size, R + P], value pages empty). Local
(sliding-window) layers keep a ring of W slots per engine slot instead (``k_ring``/``v_ring``).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from transformer_jax.decode.prompts import is_int
from transformer_jax.model import kv_ring
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.kv_ring import RingLayout
from transformer_jax.model.ops import kv_quant, paged_attention, target
from transformer_jax.model.ops.attention import attention, choose_impl
from transformer_jax.model.stack import LayerRef
from transformer_jax.serving import paged_views
from transformer_jax.serving.page_pool import NULL_PAGE

VIEWS = ("auto", "gather", "pool", "blocks")
#: Positions per key block of the ``"blocks"`` view (whole pages, at least one).
BLOCK_POSITIONS = 64


def storage_dtype(dtype: jnp.dtype | str) -> jnp.dtype:
    """A cache's storage dtype: a floating dtype, or int8; else ValueError naming it."""
    try:
        dt = jnp.dtype(dtype)
    except (TypeError, ValueError):
        dt = None
    if dt is None or not (jnp.issubdtype(dt, jnp.floating) or kv_quant.is_int8(dt)):
        raise ValueError(f"cache_dtype must be a floating dtype name (e.g. 'bfloat16', "
                         f"'float32') or {kv_quant.INT8!r}, got {dtype!r}")
    return dt


def check_pageable(config: ModelConfig, cache_dtype: jnp.dtype | str | None = None) -> None:
    """Raises ValueError (one line) for a bad ``cache_dtype``, or int8 pages for latent layers."""
    if cache_dtype is not None and kv_quant.is_int8(storage_dtype(cache_dtype)) and \
            config.mla is not None:
        raise ValueError("latent attention (mla) pages store floats: cache_dtype int8 is not "
                         "supported, use a float dtype")


def check_sizes(view: str, **sizes: int) -> None:
    """Raises ValueError naming a size that is not a positive int, ``num_pages`` < 2 (page 0
    is the null page) or an unknown ``view``."""
    for name, value in sizes.items():
        if not is_int(value) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if sizes["num_pages"] < 2:
        raise ValueError(f"num_pages must be at least 2 (page 0 is the null page), got "
                         f"{sizes['num_pages']}")
    if view not in VIEWS:
        raise ValueError(f"view must be one of {VIEWS}, got {view!r}")


def page_bytes(config: ModelConfig, page_size: int, dtype: jnp.dtype | str | None = None
               ) -> int:
    """Bytes of K and V one page takes in every paged layer (the global ones with rings)."""
    dtype = storage_dtype(config.dtype if dtype is None else dtype)
    ring = RingLayout.of(config, config.max_seq_len)
    layers = config.n_layers if ring is None else ring.n_global
    if config.mla is not None:  # one [latent, rope key] entry a token a layer
        return layers * page_size * config.mla.entry_dim * dtype.itemsize
    h = kv_quant.stored_head_dim(config.head_dim, dtype)
    return 2 * layers * page_size * config.n_kv_heads * h * dtype.itemsize


def ring_bytes(config: ModelConfig, slots: int, dtype: jnp.dtype | str | None = None) -> int:
    """Bytes of K and V of the local layers' rings of ``slots`` slots (0 without rings)."""
    dtype = storage_dtype(config.dtype if dtype is None else dtype)
    return kv_ring.ring_bytes(config, slots, dtype, RingLayout.of(config, config.max_seq_len))


@flax.struct.dataclass
class PagedKVCache:
    """Keys and values of every layer in pages, and the page table of the rows of one call.

    Attributes:
      k, v: [L, K, P, page_size, H] key (rotated) and value pages; tuples of L [K, ...] for
        an unrolled model.
      page_table: [B, W] int32 pages of each row in position order (``NULL_PAGE`` where a row
        holds none).
      lengths: [B] int32 positions written per row (the model sets them after a chunk).
      k_ring, v_ring: None, or the local layers' rings [L_local, S, K, W, H] (or tuples).
      ring_rows: None (row b uses ring row b), or [B] int32 each row's ring row.
      ring_end: None, or [B] int32: a row's rings take no position at or past it.
      view: static; how ``attend`` reads the pages (one of ``VIEWS``).
      block_positions: static; positions per block of the ``"blocks"`` view.
    """

    k: jax.Array | tuple[jax.Array, ...]
    v: jax.Array | tuple[jax.Array, ...]
    page_table: jax.Array
    lengths: jax.Array
    k_ring: jax.Array | tuple[jax.Array, ...] | None = None
    v_ring: jax.Array | tuple[jax.Array, ...] | None = None
    ring_rows: jax.Array | None = None
    ring_end: jax.Array | None = None
    view: str = flax.struct.field(pytree_node=False, default="auto")
    block_positions: int = flax.struct.field(pytree_node=False, default=BLOCK_POSITIONS)
    ring: RingLayout | None = flax.struct.field(pytree_node=False, default=None)

    @classmethod
    def init(cls, config: ModelConfig, num_pages: int, page_size: int, batch: int = 1,
             pages_per_row: int = 1, dtype: jnp.dtype | str | None = None,
             view: str = "auto", *, slots: int | None = None,
             window_rings: bool = True) -> PagedKVCache:
        """Zeroed pages and an all-null page table.

        Args:
          config: the model's config.
          num_pages: P, pages per layer (page 0, the null page, included).
          page_size: positions per page.
          batch, pages_per_row: B rows and W columns of the initial page table.
          dtype: storage dtype (a float dtype, or ``"int8"``); the model's dtype by default.
          view: how ``attend`` reads the pages.
          slots: S, ring rows of the local layers (default ``batch``).
          window_rings: local layers keep rings (when W < ``max_seq_len``) instead of pages.

        Raises:
          ValueError: for a size out of range, an unknown view or storage dtype, naming it.
        """
        check_pageable(config, dtype)
        check_sizes(view, num_pages=num_pages, page_size=page_size, batch=batch,
                    pages_per_row=pages_per_row)
        dtype = storage_dtype(config.dtype if dtype is None else dtype)
        kv, h = config.n_kv_heads, kv_quant.stored_head_dim(config.head_dim, dtype)
        shape = (kv, num_pages, page_size, h)
        ring = RingLayout.of(config, config.max_seq_len) if window_rings else None

        def arrays(n: int, shape: tuple[int, ...], v_width: int | None = None) -> tuple:
            v_shape = shape if v_width is None else (*shape[:-1], v_width)
            if config.scan_layers:
                return jnp.zeros((n, *shape), dtype), jnp.zeros((n, *v_shape), dtype)
            return (tuple(jnp.zeros(shape, dtype) for _ in range(n)),
                    tuple(jnp.zeros(v_shape, dtype) for _ in range(n)))

        if config.mla is not None:  # entry pages as keys of one head, no values
            k, v = arrays(config.n_layers, (1, num_pages, page_size, config.mla.entry_dim), 0)
            return cls(k=k, v=v, page_table=jnp.zeros((batch, pages_per_row), jnp.int32),
                       lengths=jnp.zeros((batch,), jnp.int32), view=view)
        k, v = arrays(config.n_layers if ring is None else ring.n_global, shape)
        rings = {}
        if ring is not None:
            rows, w = (batch if slots is None else slots, kv), ring.size
            rings["k_ring"], rings["v_ring"] = arrays(ring.n_local, (*rows, w, h))
        return cls(k=k, v=v, page_table=jnp.zeros((batch, pages_per_row), jnp.int32),
                   lengths=jnp.zeros((batch,), jnp.int32), view=view, ring=ring, **rings)

    @property
    def stacked(self) -> bool:
        """Whether the layers are one [L, ...] array (a scanned model) or a tuple."""
        return not isinstance(self.v if self.ring is None else self.v_ring, tuple)

    @property
    def num_pages(self) -> int:
        return self.v.shape[2] if self.stacked else self.v[0].shape[1]

    @property
    def page_size(self) -> int:
        return self.v.shape[3] if self.stacked else self.v[0].shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes of the key and value pages and rings."""
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(
            (self.k, self.v, self.k_ring, self.v_ring)))

    def with_table(self, page_table: jax.Array, lengths: jax.Array) -> PagedKVCache:
        """The same pages seen through another page table [B, W] and lengths [B]."""
        return self.replace(page_table=jnp.asarray(page_table, jnp.int32),
                            lengths=jnp.asarray(lengths, jnp.int32))

    def layer(self, i: int | jax.Array, table: jax.Array | None = None, *,
              keys_only: bool = False) -> tuple[jax.Array, jax.Array | None]:
        """Layer i's keys and values of every row, gathered through the page table.

        Args:
          i: the layer.
          table: optional [R, n] pages to gather instead of ``page_table``.
          keys_only: gather the keys only (values None): latent layers' entry pages.

        Returns:
          ([R, K, n * page_size, H] keys, the same of values): slot s of row r holds the
          position s of its pages.
        """
        table = self.page_table if table is None else table
        b = table.shape[0]
        flat = table.reshape(-1)
        kv = (self.v if self.stacked else self.v[0]).shape[-4]  # K (H: each pool's own)
        if self.stacked:
            # One gather from the stack (slicing layer i out first copies its whole pool).
            def rows(pool: jax.Array) -> jax.Array:  # -> [B, K, W * ps, H]
                h = pool.shape[-1]
                taken = pool.reshape(*pool.shape[:3], -1)[i, :, flat]  # [B * W, K, ps * H]
                return taken.reshape(b, -1, kv, pool.shape[3], h).transpose(
                    0, 2, 1, 3, 4).reshape(b, kv, -1, h)

            return rows(self.k), None if keys_only else rows(self.v)
        # Whole pages taken along the pool axis ([K, P, ps * H] -> [K, B * W, ps * H]), then B
        # to the front: 2-3x faster on XLA:CPU than indexing the pool with the [B, W] table.
        def rows_of(pool: jax.Array) -> jax.Array:  # [K, P, ps, H] -> [B, K, W * ps, H]
            taken = jnp.take(pool.reshape(kv, pool.shape[1], -1), flat, axis=1, mode="clip")
            return taken.reshape(kv, b, -1, pool.shape[-1]).swapaxes(0, 1)  # (all in range)

        return rows_of(self.k[i]), None if keys_only else rows_of(self.v[i])

    def attend(self, i: int | jax.Array | LayerRef, q: jax.Array, k: jax.Array, v: jax.Array,
               positions: jax.Array, *, window: int | jax.Array | None, impl: str,
               scale: float | None = None, softcap: float | None = None,
               sinks: jax.Array | None = None, chunk: int | None = None
               ) -> tuple[jax.Array, PagedKVCache]:
        """Layer i's attention with this cache: writes the chunk into the rows' pages, then
        attends the queries over them (the ``Cache`` interface).

        Args:
          i: the layer: its number, or a scanned block's ``LayerRef``.
          q: [B, T, N, H] queries (rotated).
          k, v: [B, T, K, H] new keys (rotated) and values for ``positions``.
          positions: [B, T] int positions of the chunk (consecutive per row).
          window, impl, scale, softcap, sinks, chunk: as ``ops.attention.attention``'s.

        Returns:
          ([B, T, N, H] attention output, the cache with layer i's pages written).
        """
        logits = dict(impl=impl, scale=scale, softcap=softcap, sinks=sinks)
        ring, j = kv_ring.locate(self.ring, i)
        if not ring:
            cache = self.write(j, k, v, positions)
            if chunk is None:
                return cache._attend_pages(j, q, positions, window, **logits), cache
            # no kernel or view masks chunks: the rows' pages gathered
            keys, values = cache._dequantized(*cache.layer(j), q.dtype)
            return attention(q.astype(keys.dtype), keys, values, q_positions=positions,
                             chunk=chunk, **dict(logits, impl="xla" if impl == "pallas"
                                                 else impl)), cache
        # The rings take the reference implementations (the paged kernels read pages).
        return kv_ring.attend(
            self, j, self.ring, q, k, v, positions,
            read_ring=lambda c, j: c._ring_layer(j),
            write_ring=lambda c, j: c._write_ring(j, k, v, positions), chunk=chunk,
            **dict(logits, impl="xla" if impl == "pallas" else impl))

    def attend_latent(self, i: int | jax.Array | LayerRef, entries: jax.Array,
                      positions: jax.Array) -> tuple[jax.Array, PagedKVCache]:
        """Latent layer i: writes the chunk's entries [B, T, R + P] into the rows' pages;
        returns the rows' pages gathered, [B, W * page_size, R + P], and the cache."""
        _, j = kv_ring.locate(None, i)
        b, t = entries.shape[:2]
        cache = self.write(j, entries[:, :, None], jnp.zeros((b, t, 1, 0), entries.dtype),
                           positions)
        return cache.layer(j, keys_only=True)[0][:, 0], cache

    def _attend_pages(self, i: int | jax.Array, q: jax.Array, positions: jax.Array,
                      window: int | jax.Array | None, *, impl: str, scale: float | None,
                      softcap: float | None, sinks: jax.Array | None = None) -> jax.Array:
        """The queries over the rows' pages of paged layer i (already written)."""
        if sinks is not None:
            keys, values = self._dequantized(*self.layer(i), q.dtype)
            return attention(q.astype(keys.dtype), keys, values, q_positions=positions,
                             window=window, impl="xla" if impl == "pallas" else impl,
                             scale=scale, softcap=softcap, sinks=sinks)
        logits = dict(scale=scale, softcap=softcap)
        # The paged kernels read float pages, and take no scale, soft-cap or traced window.
        plain = scale is None and softcap is None and not isinstance(window, jax.Array)
        if self.view == "auto" and not self.int8 and (plain or impl != "pallas"):
            route = paged_attention.plan(impl, q.shape[1], window, q.shape[-1])
            if route.kernel is not None:
                return paged_attention.paged_attention(
                    route.kernel, q, self.k[i], self.v[i], self.page_table, positions,
                    window=window)
            impl = route.impl
        if impl == "pallas":  # a config the paged kernels cannot run: the reference views
            impl = "xla"
        read = self.read_view(q, impl)
        if read == "pool":
            return paged_views.attend_pool(self, i, q, positions, window, **logits)
        if read == "blocks":
            return paged_views.attend_blocks(self, i, q, positions, window, **logits)
        keys, values = self._dequantized(*self.layer(i), q.dtype)  # [B, K, S, H] each
        return attention(q.astype(keys.dtype), keys, values, q_positions=positions,
                         window=window, impl=impl, **logits)

    def _write_ring(self, j: int | jax.Array, k: jax.Array, v: jax.Array,
                    positions: jax.Array) -> PagedKVCache:
        """Writes each row's last W positions (below ``ring_end``) into its row of ring j."""
        k_ring, v_ring = kv_ring.write_rings(
            self.k_ring, self.v_ring, j, k, v, positions, rows=self.ring_rows,
            end=self.ring_end)
        return self.replace(k_ring=k_ring, v_ring=v_ring)

    def _ring_layer(self, j: int | jax.Array) -> tuple[jax.Array, jax.Array]:
        """Ring j's rows of this call's rows: [B, K, W, H] keys and values."""
        keys, values = self.k_ring[j], self.v_ring[j]
        if self.ring_rows is None:
            return keys, values
        return keys[self.ring_rows], values[self.ring_rows]

    @property
    def int8(self) -> bool:
        """Whether pages hold int8 rows with their scales (``ops.kv_quant``)."""
        v = self.v if self.ring is None else self.v_ring
        return kv_quant.is_int8((v if self.stacked else v[0]).dtype)

    def _dequantized(self, keys: jax.Array, values: jax.Array, dtype: jnp.dtype
                     ) -> tuple[jax.Array, jax.Array]:
        """Keys and values read from int8 pages, in float ``dtype``; float ones as they are."""
        if not self.int8:
            return keys, values
        return kv_quant.decode(keys, dtype), kv_quant.decode(values, dtype)

    def pool(self, i: int | jax.Array, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
        """Layer i's whole pool, [K, P, ps, H] keys and values, dequantised into ``dtype``."""
        return self._dequantized(self.k[i], self.v[i], dtype)

    def read_view(self, q: jax.Array, impl: str) -> str:
        """How ``attend`` reads the pages for queries q [B, T, N, H]: ``"gather"``, ``"pool"``
        or ``"blocks"`` (``view``, or the ``"auto"`` rule of the module docstring)."""
        if self.view != "auto":
            return self.view
        if q.shape[1] != 1 or not (
                impl == "xla" or (impl == "auto" and choose_impl(q, q[:, :, :1]) == "xla")):
            return "gather"
        if target.platform() == "cpu":
            return "blocks"
        b, w = self.page_table.shape
        return "pool" if self.num_pages < 2 * b * w else "gather"

    def write(self, i: int | jax.Array, k: jax.Array, v: jax.Array,
              positions: jax.Array) -> PagedKVCache:
        """Writes each row's new keys/values at their positions into its pages (positions
        past the table's W columns or in pages the row does not hold go to ``NULL_PAGE``).

        Args:
          i: the paged layer (its index among the layers with pages).
          k, v: [B, T, K, H] new keys and values.
          positions: [B, T] int positions.

        Returns:
          The cache with layer i updated (lengths unchanged: the model sets them).
        """
        if self.int8:
            k, v = kv_quant.encode(k), kv_quant.encode(v)
        pages, offsets = self.slots(positions)
        index = (slice(None), pages, offsets)
        if self.stacked:
            # Advanced indices apart: [B, T] leads, the updates are [B, T, K, H] as they are.
            return self.replace(k=self.k.at[(i, *index)].set(k.astype(self.k.dtype)),
                                v=self.v.at[(i, *index)].set(v.astype(self.v.dtype)))
        # Adjacent advanced indices stay in place: the updates are [K, B, T, H].
        new_k, new_v = list(self.k), list(self.v)
        new_k[i] = self.k[i].at[index].set(k.transpose(2, 0, 1, 3).astype(self.k[i].dtype))
        new_v[i] = self.v[i].at[index].set(v.transpose(2, 0, 1, 3).astype(self.v[i].dtype))
        return self.replace(k=tuple(new_k), v=tuple(new_v))

    def slots(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """([B, T] page, [B, T] offset) where each row's positions are stored."""
        ps = self.page_size
        w = self.page_table.shape[1]
        index = positions // ps
        inside = (index >= 0) & (index < w)
        page = jnp.take_along_axis(self.page_table, jnp.clip(index, 0, w - 1), axis=1)
        return jnp.where(inside, page, NULL_PAGE), positions % ps
