"""RMSNorm and LayerNorm, computed in float32 whatever the input dtype."""

import chex
import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, scale: jax.Array, eps: float = 1e-5) -> jax.Array:
    """RMSNorm: ``x / sqrt(mean(x^2) + eps) * scale`` over the last axis.

    Args:
      x: [..., D] activations.
      scale: [D] learned gain.
      eps: added to the mean square for stability.

    Returns:
      [..., D] in x's dtype (the statistics are float32).
    """
    chex.assert_equal(x.shape[-1:], scale.shape)
    x32 = x.astype(jnp.float32)
    inv_rms = jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    return (x32 * inv_rms * scale.astype(jnp.float32)).astype(x.dtype)


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float = 1e-5) -> jax.Array:
    """LayerNorm: ``(x - mean) / sqrt(var + eps) * scale + bias`` over the last axis.

    Args:
      x: [..., D] activations.
      scale: [D] learned gain.
      bias: [D] learned shift.
      eps: added to the variance for stability.

    Returns:
      [..., D] in x's dtype (the statistics are float32).
    """
    chex.assert_equal(x.shape[-1:], scale.shape)
    chex.assert_equal_shape([scale, bias])
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps)
    return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)
