"""The router of a mixture of experts: each token's experts and weights from the router's logits
(``route``), and the router's losses and load statistics (N tokens, E experts, k per token)."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class Routing:
    """Where each token goes and with what weight.

    Attributes:
      weights, experts: [N, k] float32 weights and int32 indices of the chosen experts.
      probs: [N, E] float32 scores of the router logits (for the balance loss).
      logits: [N, E] float32 router logits (for the z-loss).
    """

    weights: jax.Array
    experts: jax.Array
    probs: jax.Array
    logits: jax.Array


def route(logits: jax.Array, top_k: int, renormalize: bool, score: str = "softmax", *,
          choice_bias: jax.Array | None = None, n_groups: int = 1, top_groups: int = 1,
          scale: float = 1.0) -> Routing:
    """Top-k routing on the experts' scores: chosen by ``scores + choice_bias`` (within each token's
    best groups with ``top_groups < n_groups``), weighted by the unbiased scores.

    Args:
      logits: [N, E] router logits (any float dtype; the scores are float32).
      top_k, renormalize, score, n_groups, top_groups: as ``fields.MoE``'s fields.
      choice_bias: optional [E] bias added to the scores for the choice only.
      scale: the routed weights' multiplier (``MoE.routed_scale``).

    Returns:
      The ``Routing`` (its experts in decreasing biased score; ties: lower index first).
    """
    logits = logits.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1) if score == "softmax" else jax.nn.sigmoid(logits)
    choice = probs
    if choice_bias is not None:
        choice = probs + jax.lax.stop_gradient(choice_bias.astype(jnp.float32))
    if top_groups < n_groups:
        choice = _within_top_groups(jax.lax.stop_gradient(choice), n_groups, top_groups)
    _, experts = jax.lax.top_k(choice, top_k)
    weights = jnp.take_along_axis(probs, experts, axis=-1)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    if scale != 1.0:
        weights = weights * scale
    return Routing(weights, experts.astype(jnp.int32), probs, logits)


def _within_top_groups(choice: jax.Array, n_groups: int, top_groups: int) -> jax.Array:
    """[N, E] ``choice`` with the experts outside each row's ``top_groups`` best groups at -inf."""
    n, e = choice.shape
    grouped = choice.reshape(n, n_groups, e // n_groups)
    group_score = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [N, n_groups]
    _, chosen = jax.lax.top_k(group_score, top_groups)
    keep = jnp.any(chosen[:, :, None] == jnp.arange(n_groups), axis=1)  # [N, n_groups]
    return jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(n, e)


def expert_load(experts: jax.Array, valid: jax.Array, n_experts: int) -> jax.Array:
    """[E] float32: how many valid (token, slot) pairs each expert received.

    Args:
      experts, valid, n_experts: [N, k] expert indices, [N] bool (False: padding), E.
    """
    onehot = jax.nn.one_hot(experts, n_experts, dtype=jnp.float32)  # [N, k, E]
    return jnp.einsum("nke,n->e", onehot, valid.astype(jnp.float32))


def balance_loss(routing: Routing, valid: jax.Array) -> jax.Array:
    """The load-balancing loss ``E * sum_e f_e P_e`` (Switch Transformer, as HF computes it for one
    layer): ``f_e`` the fraction of valid tokens that chose expert e among their k, ``P_e`` their
    mean router probability of e. Its minimum, k, is a uniform load.

    Args:
      routing, valid: the layer's ``Routing``, [N] bool.

    Returns:
      A float32 scalar (0 with no valid token).
    """
    e = routing.probs.shape[-1]
    count = jnp.maximum(jnp.sum(valid.astype(jnp.float32)), 1.0)
    f = expert_load(routing.experts, valid, e) / count
    p = jnp.einsum("ne,n->e", routing.probs, valid.astype(jnp.float32)) / count
    return e * jnp.sum(f * p)


def router_z_loss(routing: Routing, valid: jax.Array) -> jax.Array:
    """ST-MoE's router z-loss: the mean of ``logsumexp(logits)^2`` over valid tokens (float32)."""
    z = jax.nn.logsumexp(routing.logits, axis=-1) ** 2
    valid = valid.astype(jnp.float32)
    return jnp.sum(z * valid) / jnp.maximum(jnp.sum(valid), 1.0)
