"""The int8 KV cache's encoding: a token's [H] row of one kv head is stored as H + 2 int8 bytes,
``round(x / s)`` in [-127, 127] then the bfloat16 scale ``s = max|x| / 127`` bitcast into two
bytes, so every cache layout stores and reads the scale with its row ((H + 2) / 2H the bytes
of bfloat16)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

#: Storage dtype name of the int8 cache (``cache_dtype="int8"``).
INT8 = "int8"
#: Bytes of each row's scale (a bfloat16).
SCALE_BYTES = 2


def is_int8(dtype: jnp.dtype | str | None) -> bool:
    """Whether a cache storage dtype is the int8 encoding."""
    return dtype is not None and jnp.dtype(dtype) == jnp.int8


def stored_head_dim(head_dim: int, dtype: jnp.dtype | str | None) -> int:
    """The size of the cache's head axis: H, or H + 2 bytes for the int8 encoding."""
    return head_dim + SCALE_BYTES if is_int8(dtype) else head_dim


def encode(x: jax.Array) -> jax.Array:
    """[..., H] float rows -> [..., H + 2] int8: each row's values and its scale."""
    x = x.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    scale = (absmax / 127).astype(jnp.bfloat16)
    s = scale.astype(jnp.float32)
    # An all-zero row has scale 0: its values are 0 whatever they are divided by.
    q = jnp.clip(jnp.round(x / jnp.where(s > 0, s, 1)), -127, 127).astype(jnp.int8)
    scale_bytes = jax.lax.bitcast_convert_type(scale, jnp.int8)  # [..., 1, 2]
    return jnp.concatenate([q, scale_bytes.reshape(*q.shape[:-1], SCALE_BYTES)], axis=-1)


def decode(stored: jax.Array, dtype: jnp.dtype, axis: int = -1) -> jax.Array:
    """The float rows (``dtype``) of an int8-encoded array whose (H + 2) head axis is ``axis``."""
    stored = jnp.moveaxis(stored, axis, -1)
    h = stored.shape[-1] - SCALE_BYTES
    scale = jax.lax.bitcast_convert_type(stored[..., h:], jnp.bfloat16)  # [...]
    values = stored[..., :h].astype(dtype) * scale.astype(dtype)[..., None]
    return jnp.moveaxis(values, -1, axis)
