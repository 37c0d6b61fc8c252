"""The training objective: next-token cross-entropy over the target tokens (masked), with an
optional z-loss that keeps ``log Z`` near 0. Sums, so micro-batches add up and divide once."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from transformer_jax.model.mtp import mtp_targets


def cross_entropy_sums(logits: jax.Array, targets: jax.Array, mask: jax.Array | None = None,
                       z_loss: float = 0.0) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Summed next-token cross-entropy and z-loss, and the number of target tokens.

    Args:
      logits: [B, T, V] float32 logits.
      targets: [B, T] int target ids.
      mask: optional [B, T] weights (1 = target counts, 0 = padding).
      z_loss: weight of ``logsumexp(logits)^2``.

    Returns:
      ``(ce_sum, z_sum, count)``: float32 scalars.
    """
    logits = logits.astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)  # [B, T]
    weights = jnp.ones_like(ce) if mask is None else mask.astype(jnp.float32)
    z_sum = jnp.zeros((), jnp.float32)
    if z_loss:
        z_sum = z_loss * jnp.sum(weights * jnp.square(jax.nn.logsumexp(logits, axis=-1)))
    return jnp.sum(weights * ce), z_sum, jnp.sum(weights)


def cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array | None = None,
                  z_loss: float = 0.0) -> jax.Array:
    """Mean cross-entropy plus z-loss, nats per kept target (arguments: ``cross_entropy_sums``)."""
    ce_sum, z_sum, count = cross_entropy_sums(logits, targets, mask, z_loss)
    return (ce_sum + z_sum) / jnp.maximum(count, 1.0)


def mtp_loss(logits: jax.Array, targets: jax.Array, mask: jax.Array | None = None,
             segment_ids: jax.Array | None = None) -> jax.Array:
    """The multi-token prediction modules' mean cross-entropy ``sum_k CE_k / D``.

    Args:
      logits: [D, B, T, V] the modules' logits (``Output.mtp``), module k's entry i
        predicting token i + k + 1.
      targets: [B, T] the next-token targets (targets[i] = t_{i+1}).
      mask: optional [B, T] weights of ``targets``.
      segment_ids: optional [B, T] packed segments (a target in another segment is dropped).

    Returns:
      A float32 scalar: each module's mean over its targets (``mtp.mtp_targets``), averaged.
    """
    means = []
    for k in range(1, logits.shape[0] + 1):
        t, w = mtp_targets(targets, mask, segment_ids, k)
        ce, _, count = cross_entropy_sums(logits[k - 1], t, w)
        means.append(ce / jnp.maximum(count, 1.0))
    return jnp.mean(jnp.stack(means))
