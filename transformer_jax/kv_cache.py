"""The KV cache: an explicit, fixed-size pytree passed into the model and returned updated."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from transformer_jax.config import ModelConfig


@flax.struct.dataclass
class KVCache:
    """Keys and values of every layer for up to S_max positions per sequence.

    Slot s of sequence b holds the key/value of the token at position s, so the causal mask
    over slot indices is also the validity mask: slots past a sequence's length are never seen.

    Attributes:
      k: [L, B, S_max, K, H] keys (already rotated by RoPE).
      v: [L, B, S_max, K, H] values.
      lengths: [B] int32 number of positions written per sequence (the next write position).
    """

    k: jax.Array
    v: jax.Array
    lengths: jax.Array

    @classmethod
    def init(cls, config: ModelConfig, batch: int, max_len: int,
             dtype: jnp.dtype | str | None = None) -> KVCache:
        """An empty cache.

        Args:
          config: the model's config (gives L, K, H).
          batch: B.
          max_len: S_max, the largest number of positions it can hold.
          dtype: storage dtype; the model's compute dtype by default.
        """
        if batch <= 0 or max_len <= 0:
            raise ValueError(f"batch and max_len must be positive, got {batch} and {max_len}")
        dtype = jnp.dtype(dtype or config.dtype)
        shape = (config.n_layers, batch, max_len, config.n_kv_heads, config.head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   lengths=jnp.zeros((batch,), jnp.int32))

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes of K and V: ``2 * L * B * S_max * K * H * bytes_per_element``."""
        return self.k.size * self.k.dtype.itemsize + self.v.size * self.v.dtype.itemsize


def cache_bytes(config: ModelConfig, batch: int, max_len: int,
                dtype: jnp.dtype | str | None = None) -> int:
    """Size of K and V of a cache, without allocating it."""
    itemsize = jnp.dtype(dtype or config.dtype).itemsize
    return 2 * config.n_layers * batch * max_len * config.n_kv_heads * config.head_dim * itemsize


def write(cache_k: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """Writes a chunk of new keys (or values) of each sequence at its own start slot.

    Args:
      cache_k: [B, S_max, K, H] one layer's cache.
      new: [B, T, K, H] entries for positions ``start[b] .. start[b] + T - 1``.
      start: [B] int32 first slot per sequence.

    Returns:
      [B, S_max, K, H] updated.
    """
    def one(c, n, s):
        return jax.lax.dynamic_update_slice(c, n.astype(c.dtype), (s, 0, 0))
    return jax.vmap(one)(cache_k, new, start)
