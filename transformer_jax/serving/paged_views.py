"""The paged cache's XLA views that read the pages in place: ``"pool"`` and ``"blocks"``.

Both read layer i of ``cache`` (a ``PagedKVCache``, typed ``Any``: ``paged_cache`` imports this
module) through its page table and return the queries' attention output.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from transformer_jax.model.ops import softcap as ops_softcap
from transformer_jax.model.ops.attention import attention_mask, reference_attention
from transformer_jax.model.ops.chunked_attention import (
    einsum_f32,
    online_softmax_init,
    online_softmax_merge,
    online_softmax_result,
    online_softmax_step,
)
from transformer_jax.serving.page_pool import NULL_PAGE


def attend_pool(cache: Any, i: int | jax.Array, q: jax.Array, positions: jax.Array,
                window: int | jax.Array | None, *, scale: float | None = None,
                softcap: float | None = None) -> jax.Array:
    """Every row's queries against the whole pool of layer i, each seeing only the slots
    of its own pages at positions up to its own (``"pool"`` view)."""
    b, t, n, h = q.shape
    k_pool, v_pool = cache.pool(i, q.dtype)
    kv, p, ps = v_pool.shape[0], v_pool.shape[1], v_pool.shape[2]
    # owner[b, page]: the page's index in row b's table, -1 for pages b does not hold (the
    # null page included: nobody holds it).
    table = cache.page_table
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
    out = reference_attention(q.astype(v_pool.dtype).reshape(1, b * t, n, h),
                              k_pool.reshape(1, kv, p * ps, h), v_pool.reshape(1, kv, p * ps, h),
                              mask.reshape(1, b * t, p * ps), scale, softcap=softcap)
    return out.reshape(b, t, n, h)


def attend_blocks(cache: Any, i: int | jax.Array, q: jax.Array, positions: jax.Array,
                  window: int | jax.Array | None, *, scale: float | None = None,
                  softcap: float | None = None) -> jax.Array:
    """Every row's queries over its own pages of layer i, a block of pages at a time
    (``"blocks"`` view).

    Block j of a row holds its positions [j * bk, (j + 1) * bk). The (row, block) items each
    row's queries see are taken B at a time in a loop that stops after the last, so a short row
    costs its own blocks; each gives a partial softmax, merged per row at the end.
    """
    b, t, n, h = q.shape
    v_pool = cache.v[i]  # [K, P, ps, H]
    kv, ps = v_pool.shape[0], v_pool.shape[2]
    g = n // kv
    per_block = max(1, cache.block_positions // ps)
    bk = per_block * ps
    num_blocks = -(-cache.page_table.shape[1] // per_block)
    table = jnp.pad(cache.page_table,
                    ((0, 0), (0, num_blocks * per_block - cache.page_table.shape[1])),
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
    dtype = q.dtype if cache.int8 else v_pool.dtype
    qg = q.astype(dtype).reshape(b, t, kv, g, h).transpose(0, 2, 3, 1, 4).reshape(
        b, kv, g * t, h)

    def items(carry):
        step, partials = carry
        at = step * b
        own = jax.lax.dynamic_slice_in_dim(owner, at, b)
        blocks = jax.lax.dynamic_slice_in_dim(block_of, at, b)
        # The items' pages, [B, per_block] -> [B, K, bk, H] keys and values.
        keys, values = cache.layer(i, table[own[:, None], blocks[:, None] * per_block
                                            + jnp.arange(per_block)])
        keys, values = cache._dequantized(keys, values, q.dtype)
        # Batch axes (item, kv head), [G * T, H] queries each: a split of K stays put.
        logits = einsum_f32("BKQH,BKSH->BKQS", qg[own], keys) * (
            h ** -0.5 if scale is None else scale)
        if softcap is not None:
            logits = ops_softcap(logits, softcap)
        k_pos = blocks[:, None] * bk + jnp.arange(bk, dtype=jnp.int32)  # [B, bk]
        mask = attention_mask(positions[own], k_pos, window=window)  # [B, T, bk]
        mask &= jax.lax.dynamic_slice_in_dim(live, at, b)[:, None, None]
        logits = jnp.where(mask[:, None, None], logits.reshape(b, kv, g, t, bk), -jnp.inf)
        part = online_softmax_step(online_softmax_init((b, kv, g * t), h),
                                   logits.reshape(b, kv, g * t, bk), values)
        partials = tuple(jax.lax.dynamic_update_slice_in_dim(whole, x, at, 0)
                         for whole, x in zip(partials, part, strict=True))
        return step + 1, partials

    _, partials = jax.lax.while_loop(
        lambda carry: carry[0] * b < ends[-1], items,
        (jnp.int32(0), online_softmax_init((capacity, kv, g * t), h)))
    # Item u's partials [K, G * T, H] belong to row owner[u]. Items the loop did not reach keep
    # the empty carry, which the merge weighs 0.
    out, _ = online_softmax_result(online_softmax_merge(partials, owner, b), q.dtype)
    return out.reshape(b, kv, g, t, h).transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)
