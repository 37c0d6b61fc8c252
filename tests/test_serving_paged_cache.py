"""The paged KV cache: its attention equals the contiguous KVCache's (any page size, lengths,
GQA, sliding window, key layout, attention impl); the page pool and the prefix cache hand out,
share, park and evict pages without losing any."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import keys_in_order
from hypothesis import given, settings
from hypothesis import strategies as st

from transformer_jax.model.config import ModelConfig
from transformer_jax.model.kv_cache import KVCache
from transformer_jax.serving.page_pool import NULL_PAGE, PagePool, pages_for
from transformer_jax.serving.paged_cache import PagedKVCache
from transformer_jax.serving.prefix_cache import PrefixCache, page_digests


def _config(n_heads, n_kv_heads, scan_layers):
    return ModelConfig(vocab_size=16, d_model=8 * n_heads, n_layers=2, n_heads=n_heads,
                       n_kv_heads=n_kv_heads, head_dim=8, d_ff=16, max_seq_len=64,
                       scan_layers=scan_layers)


B, T, S_MAX = 3, 4, 24  # rows, chunk (right-padded), positions per row

#: The structure of a case (compiled once each); the data vary under hypothesis.
STRUCTURES = {
    "page1-mha-scan": dict(page_size=1, heads=(2, 2), window=None, slots_last=False,
                           scan_layers=True, impl="xla"),
    "page3-gqa-window7-keysT": dict(page_size=3, heads=(4, 2), window=7, slots_last=True,
                                    scan_layers=False, impl="xla"),
    "page4-mqa-window3-chunked": dict(page_size=4, heads=(4, 1), window=3,
                                      slots_last=False, scan_layers=False,
                                      impl="chunked"),
    "page8-gqa-keysT-scan-chunked": dict(page_size=8, heads=(4, 2), window=None,
                                         slots_last=True, scan_layers=True,
                                         impl="chunked"),
}
_COMPARE: dict = {}


def _compare_fn(name):
    """The jitted pair (paged, contiguous) of writes and attentions of one structure."""
    if name in _COMPARE:
        return _COMPARE[name]
    s = STRUCTURES[name]
    config = _config(*s["heads"], s["scan_layers"])
    width = pages_for(S_MAX, s["page_size"]) + 1
    num_pages = 1 + B * width
    layer = 1

    @jax.jit
    def run(table, prior, pk, pv, q, k, v):
        # The contiguous cache for a CPU target stores its keys slots last.
        contiguous = KVCache.init(config, B, S_MAX + T,
                                  platform="cpu" if s["slots_last"] else "gpu")
        paged = PagedKVCache.init(config, num_pages, s["page_size"]).with_table(table, prior)
        # The rows' earlier positions, through each cache's own write: positions past a row's
        # prior length go to pages it holds (overwritten by the chunk) or to the null page.
        contiguous = contiguous.write(layer, pk, pv, jnp.zeros((B,), jnp.int32))
        paged = paged.write(layer, pk, pv, jnp.broadcast_to(jnp.arange(S_MAX), (B, S_MAX)))
        positions = prior[:, None] + jnp.arange(T, dtype=jnp.int32)
        attend = dict(window=s["window"], impl=s["impl"])
        want, contiguous = contiguous.attend(layer, q, k, v, positions, **attend)
        got, gathered = paged.replace(view="gather").attend(layer, q, k, v, positions, **attend)
        pooled, _ = paged.replace(view="pool").attend(layer, q, k, v, positions, **attend)
        blocks, _ = paged.replace(view="blocks").attend(layer, q, k, v, positions, **attend)
        # Blocks of one page or a few positions: several per row, a window's first skipped.
        small, _ = paged.replace(view="blocks", block_positions=4).attend(
            layer, q, k, v, positions, **attend)
        want_keys, want_values = contiguous.layer(layer)
        return ((got, pooled, blocks, small), want, gathered.layer(layer),
                (keys_in_order(want_keys), want_values))

    _COMPARE[name] = (run, config, width, num_pages)
    return _COMPARE[name]


@pytest.mark.parametrize("structure", STRUCTURES)
@settings(max_examples=8, deadline=None)
@given(prior=st.lists(st.integers(0, S_MAX - T), min_size=B, max_size=B),
       chunk=st.lists(st.integers(1, T), min_size=B, max_size=B),
       seed=st.integers(0, 2 ** 16))
def test_paged_attention_equals_contiguous(structure, prior, chunk, seed):
    """Rows with their own prior lengths write a chunk (right-padded to T) and attend: the paged
    cache (pages in a random order, a table wider than needed), through every view (its pages
    gathered, the whole pool read in place, or its pages a block at a time, one block or
    several), gives the contiguous cache's output at every
    real query, and its pages hold the same keys/values at every position."""
    run, config, width, num_pages = _compare_fn(structure)
    page_size = STRUCTURES[structure]["page_size"]
    kv, n, h = config.n_kv_heads, config.n_heads, config.head_dim
    rng = np.random.default_rng(seed)
    order = rng.permutation(np.arange(1, num_pages))
    table = np.full((B, width), NULL_PAGE, np.int32)
    for row, (length, c) in enumerate(zip(prior, chunk, strict=True)):  # only the pages it fills
        used = pages_for(length + c, page_size)
        table[row, :used] = order[row * width:row * width + used]

    def normal(*shape):
        return jnp.asarray(rng.normal(size=shape), jnp.float32)

    views, want, (keys, values), (want_keys, want_values) = run(
        table, np.asarray(prior, np.int32), normal(B, S_MAX, kv, h), normal(B, S_MAX, kv, h),
        normal(B, T, n, h), normal(B, T, kv, h), normal(B, T, kv, h))
    for row, (length, c) in enumerate(zip(prior, chunk, strict=True)):
        for view in views:
            np.testing.assert_allclose(np.asarray(view[row, :c]), np.asarray(want[row, :c]),
                                       rtol=1e-5, atol=1e-6)
        filled = np.arange(length + c)
        np.testing.assert_array_equal(np.asarray(values[row])[:, filled],
                                      np.asarray(want_values[row])[:, filled])
        np.testing.assert_array_equal(np.take(np.asarray(keys[row]), filled, 1),
                                      np.take(np.asarray(want_keys[row]), filled, 1))


def test_writes_outside_a_rows_pages_go_to_the_null_page():
    """A padded chunk past the row's pages (and past the table) leaves every other page as it
    was: only the null page takes those writes."""
    config = _config(2, 2, True)
    cache = PagedKVCache.init(config, 6, 2)
    cache = cache.with_table(np.asarray([[3, NULL_PAGE]]), np.asarray([0]))
    k = jnp.ones((1, 8, 2, 8))
    cache = cache.write(0, k, k, jnp.arange(8, dtype=jnp.int32)[None])
    written = np.asarray(cache.v[0]).swapaxes(0, 1).reshape(6, -1).any(axis=1)  # per page
    assert written.tolist() == [True, False, False, True, False, False]


# Page pool ---------------------------------------------------------------------------------------

def test_pool_allocates_shares_and_frees_every_page():
    pool = PagePool(5)
    assert pool.capacity == 4
    a = pool.allocate(3)
    assert sorted(a) == [1, 2, 3] and NULL_PAGE not in a
    assert pool.allocate(2) is None and pool.num_free == 1  # nothing taken on failure
    pool.share(a[0])
    assert not pool.release(a[0]) and pool.release(a[0])
    pool.free(a[0])
    for page in a[1:]:
        assert pool.release(page)
        pool.free(page)
    assert pool.num_free == 4 and pool.held() == {}
    with pytest.raises(ValueError, match="cannot be freed"):
        pool.free(a[0])
    with pytest.raises(ValueError, match="not held"):
        pool.release(a[0])
    with pytest.raises(ValueError, match="null page"):
        pool.share(NULL_PAGE)


def test_page_digests_chain_over_the_whole_prefix():
    a = page_digests([1, 2, 3, 4, 5, 6, 7], 2)
    b = page_digests([1, 2, 3, 4, 9, 9], 2)
    c = page_digests([0, 2, 3, 4], 2)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    assert c[1] != a[1]  # the same tokens after a different first page name another page
    assert page_digests([1, 2, 3, 4, 5, 6, 7], 2, known=a[:1]) == a


def test_prefix_cache_shares_parks_and_evicts_least_recently_used():
    pool = PagePool(5)
    cache = PrefixCache(pool)
    names = page_digests(list(range(8)), 2)
    pages = cache.allocate(3)
    for name, page in zip(names[:3], pages, strict=True):
        cache.insert(name, page)
    assert cache.match(names[:2] + [b"missing", names[2]]) == pages[:2]  # stops at a miss
    cache.release(pages[:2])  # the match's holds
    cache.release(pages)  # the owner's: all three parked now
    assert pool.num_free == 1 and cache.num_parked == 3 and cache.num_available == 4
    assert cache.match(names[2:3]) == [pages[2]]  # found again after parking
    cache.release([pages[2]])  # parked again, now the most recently used
    fresh = cache.allocate(3)  # evicts the two least recently used: pages[0], pages[1]
    assert sorted(fresh) == sorted([p for p in range(1, 5) if p != pages[2]])
    assert cache.match(names) == []  # page 0's name went, so the chain finds nothing
    assert cache.match(names[2:3]) == [pages[2]]
    cache.release([pages[2]])
    cache.release(fresh)
    cache.clear()
    assert pool.num_free == 4 and pool.held() == {} and cache.num_parked == 0


def test_disabled_prefix_cache_frees_at_once():
    pool = PagePool(3)
    cache = PrefixCache(pool, enabled=False)
    (page,) = cache.allocate(1)
    cache.insert(b"x", page)
    cache.release([page])
    assert pool.num_free == 2 and cache.match([b"x"]) == []
