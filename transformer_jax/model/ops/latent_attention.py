"""Multi-head latent attention's two ways of attending over cached [c, k_rope] entries
(``fields.MLA``): ``expanded`` builds every head's keys and values (training, prefill);
``absorbed`` folds the key up-projection into the query and attends over the entries
themselves (a decode step). Both compute the same softmax(q . k * scale) v."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from transformer_jax.model.ops.attention import attention


def _pad_last(x: jax.Array, width: int) -> jax.Array:
    extra = width - x.shape[-1]
    return x if extra <= 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])


def expanded(q_nope: jax.Array, q_rope: jax.Array, entries: jax.Array, kv_b: jax.Array, *,
             q_positions: jax.Array, k_positions: jax.Array | None = None,
             q_segments: jax.Array | None = None, k_segments: jax.Array | None = None,
             scale: float, impl: str = "auto") -> jax.Array:
    """Attention with each head's keys and values built from the cache entries.

    Args:
      q_nope, q_rope: [B, T, N, nope], [B, T, N, P] the queries' position-free, rotated parts.
      entries, kv_b: [B, S, R + P] latents and rope keys, [R, N, nope + V] up-projection.
      q_positions, k_positions, q_segments, k_segments: as ``ops.attention.attention`` takes
        them (k_positions None: slot s holds position s).
      scale, impl: the logits' scale and the attention implementation.

    Returns:
      [B, T, N, V] in q's dtype.
    """
    nope, p = q_nope.shape[-1], q_rope.shape[-1]
    r = entries.shape[-1] - p
    n, v = kv_b.shape[1], kv_b.shape[2] - nope
    c, k_rope = entries[..., :r].astype(q_nope.dtype), entries[..., r:].astype(q_nope.dtype)
    kv = jnp.einsum("BSR,RNE->BNSE", c, kv_b.astype(q_nope.dtype))
    k_nope, values = kv[..., :nope], kv[..., nope:]
    b, s = entries.shape[:2]
    keys = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope[:, None], (b, n, s, p))], -1)
    q = jnp.concatenate([q_nope, q_rope.astype(q_nope.dtype)], -1)
    width = max(nope + p, v)  # one head width for q, k and v (zeros change no product)
    out = attention(_pad_last(q, width), _pad_last(keys, width), _pad_last(values, width),
                    q_positions=q_positions, k_positions=k_positions, q_segments=q_segments,
                    k_segments=k_segments, scale=scale, impl=impl)
    return out[..., :v]


def absorbed(q_nope: jax.Array, q_rope: jax.Array, entries: jax.Array, kv_b: jax.Array, *,
             q_positions: jax.Array, scale: float, impl: str = "auto") -> jax.Array:
    """Attention in the latent space: every query head over the S entries themselves.

    Args:
      q_nope, q_rope, entries, kv_b, scale, impl: as ``expanded`` takes them (slot s of the
        entries holding position s).
      q_positions: [B, T] the queries' positions (causal over slots).

    Returns:
      [B, T, N, V] in q's dtype.
    """
    nope = q_nope.shape[-1]
    r = entries.shape[-1] - q_rope.shape[-1]
    w = kv_b.astype(q_nope.dtype)
    q_latent = jnp.einsum("BTNK,RNK->BTNR", q_nope, w[..., :nope])
    q = jnp.concatenate([q_latent, q_rope.astype(q_nope.dtype)], -1)  # [B, T, N, R + P]
    # One kv head holding the entries as keys and values (the outputs' first R: the latents).
    kv = entries.astype(q_nope.dtype)[:, None]
    latent = attention(q, kv, kv, q_positions=q_positions, scale=scale, impl=impl)[..., :r]
    return jnp.einsum("BTNR,RNV->BTNV", latent, w[..., nope:])
