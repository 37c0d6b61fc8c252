"""LM head + cross-entropy without materialising the [B, T, V] float32 logits: a ``lax.scan``
over [B, C] chunks along T under ``jax.checkpoint`` (peak memory one [B, C, V] block, forward
or backward). Under a mesh whose batch axes split B it runs per device under ``shard_map``, so
the head's gradient is reduced once, after the scan."""

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from transformer_jax.model.ops.chunked_attention import softcap
from transformer_jax.model.ops.layouts import OutFirst
from transformer_jax.model.ops.target import mesh_axes


def head_logits(x: jax.Array, head: jax.Array | OutFirst) -> jax.Array:
    """[..., D] -> [..., V] float32 logits by ``head``, [D, V] or ``OutFirst`` [V, D]."""
    w, spec = (head.w, "...D,VD->...V") if isinstance(head, OutFirst) else (head, "...D,DV->...V")
    return jnp.einsum(spec, x, w.astype(x.dtype), preferred_element_type=jnp.float32)


def _chunk_sums(x, head, targets, weights, *, z_loss, logit_softcap):
    """Sums for one chunk: x [B, C, D], targets [B, C], weights [B, C] -> (ce, z) scalars."""
    logits = head_logits(x, head)
    if logit_softcap is not None:
        logits = softcap(logits, logit_softcap)
    lse = jax.nn.logsumexp(logits, axis=-1)  # [B, C]
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    ce = jnp.sum(weights * (lse - target_logit))
    z = z_loss * jnp.sum(weights * jnp.square(lse)) if z_loss else jnp.zeros((), jnp.float32)
    return ce, z


def lm_head_cross_entropy_sums(x: jax.Array, head: jax.Array | OutFirst, targets: jax.Array,
                               mask: jax.Array | None = None, *, chunk_size: int,
                               z_loss: float = 0.0, logit_softcap: float | None = None,
                               ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Summed next-token cross-entropy and z-loss of ``x @ head`` (float32, soft-capped), as
    ``loss.cross_entropy_sums`` computes them, a [B, chunk_size, V] block of logits at a time.

    Args:
      x: [B, T, D] final hidden states (after the final norm).
      head: [D, V] output projection, or an ``OutFirst`` [V, D] (``Transformer.lm_head``).
      targets: [B, T] int target ids.
      mask: optional [B, T] weights (bool or float; 0 = padding).
      chunk_size: C, positions per chunk (T padded with zero-weight positions to a multiple).
      z_loss: weight of ``logsumexp(logits)^2``.
      logit_softcap: optional final-logit soft-cap c (both losses see the capped logits).

    Returns:
      ``(ce_sum, z_sum, count)`` float32 scalars (``z_sum`` weighted; ``count``: the weights' sum).
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

    sums = functools.partial(_scanned_sums, chunk_size=chunk_size, z_loss=z_loss,
                             logit_softcap=logit_softcap)
    split = batch_split(b)
    if split is None:
        ce_sum, z_sum = sums(x, head, targets, weights)
    else:
        mesh, axes = split
        rows = P(axes)

        def local(x, head, targets, weights):  # this device's rows, the whole head
            return jax.tree.map(lambda s: jax.lax.psum(s, axes), sums(x, head, targets, weights))

        # The head enters whole (gathered once), so its gradient is summed over the axes once.
        ce_sum, z_sum = jax.shard_map(local, mesh=mesh, axis_names=frozenset(axes),
                                      in_specs=(rows, P(), rows, rows), out_specs=P())(
            x, head, targets, weights)
    return ce_sum, z_sum, jnp.sum(weights)


def _scanned_sums(x, head, targets, weights, *, chunk_size, z_loss, logit_softcap):
    """(ce, z) sums over x [B, T, D] in [B, chunk_size] chunks along T (a ``lax.scan``)."""
    b, t, _ = x.shape
    chunk_size = min(chunk_size, t)
    n_chunks = -(-t // chunk_size)
    pad = n_chunks * chunk_size - t

    def chunks(a):  # [B, T, ...] -> [n_chunks, B, chunk_size, ...], padded along T
        a = jnp.pad(a, ((0, 0), (0, pad)) + ((0, 0),) * (a.ndim - 2))
        return jnp.moveaxis(a.reshape(b, n_chunks, chunk_size, *a.shape[2:]), 1, 0)

    # Nothing inside the chunk is saved for the backward pass; its logits are recomputed there.
    chunk = jax.checkpoint(lambda head, xc, tc, wc: _chunk_sums(
        xc, head, tc, wc, z_loss=z_loss, logit_softcap=logit_softcap))

    # Per-chunk sums as outputs, not a carry: under shard_map a zero carry would not vary.
    _, (ce, z) = jax.lax.scan(lambda _, inputs: (None, chunk(head, *inputs)), None,
                              (chunks(x), chunks(targets), chunks(weights)))
    return jnp.sum(ce), jnp.sum(z)


def batch_split(b: int) -> tuple[jax.sharding.AbstractMesh, tuple[str, ...]] | None:
    """(mesh, the mesh axes of ``"batch"`` splitting B rows evenly), or None without any."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    names = mesh_axes(mesh, nn.logical_to_mesh_axes(("batch",))[0], b)
    return (mesh, names) if names else None
