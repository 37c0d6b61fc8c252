"""RMSNorm and LayerNorm, computed in float32 whatever the input dtype."""

import chex
import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, scale: jax.Array, eps: float = 1e-5, *, offset: float = 0.0
             ) -> jax.Array:
    """RMSNorm: ``x / sqrt(mean(x^2) + eps) * (offset + scale)`` over the trailing axes.

    Args:
      x, scale: [..., D] activations, [D] learned gain (or [..., N, H] and [N, H]: both axes).
      eps, offset: added to the mean square, and to the gain.

    Returns:
      x's shape and dtype (the statistics are float32).
    """
    chex.assert_equal(x.shape[x.ndim - scale.ndim:], scale.shape)
    axes = tuple(range(x.ndim - scale.ndim, x.ndim))
    x32 = x.astype(jnp.float32)
    square_sum = jnp.sum(jnp.square(x32), axis=axes, keepdims=True)
    inv_rms = jax.lax.rsqrt(square_sum / scale.size + eps)
    return (x32 * inv_rms * (offset + scale.astype(jnp.float32))).astype(x.dtype)


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float = 1e-5, *,
               offset: float = 0.0) -> jax.Array:
    """LayerNorm: ``(x - mean) / sqrt(var + eps) * scale + bias`` over the last axis.

    Args:
      x, scale, bias: [..., D] activations, [D] learned gain and shift.
      eps, offset: added to the variance, and to the gain.

    Returns:
      [..., D] in x's dtype (the statistics are float32).
    """
    chex.assert_equal(x.shape[-1:], scale.shape)
    chex.assert_equal_shape([scale, bias])
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps)
    return (y * (offset + scale.astype(jnp.float32)) + bias.astype(jnp.float32)).astype(x.dtype)
