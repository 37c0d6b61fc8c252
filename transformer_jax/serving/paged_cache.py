"""The paged KV cache: a second implementation of the model's ``Cache`` interface.

Each layer's keys and values live in a pool of P fixed-size pages, kv head first:
[K, P, page_size, H] (keys [K, H, P, page_size] with ``keys_transposed``, the layout ``KVCache``
takes on CPU; the pages keep [page_size, H] by default on every backend, because gathering
whole pages is what costs here: see ``layer``), so each kv head's whole pool is one contiguous
[P * page_size, H] row. The
layers are stacked ([L, ...]) for a scanned model and a tuple for an unrolled one, as in
``KVCache``. A sequence holds only the pages it has filled: row b of the page table [B, W]
lists its pages in position order, so position p of row b lives in page
``page_table[b, p // page_size]`` at offset ``p % page_size``.

``attend`` writes the chunk's keys/values into the row's pages at their positions, then attends
through one of three views, each reading the pages with XLA ops:

- ``"gather"`` (the reference, every ``attention_impl``): the row's W pages gathered into a
  contiguous [B, K, W * page_size, H] view, in which slot s holds position s exactly as in
  ``KVCache``, and ``ops.attention.attention`` with the usual structural (position) mask; the
  sliding window works unchanged, and slots past a row's length (stale pages, the null page)
  are hidden by causality.
- ``"pool"``: the queries of all rows against the whole pool, read once in place
  (``ops.attention.reference_attention``), each row seeing only the pool slots of its own pages
  at positions up to its own: no gathered copy, and the pool is read once for all rows rather
  than once per row.
- ``"blocks"``: each row's own pages, a block of ``block_positions`` positions at a time: the
  (row, block) pairs each row needs, up to its own furthest query (from the first block its
  queries see, with a sliding window), go through a loop B pairs at a time, each a partial
  online softmax (``ops.chunked_attention``'s recurrence), merged per row at the end. No
  gathered copy of the whole width, and a row costs its own length, not the longest row's.

``"auto"`` takes ``"blocks"`` for one-token chunks (decode rows) with the reference
implementation on CPU; elsewhere it takes ``"pool"`` for them when the pool is under twice the
gathered view (P < 2 * B * W: the gather writes its view, then attention reads it), and
``"gather"`` for every other chunk. Measured on XLA:CPU, decode_25m, float32, pages of 16, the
serving benchmark's 200 requests (inputs 16-512, outputs 16-256), against the previous rule
(``"pool"`` there) in one session: 16 slots 350.4 against 203.8 output tokens/s (time per output
token 42.6 against 71.9 ms), 8 slots 295.0 against 252.8. One step at a width of 64 pages, rows
of 16 up to 300 / 700 / 1000 positions: 16 rows 27.2 / 36.2 / 41.6 ms, against 29.0 / 46.0 /
60.0 for one loop over blocks of all rows up to the longest; in another run, rows of a third up
to all of 300 / 500 / 700 positions, ``"pool"`` (770 pages) took 63-64 ms and ``"gather"``
99-111 ms. The pool view's cost grows with rows x pool, the blocks' with what the rows hold. On
a GPU a loop of small gathers costs a kernel launch and a host round trip per iteration, so
accelerators keep the earlier rule, unmeasured (their fast path is the Pallas kernels below).

With ``view="auto"`` and ``attention_impl="pallas"`` on a GPU or TPU, ``attend`` reads the pages
with JAX's Pallas paged kernels instead (``ops/paged_attention.py``: decode, and on TPU prefill
chunks); an explicit ``"gather"``, ``"pool"`` or ``"blocks"`` view always reads them with XLA.

Page 0 is the null page: never handed out by ``PagePool``, it takes the writes that belong to no
page (rows not in use, a padded chunk's tail past the pages the table lists), and table entries
of pages a row does not hold point at it.

The page table and lengths are host-built per step (``with_table``): the engine owns which
pages a sequence holds; the cache owns only their contents.

int8 pages (``dtype="int8"``) hold each token's row as its int8 values and its scale, H + 2
bytes (``ops.kv_quant``), as ``KVCache`` does; both views dequantise what they read (the
Pallas paged kernels read float pages, so int8 pages always take these views).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from transformer_jax.model.config import ModelConfig
from transformer_jax.model.ops import kv_quant, paged_attention
from transformer_jax.model.ops.attention import (
    attention,
    attention_mask,
    choose_impl,
    reference_attention,
)
from transformer_jax.model.ops.chunked_attention import (
    einsum_f32,
    online_softmax_init,
    online_softmax_merge,
    online_softmax_result,
    online_softmax_step,
)
from transformer_jax.serving.page_pool import NULL_PAGE

VIEWS = ("auto", "gather", "pool", "blocks")
#: Positions per key block of the ``"blocks"`` view (``max(1, BLOCK_POSITIONS // page_size)``
#: pages). On XLA:CPU blocks of 32-64 positions ran fastest (decode_25m, 16 rows of up to 500
#: positions, pages of 16, one loop over every row's blocks, whole step: 32.6 / 33.5 / 39.6 /
#: 51.6 ms at 32 / 64 / 128 / 256).
BLOCK_POSITIONS = 64


def storage_dtype(dtype: jnp.dtype | str) -> jnp.dtype:
    """A cache's storage dtype: a floating dtype, or int8 (``ops.kv_quant``'s encoding).

    Raises:
      ValueError: naming ``cache_dtype`` and what it accepts, for anything else.
    """
    try:
        dt = jnp.dtype(dtype)
    except (TypeError, ValueError):
        dt = None
    if dt is None or not (jnp.issubdtype(dt, jnp.floating) or kv_quant.is_int8(dt)):
        raise ValueError(f"cache_dtype must be a floating dtype name (e.g. 'bfloat16', "
                         f"'float32') or {kv_quant.INT8!r}, got {dtype!r}")
    return dt


@flax.struct.dataclass
class PagedKVCache:
    """Keys and values of every layer in pages, and the page table of the rows of one call.

    Attributes:
      k: [L, K, P, page_size, H] key pages (rotated by RoPE), [L, K, H, P, page_size] when
        ``keys_transposed``; for an unrolled model a tuple of L arrays [K, ...].
      v: [L, K, P, page_size, H] value pages (a tuple of L [K, P, page_size, H] when unrolled).
      page_table: [B, W] int32 pages of each row in position order (``NULL_PAGE`` where a row
        holds none).
      lengths: [B] int32 positions written per row (the model sets them after a chunk).
      keys_transposed: static; the keys' layout.
      view: static; how ``attend`` reads the pages (one of ``VIEWS``, see the module
        docstring).
      block_positions: static; positions per block of the ``"blocks"`` view (whole pages: at
        least one).
    """

    k: jax.Array | tuple[jax.Array, ...]
    v: jax.Array | tuple[jax.Array, ...]
    page_table: jax.Array
    lengths: jax.Array
    keys_transposed: bool = flax.struct.field(pytree_node=False, default=False)
    view: str = flax.struct.field(pytree_node=False, default="auto")
    block_positions: int = flax.struct.field(pytree_node=False, default=BLOCK_POSITIONS)

    @classmethod
    def init(cls, config: ModelConfig, num_pages: int, page_size: int, batch: int = 1,
             pages_per_row: int = 1, dtype: jnp.dtype | str | None = None,
             keys_transposed: bool = False, view: str = "auto") -> PagedKVCache:
        """Zeroed pages and an all-null page table.

        Args:
          config: the model's config (gives L, K, H and the layer layout).
          num_pages: P, pages per layer (page 0 included, see ``NULL_PAGE``).
          page_size: positions per page.
          batch: B rows of the initial page table.
          pages_per_row: W columns of the initial page table.
          dtype: storage dtype (a float dtype, or ``"int8"``, ``ops.kv_quant``); the model's
            compute dtype by default.
          keys_transposed: store keys [K, H, P, page_size]. Off by default: on XLA:CPU the
            gather of transposed pages (slices of page_size) ran about 2x slower than that of
            whole [page_size, H] pages, more than the faster [H, S] product gained back
            (decode_25m's layer, 8 rows of 32 pages of 16, float32: 5.2 against 2.5 ms).
          view: how ``attend`` reads the pages.

        Raises:
          ValueError: for a size out of range, a view not in ``VIEWS`` or a storage dtype that
            is neither floating nor int8, naming it.
        """
        for name, value in (("num_pages", num_pages), ("page_size", page_size),
                            ("batch", batch), ("pages_per_row", pages_per_row)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if num_pages < 2:
            raise ValueError(f"num_pages must be at least 2 (page 0 is the null page), got "
                             f"{num_pages}")
        if view not in VIEWS:
            raise ValueError(f"view must be one of {VIEWS}, got {view!r}")
        dtype = storage_dtype(config.dtype if dtype is None else dtype)
        kv, h = config.n_kv_heads, kv_quant.stored_head_dim(config.head_dim, dtype)
        k_shape = (kv, h, num_pages, page_size) if keys_transposed else (
            kv, num_pages, page_size, h)
        v_shape = (kv, num_pages, page_size, h)
        if config.scan_layers:
            k = jnp.zeros((config.n_layers, *k_shape), dtype)
            v = jnp.zeros((config.n_layers, *v_shape), dtype)
        else:
            k = tuple(jnp.zeros(k_shape, dtype) for _ in range(config.n_layers))
            v = tuple(jnp.zeros(v_shape, dtype) for _ in range(config.n_layers))
        return cls(k=k, v=v, page_table=jnp.zeros((batch, pages_per_row), jnp.int32),
                   lengths=jnp.zeros((batch,), jnp.int32), keys_transposed=keys_transposed,
                   view=view)

    @property
    def stacked(self) -> bool:
        """Whether the layers are one [L, ...] array (a scanned model) or a tuple."""
        return not isinstance(self.v, tuple)

    @property
    def num_pages(self) -> int:
        return self.v.shape[2] if self.stacked else self.v[0].shape[1]

    @property
    def page_size(self) -> int:
        return self.v.shape[3] if self.stacked else self.v[0].shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes of the key and value pages: ``2 * L * P * page_size * K * H * itemsize``."""
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((self.k, self.v)))

    def with_table(self, page_table: jax.Array, lengths: jax.Array) -> PagedKVCache:
        """The same pages seen through another page table [B, W] and lengths [B]."""
        return self.replace(page_table=jnp.asarray(page_table, jnp.int32),
                            lengths=jnp.asarray(lengths, jnp.int32))

    def layer(self, i: int | jax.Array, table: jax.Array | None = None
              ) -> tuple[jax.Array, jax.Array]:
        """Layer i's keys and values of every row, gathered through the page table.

        Args:
          i: the layer.
          table: optional [R, n] pages to gather instead of ``page_table`` (the blocks view
            gathers a block of pages per item).

        Returns:
          ([R, K, n * page_size, H] keys ([R, K, H, n * page_size] when transposed),
          [R, K, n * page_size, H] values): slot s of row r holds the position s of its pages.
        """
        table = self.page_table if table is None else table
        b = table.shape[0]
        flat = table.reshape(-1)
        k_pool, v_pool = self.k[i], self.v[i]  # [K, P, ps, H] (keys [K, H, P, ps])
        kv, h = v_pool.shape[0], v_pool.shape[-1]
        # Whole pages taken along the pool axis ([K, P, ps * H] -> [K, B * W, ps * H]), then B
        # to the front. On XLA:CPU this ran 2-3x faster than indexing the pool with the
        # [B, W] table (decode_25m's layer, 8 rows of 32 pages of 16, float32: about 1
        # against 2.4 ms; 8 ms with the keys transposed).
        def pages(pool: jax.Array, axis: int) -> jax.Array:  # the table's pages, in order
            return jnp.take(pool, flat, axis=axis, mode="clip")  # (every index is in range)

        values = pages(v_pool.reshape(kv, v_pool.shape[1], -1), 1)
        values = values.reshape(kv, b, -1, h).swapaxes(0, 1)
        if self.keys_transposed:  # [K, H, P, ps] -> [K, H, B * W, ps] -> [B, K, H, S]
            keys = pages(k_pool, 2).reshape(kv, h, b, -1).transpose(2, 0, 1, 3)
        else:
            keys = pages(k_pool.reshape(kv, k_pool.shape[1], -1), 1)
            keys = keys.reshape(kv, b, -1, h).swapaxes(0, 1)
        return keys, values

    def attend(self, i: int | jax.Array, q: jax.Array, k: jax.Array, v: jax.Array,
               positions: jax.Array, *, window: int | None, impl: str
               ) -> tuple[jax.Array, PagedKVCache]:
        """Layer i's attention with this cache: writes the chunk into the rows' pages, then
        attends the queries over the rows' pages (the ``Cache`` interface).

        Args:
          i: the layer (a Python int, or a traced index inside a layer scan).
          q: [B, T, N, H] queries (rotated).
          k: [B, T, K, H] new keys (rotated) for ``positions``.
          v: [B, T, K, H] new values.
          positions: [B, T] int positions of the chunk (consecutive per row).
          window: optional sliding window length.
          impl: the attention implementation (``ops.attention.attention``).

        Returns:
          ([B, T, N, H] attention output, the cache with layer i's pages written).
        """
        cache = self.write(i, k, v, positions)
        # impl="pallas": a paged kernel (ops/paged_attention.py); they read float pages, so
        # int8 pages take the dequantising views.
        if self.view == "auto" and not self.int8:
            route = paged_attention.plan(impl, q.shape[1], window)
            if route.kernel is not None:
                out = paged_attention.paged_attention(
                    route.kernel, q, cache.k[i], cache.v[i], cache.page_table, positions,
                    window=window, keys_transposed=self.keys_transposed)
                return out, cache
            impl = route.impl
        read = cache.read_view(q, impl)
        if read == "pool":
            return cache._attend_pool(i, q, positions, window), cache
        if read == "blocks":
            return cache._attend_blocks(i, q, positions, window), cache
        # Gathered keys are [B, K, S, H] or [B, K, H, S].
        keys, values = cache._dequantized(*cache.layer(i), q.dtype,
                                          key_axis=-2 if self.keys_transposed else -1)
        out = attention(q.astype(keys.dtype), keys, values, q_positions=positions,
                        window=window, impl=impl, keys_transposed=self.keys_transposed)
        return out, cache

    @property
    def int8(self) -> bool:
        """Whether pages hold int8 rows with their scales (``ops.kv_quant``)."""
        return kv_quant.is_int8((self.v if self.stacked else self.v[0]).dtype)

    def _dequantized(self, keys: jax.Array, values: jax.Array, dtype: jnp.dtype, *,
                     key_axis: int) -> tuple[jax.Array, jax.Array]:
        """Keys (head axis ``key_axis``) and values (head axis last) read from int8 pages, in
        float ``dtype``; float pages as they are."""
        if not self.int8:
            return keys, values
        return kv_quant.decode(keys, dtype, axis=key_axis), kv_quant.decode(values, dtype)

    def pool(self, i: int | jax.Array, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
        """Layer i's whole pool in place, as the ``"pool"`` view reads it: [K, P, ps, H] keys
        ([K, H, P, ps] when transposed) and [K, P, ps, H] values, int8 pages dequantised
        (each token with its own scale) into ``dtype``; float pages as they are."""
        return self._dequantized(self.k[i], self.v[i], dtype,
                                 key_axis=1 if self.keys_transposed else -1)

    def read_view(self, q: jax.Array, impl: str) -> str:
        """How ``attend`` reads the pages for queries q [B, T, N, H]: ``"gather"``, ``"pool"``
        or ``"blocks"`` (``view``, or the ``"auto"`` rule of the module docstring)."""
        if self.view != "auto":
            return self.view
        if q.shape[1] != 1 or not (
                impl == "xla" or (impl == "auto" and choose_impl(q, q[:, :, :1]) == "xla")):
            return "gather"
        if jax.default_backend() == "cpu":
            return "blocks"
        b, w = self.page_table.shape
        return "pool" if self.num_pages < 2 * b * w else "gather"

    def _attend_pool(self, i: int | jax.Array, q: jax.Array, positions: jax.Array,
                     window: int | None) -> jax.Array:
        """Every row's queries against the whole pool of layer i, each seeing only the slots
        of its own pages at positions up to its own (``"pool"`` view)."""
        b, t, n, h = q.shape
        k_pool, v_pool = self.pool(i, q.dtype)
        kv, p, ps = v_pool.shape[0], v_pool.shape[1], v_pool.shape[2]
        # owner[b, page]: the page's index in row b's table, -1 for pages b does not hold (the
        # null page included: nobody holds it).
        table = self.page_table
        rows = jnp.broadcast_to(jnp.arange(b)[:, None], table.shape)
        index = jnp.broadcast_to(jnp.arange(table.shape[1], dtype=jnp.int32), table.shape)
        owner = jnp.full((b, p), -1, jnp.int32).at[rows, table].max(
            jnp.where(table == NULL_PAGE, -1, index))
        k_pos = owner[:, :, None] * ps + jnp.arange(ps, dtype=jnp.int32)  # [B, P, ps]
        k_pos = jnp.where(owner[:, :, None] >= 0, k_pos, jnp.iinfo(jnp.int32).max)
        q_pos = positions[:, :, None, None]  # [B, T, 1, 1]
        mask = k_pos[:, None] <= q_pos  # [B, T, P, ps]: the row's own slots, causally
        if window is not None:
            mask &= k_pos[:, None] > q_pos - window
        keys = k_pool.reshape(1, kv, h, p * ps) if self.keys_transposed else \
            k_pool.reshape(1, kv, p * ps, h)
        out = reference_attention(q.astype(v_pool.dtype).reshape(1, b * t, n, h), keys,
                                  v_pool.reshape(1, kv, p * ps, h),
                                  mask.reshape(1, b * t, p * ps),
                                  keys_transposed=self.keys_transposed)
        return out.reshape(b, t, n, h)

    def _attend_blocks(self, i: int | jax.Array, q: jax.Array, positions: jax.Array,
                       window: int | None) -> jax.Array:
        """Every row's queries over its own pages of layer i, a block of pages at a time
        (``"blocks"`` view).

        Block j of a row holds its positions [j * bk, (j + 1) * bk). Each row needs its blocks
        from the first any of its queries sees (0 without a window) to that of its furthest
        query; these (row, block) items, listed row after row, are taken B at a time in a
        loop that stops after the last, so a short row costs its own blocks, not the longest
        row's. Each item gives a partial softmax (``online_softmax_step`` from the empty
        carry); the partials are merged per row at the end (``online_softmax_merge``).
        """
        b, t, n, h = q.shape
        v_pool = self.v[i]  # [K, P, ps, H]
        kv, ps = v_pool.shape[0], v_pool.shape[2]
        g = n // kv
        per_block = max(1, self.block_positions // ps)
        bk = per_block * ps
        num_blocks = -(-self.page_table.shape[1] // per_block)
        table = jnp.pad(self.page_table,
                        ((0, 0), (0, num_blocks * per_block - self.page_table.shape[1])),
                        constant_values=NULL_PAGE)
        last = jnp.minimum(positions.max(axis=1) // bk, num_blocks - 1)  # [B]
        first = jnp.zeros_like(last) if window is None else jnp.clip(
            (positions.min(axis=1) - window + 1) // bk, 0, last)
        counts = last - first + 1  # [B] items per row
        ends = jnp.cumsum(counts)
        capacity = b * num_blocks  # the most items: every row at the full width
        item = jnp.arange(capacity, dtype=jnp.int32)
        owner = jnp.minimum(jnp.searchsorted(ends, item, side="right"), b - 1)  # [U]
        live = item < ends[-1]  # the items past the last are masked (and kept in range)
        block_of = jnp.where(live, first[owner] + item - (ends - counts)[owner], 0)
        dtype = q.dtype if self.int8 else v_pool.dtype
        qg = q.astype(dtype).reshape(b, t, kv, g, h).transpose(0, 2, 3, 1, 4).reshape(
            b, kv, g * t, h)
        spec = "RQH,RHS->RQS" if self.keys_transposed else "RQH,RSH->RQS"

        def items(carry):
            step, partials = carry
            at = step * b
            own = jax.lax.dynamic_slice_in_dim(owner, at, b)
            blocks = jax.lax.dynamic_slice_in_dim(block_of, at, b)
            # The items' pages, [B, per_block] -> [B, K, bk, H] keys and values.
            keys, values = self.layer(i, table[own[:, None], blocks[:, None] * per_block
                                               + jnp.arange(per_block)])
            keys, values = self._dequantized(keys, values, q.dtype,
                                             key_axis=-2 if self.keys_transposed else -1)
            # One batch axis R = items x K of [G * T, H] queries (faster on XLA:CPU than two).
            logits = einsum_f32(spec, qg[own].reshape(b * kv, g * t, h),
                                keys.reshape(b * kv, *keys.shape[2:])) * h ** -0.5
            k_pos = blocks[:, None] * bk + jnp.arange(bk, dtype=jnp.int32)  # [B, bk]
            mask = attention_mask(positions[own], k_pos, window=window)  # [B, T, bk]
            mask &= jax.lax.dynamic_slice_in_dim(live, at, b)[:, None, None]
            logits = jnp.where(mask[:, None, None], logits.reshape(b, kv, g, t, bk), -jnp.inf)
            part = online_softmax_step(online_softmax_init((b * kv, g * t), h),
                                       logits.reshape(b * kv, g * t, bk),
                                       values.reshape(b * kv, bk, h))
            partials = tuple(jax.lax.dynamic_update_slice_in_dim(whole, x, at * kv, 0)
                             for whole, x in zip(partials, part, strict=True))
            return step + 1, partials

        _, partials = jax.lax.while_loop(
            lambda carry: carry[0] * b < ends[-1], items,
            (jnp.int32(0), online_softmax_init((capacity * kv, g * t), h)))
        # Partial r is item r // K's kv head r % K: row owner * K + head. Items the loop did not
        # reach keep the empty carry, which the merge weighs 0.
        rows = (owner[:, None] * kv + jnp.arange(kv, dtype=jnp.int32)).reshape(-1)
        out, _ = online_softmax_result(online_softmax_merge(partials, rows, b * kv), q.dtype)
        return out.reshape(b, kv, g, t, h).transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)

    def write(self, i: int | jax.Array, k: jax.Array, v: jax.Array,
              positions: jax.Array) -> PagedKVCache:
        """Writes each row's new keys/values at their positions into its pages.

        A position whose page index is past the table's W columns goes to ``NULL_PAGE``, as do
        positions in pages the row does not hold (table entries ``NULL_PAGE``): a padded chunk
        or an unused row writes nowhere that matters.

        Args:
          i: the layer.
          k: [B, T, K, H] new keys.
          v: [B, T, K, H] new values.
          positions: [B, T] int positions.

        Returns:
          The cache with layer i updated (lengths unchanged: the model sets them).
        """
        if self.int8:
            k, v = kv_quant.encode(k), kv_quant.encode(v)
        pages, offsets = self.slots(positions)
        lead = 2 if self.keys_transposed else 1  # the (kv head[, H]) axes before the pages
        index = (*[slice(None)] * lead, pages, offsets)
        v_index = (slice(None), pages, offsets)
        if self.stacked:
            # (layer, :, .., pages, offsets): the advanced indices are apart, so their [B, T]
            # leads and the updates are the chunk's [B, T, K, H] as they are.
            return self.replace(k=self.k.at[(i, *index)].set(k.astype(self.k.dtype)),
                                v=self.v.at[(i, *v_index)].set(v.astype(self.v.dtype)))
        # (:, .., pages, offsets): adjacent advanced indices stay in place, so the updates are
        # [K, B, T, H] (keys transposed: [K, H, B, T]).
        k_new = k.transpose(2, 3, 0, 1) if self.keys_transposed else k.transpose(2, 0, 1, 3)
        new_k, new_v = list(self.k), list(self.v)
        new_k[i] = self.k[i].at[index].set(k_new.astype(self.k[i].dtype))
        new_v[i] = self.v[i].at[v_index].set(v.transpose(2, 0, 1, 3).astype(self.v[i].dtype))
        return self.replace(k=tuple(new_k), v=tuple(new_v))

    def slots(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """([B, T] page, [B, T] offset) where each row's positions are stored."""
        ps = self.page_size
        w = self.page_table.shape[1]
        index = positions // ps
        inside = (index >= 0) & (index < w)
        page = jnp.take_along_axis(self.page_table, jnp.clip(index, 0, w - 1), axis=1)
        return jnp.where(inside, page, NULL_PAGE), positions % ps
