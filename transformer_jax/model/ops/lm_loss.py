"""LM head + cross-entropy without materialising the [B, T, V] float32 logits.

The full loss computes ``logits = x @ head`` for every token, [B, T, V] float32 (at B*T = 64k
tokens and V = 128k that is 32 GiB), keeps it for the backward pass, and then takes a log-softmax.
Here the B*T token rows are cut into chunks of ``chunk_size``; a ``lax.scan`` computes one chunk's
logits, its log-sum-exp and target logit, and adds them to running sums. The chunk body is wrapped
in ``jax.checkpoint``, so the backward pass recomputes each chunk's logits instead of storing
them: peak memory is one [chunk_size, V] float32 block plus the inputs.
"""

import chex
import jax
import jax.numpy as jnp

from transformer_jax.model.ops.chunked_attention import softcap
from transformer_jax.model.ops.layouts import OutFirst


def head_logits(x: jax.Array, head: jax.Array | OutFirst) -> jax.Array:
    """[..., D] hidden states -> [..., V] float32 logits through ``head``: [D, V], or an
    ``OutFirst`` [V, D] (a tied token table), cast to x's dtype."""
    w, spec = (head.w, "...D,VD->...V") if isinstance(head, OutFirst) else (head, "...D,DV->...V")
    return jnp.einsum(spec, x, w.astype(x.dtype), preferred_element_type=jnp.float32)


def _chunk_sums(x, head, targets, weights, *, z_loss, logit_softcap):
    """Sums for one chunk of rows: x [C, D], targets [C], weights [C] -> (ce, z) scalars."""
    logits = head_logits(x, head)
    if logit_softcap is not None:
        logits = softcap(logits, logit_softcap)
    lse = jax.nn.logsumexp(logits, axis=-1)  # [C]
    target_logit = jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
    ce = jnp.sum(weights * (lse - target_logit))
    z = z_loss * jnp.sum(weights * jnp.square(lse)) if z_loss else jnp.zeros((), jnp.float32)
    return ce, z


def lm_head_cross_entropy_sums(x: jax.Array, head: jax.Array | OutFirst, targets: jax.Array,
                               mask: jax.Array | None = None, *, chunk_size: int,
                               z_loss: float = 0.0, logit_softcap: float | None = None,
                               ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Summed next-token cross-entropy and z-loss of ``x @ head``, chunked over tokens.

    The same quantities as ``loss.cross_entropy_sums(logits, targets, mask, z_loss)`` on
    ``logits = x @ head`` (float32; soft-capped to ``c tanh(logits / c)`` with
    ``logit_softcap`` c), so a caller can swap one for the other; only a [chunk_size, V] block
    of logits exists at a time, forward or backward.

    Args:
      x: [B, T, D] final hidden states (after the final norm).
      head: [D, V] output projection, or an ``OutFirst`` [V, D] (a tied embedding,
        ``Transformer.lm_head``); cast to x's dtype for the matmul, which accumulates in
        float32.
      targets: [B, T] int target ids.
      mask: optional [B, T] weights (bool or float; 1 = target counts, 0 = padding).
      chunk_size: token rows per chunk (of the flattened B*T); the last chunk is padded with
        zero-weight rows.
      z_loss: weight of ``logsumexp(logits)^2``.
      logit_softcap: optional final-logit soft-cap c, applied to each chunk's float32 logits
        before the log-sum-exp (the cross-entropy and the z-loss both see the capped logits).

    Returns:
      ``(ce_sum, z_sum, count)``: float32 scalars; ``z_sum`` already carries the ``z_loss``
      weight and ``count`` is the sum of the weights.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    chex.assert_rank([x, targets], [3, 2])
    chex.assert_equal(len(head.shape), 2)
    b, t, d = x.shape
    chex.assert_shape(targets, (b, t))
    chex.assert_equal(head.shape[1 if isinstance(head, OutFirst) else 0], d)
    weights = jnp.ones((b, t), jnp.float32) if mask is None else mask.astype(jnp.float32)
    chex.assert_shape(weights, (b, t))

    rows = b * t
    chunk_size = min(chunk_size, rows)
    n_chunks = -(-rows // chunk_size)
    pad = n_chunks * chunk_size - rows
    xs = jnp.pad(x.reshape(rows, d), ((0, pad), (0, 0))).reshape(n_chunks, chunk_size, d)
    ts = jnp.pad(targets.reshape(rows), (0, pad)).reshape(n_chunks, chunk_size)
    ws = jnp.pad(weights.reshape(rows), (0, pad)).reshape(n_chunks, chunk_size)

    # Nothing inside the chunk is saved for the backward pass; its logits are recomputed there.
    chunk = jax.checkpoint(lambda head, xc, tc, wc: _chunk_sums(
        xc, head, tc, wc, z_loss=z_loss, logit_softcap=logit_softcap))

    def step(carry, inputs):
        ce, z = chunk(head, *inputs)
        return (carry[0] + ce, carry[1] + z), None

    zero = jnp.zeros((), jnp.float32)
    (ce_sum, z_sum), _ = jax.lax.scan(step, (zero, zero), (xs, ts, ws))
    return ce_sum, z_sum, jnp.sum(weights)
