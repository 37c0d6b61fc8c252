"""The int8 KV cache (``cache_dtype="int8"``): each (token, kv head) row is stored int8 with its
own scale, in the contiguous and the paged cache; attention over it equals attention over the
rows rounded per row by an independent numpy quantiser, and is within quantisation error of the
float cache's. (The serving engine's int8 pages against generate's int8 cache: test_quant.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TINY

from transformer_jax.model.config import ModelConfig, load_toml
from transformer_jax.model.kv_cache import KVCache, cache_bytes
from transformer_jax.model.ops import kv_quant
from transformer_jax.serving.paged_cache import PagedKVCache

B, T = 2, 12


def _rows(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    """Random rows whose magnitudes span 1e-4 .. 1e2 from one (token, head) to the next: a
    row read with another row's scale would lose its values or overflow."""
    rng = np.random.default_rng(seed)
    magnitude = 10.0 ** rng.integers(-4, 3, shape[:-1])[..., None]
    return (rng.standard_normal(shape) * magnitude).astype(np.float32)


def _rounded(x: np.ndarray) -> np.ndarray:
    """numpy's per-row int8 rounding: scale = bfloat16(max|row| / 127), values clipped."""
    scale = (np.abs(x).max(-1, keepdims=True) / 127).astype(jnp.bfloat16).astype(np.float32)
    return np.clip(np.round(x / np.where(scale > 0, scale, 1)), -127, 127) * scale


def test_each_row_decodes_within_one_step_of_its_own_scale():
    x = _rows(0, (3, 5, 4, 16))
    back = np.asarray(jax.jit(lambda x: kv_quant.decode(kv_quant.encode(x), jnp.float32))(x))
    step = np.abs(x).max(-1, keepdims=True) / 127
    assert np.all(np.abs(back - x) <= step * 0.51)
    np.testing.assert_allclose(back, _rounded(x), rtol=1e-6, atol=0)
    assert kv_quant.encode(jnp.zeros((2, 16))).dtype == jnp.int8
    assert np.all(np.asarray(kv_quant.decode(kv_quant.encode(jnp.zeros((2, 16))),
                                             jnp.float32)) == 0)


def _chunk(config: ModelConfig, seed: int):
    n, k, h = config.n_heads, config.n_kv_heads, config.head_dim
    q = _rows(seed, (B, T, n, h))
    keys, values = _rows(seed + 1, (B, T, k, h)), _rows(seed + 2, (B, T, k, h))
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    return q, keys, values, positions


def _paged(config: ModelConfig, dtype, view: str) -> PagedKVCache:
    # Pages handed out out of order, the two rows' interleaved.
    cache = PagedKVCache.init(config, num_pages=9, page_size=4, batch=B, pages_per_row=4,
                              dtype=dtype, view=view)
    return cache.with_table(np.array([[5, 2, 7, 0], [3, 8, 1, 0]]), np.zeros(B, np.int32))


CACHES = {
    "contiguous-unrolled-slots-last": lambda c, d: KVCache.init(c, B, 16, d, platform="cpu"),
    "contiguous-scanned": lambda c, d: KVCache.init(
        c.replace(scan_layers=True), B, 16, d, platform="gpu"),
    "paged-gather": lambda c, d: _paged(c, d, "gather"),
    "paged-pool": lambda c, d: _paged(c.replace(scan_layers=True), d, "pool"),
    "paged-pool-unrolled": lambda c, d: _paged(c, d, "pool"),
    "paged-blocks": lambda c, d: _paged(c, d, "blocks").replace(block_positions=8),
    "paged-blocks-scanned": lambda c, d: _paged(c.replace(scan_layers=True), d, "blocks"),
}


@pytest.mark.parametrize("kind", CACHES)
def test_int8_cache_attention_equals_attention_over_rows_rounded_per_row(kind):
    config = TINY
    q, k, v, positions = _chunk(config, 3)
    make = CACHES[kind]
    assert make(config, "int8").int8 and not make(config, "float32").int8

    @jax.jit
    def attend(cache, k, v):
        return cache.attend(1, jnp.asarray(q), k, v, positions, window=None, impl="xla")[0]

    got = attend(make(config, "int8"), k, v)
    want = attend(make(config, "float32"), _rounded(k), _rounded(v))
    exact = attend(make(config, "float32"), k, v)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # Within quantisation error of the float cache, relative to each output row's values
    # (attention averages rows of very different magnitude, so the bound is loose here; the
    # exact-rounding comparison above is the tight one).
    err = np.abs(np.asarray(got) - np.asarray(exact))
    assert np.all(err <= 0.05 * np.abs(v).max() + 1e-6)


def test_int8_cache_is_at_most_0_53x_a_bfloat16_cache():
    config = ModelConfig.from_dict(load_toml("decode_25m")["model"])  # H = 64
    int8 = KVCache.init(config, 1, 8, "int8")
    assert int8.nbytes == cache_bytes(config, 1, 8, "int8")
    ratio = int8.nbytes / cache_bytes(config, 1, 8, "bfloat16")
    assert ratio <= 0.53 and ratio == (config.head_dim + 2) / (2 * config.head_dim)
    paged = PagedKVCache.init(config, 4, 16, dtype="int8")
    assert paged.nbytes / PagedKVCache.init(config, 4, 16, dtype="bfloat16").nbytes == ratio
