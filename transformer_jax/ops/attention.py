"""Scaled dot-product attention with causal/padding/segment masks and grouped K/V heads.

Query head r reads kv head ``group(r) = floor(r / G)`` with G = N / K: the queries are viewed as
[B, T, K, G, H], so K/V heads are never repeated in memory. MHA is K = N, MQA is K = 1.
"""

import chex
import jax
import jax.numpy as jnp

# Masked logits get this value rather than -inf, so that a row with no visible key stays finite.
_MASK_VALUE = float(jnp.finfo(jnp.float32).min)


def attention_mask(q_positions: jax.Array, k_positions: jax.Array, *,
                   q_segments: jax.Array | None = None,
                   k_segments: jax.Array | None = None,
                   k_valid: jax.Array | None = None,
                   window: int | None = None) -> jax.Array:
    """Boolean mask of which keys each query may attend to.

    A query at position m sees a key at position n iff ``n <= m`` (causal), both belong to the
    same segment (packed sequences; segment 0 means padding and sees nothing), the key is valid,
    and (with a sliding window) it is among the last ``window`` positions.

    Args:
      q_positions: [B, T] integer positions of the queries.
      k_positions: [B, S] integer positions of the keys.
      q_segments: optional [B, T] segment ids of the queries (0 = padding).
      k_segments: optional [B, S] segment ids of the keys (0 = padding).
      k_valid: optional [B, S] bool, False for keys that must never be seen.
      window: optional sliding window: a query at m sees only keys with ``n > m - window``.

    Returns:
      [B, T, S] bool.
    """
    chex.assert_rank([q_positions, k_positions], 2)
    mask = k_positions[:, None, :] <= q_positions[:, :, None]
    if window is not None:
        mask &= k_positions[:, None, :] > q_positions[:, :, None] - window
    if (q_segments is None) != (k_segments is None):
        raise ValueError("q_segments and k_segments must be given together")
    if q_segments is not None:
        mask &= q_segments[:, :, None] == k_segments[:, None, :]
        mask &= (q_segments != 0)[:, :, None]
    if k_valid is not None:
        mask &= k_valid[:, None, :]
    return mask


def _check_qkv(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None) -> None:
    chex.assert_rank([q, k, v], 4)
    chex.assert_equal_shape([k, v])
    chex.assert_equal(q.shape[0], k.shape[0])
    chex.assert_equal(q.shape[3], k.shape[3])
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads ({q.shape[2]}) must be a multiple of kv heads "
                         f"({k.shape[2]})")
    if mask is not None:
        chex.assert_shape(mask, (q.shape[0], q.shape[1], k.shape[1]))


def attention_weights(q: jax.Array, k: jax.Array, mask: jax.Array | None,
                      scale: float | None = None) -> jax.Array:
    """Softmax attention probabilities, grouped over kv heads.

    Args:
      q: [B, T, N, H] queries.
      k: [B, S, K, H] keys, N a multiple of K.
      mask: optional [B, T, S] bool (True = visible).
      scale: logit scale, default ``1/sqrt(H)`` (keeps the logits' variance near 1).

    Returns:
      [B, N, T, S] float32 probabilities: each row sums to 1 over the visible keys and is 0 on
      masked keys; a row with no visible key is all zeros.
    """
    _check_qkv(q, k, k, mask)
    b, t, n, h = q.shape
    kv = k.shape[2]
    scale = h ** -0.5 if scale is None else scale
    qg = q.reshape(b, t, kv, n // kv, h)
    logits = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k, preferred_element_type=jnp.float32) * scale
    if mask is not None:
        logits = jnp.where(mask[:, None, None], logits, _MASK_VALUE)
    probs = jax.nn.softmax(logits, axis=-1)
    if mask is not None:
        probs = jnp.where(mask[:, None, None], probs, 0.0)
    return probs.reshape(b, n, t, k.shape[1])


def reference_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None,
                        scale: float | None = None) -> jax.Array:
    """Attention written out with einsums: ``softmax(q k^T * scale + mask) v``.

    Args:
      q: [B, T, N, H] queries.
      k: [B, S, K, H] keys.
      v: [B, S, K, H] values.
      mask: optional [B, T, S] bool (True = visible).
      scale: logit scale, default ``1/sqrt(H)``.

    Returns:
      [B, T, N, H] in q's dtype.
    """
    b, t, n, h = q.shape
    kv = k.shape[2]
    probs = attention_weights(q, k, mask, scale).reshape(b, kv, n // kv, t, k.shape[1])
    out = jnp.einsum("BKGTS,BSKH->BTKGH", probs.astype(v.dtype), v,
                     preferred_element_type=jnp.float32)
    return out.reshape(b, t, n, h).astype(q.dtype)


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None,
                          *, scale: float | None = None, impl: str = "xla") -> jax.Array:
    """Scaled dot-product attention with grouped kv heads.

    Args:
      q: [B, T, N, H] queries.
      k: [B, S, K, H] keys, N a multiple of K.
      v: [B, S, K, H] values.
      mask: optional [B, T, S] bool (True = visible).
      scale: logit scale, default ``1/sqrt(H)``.
      impl: ``"xla"`` runs the einsum reference; ``"jax"`` calls
        ``jax.nn.dot_product_attention``, which uses the cuDNN fused kernel on GPUs that
        support it. Both return zeros for a query with no visible key.

    Returns:
      [B, T, N, H] in q's dtype.
    """
    _check_qkv(q, k, v, mask)
    if impl == "xla":
        return reference_attention(q, k, v, mask, scale)
    if impl != "jax":
        raise ValueError(f"impl must be 'xla' or 'jax', got {impl!r}")
    out = jax.nn.dot_product_attention(
        q, k, v, mask=None if mask is None else mask[:, None], scale=scale)
    if mask is not None:
        out = jnp.where(jnp.any(mask, axis=-1)[:, :, None, None], out, 0)
    return out.astype(q.dtype)
