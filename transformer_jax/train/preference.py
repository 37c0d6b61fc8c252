"""Preference objectives as pure functions: per-sequence log-probs, DPO (sigmoid, with label
smoothing), IPO and ORPO losses, and their rewards.

Shapes: B rows, T tokens, V vocabulary, M pairs per row (``data.preference``: pair k of a row
is segments 2k + 1 (chosen) and 2k + 2 (rejected)), P pairs (any leading shape).

The formulas follow TRL (``DPOTrainer``'s ``sigmoid`` and ``ipo``, ``ORPOTrainer``):

* DPO: ``d = (pi_c - ref_c) - (pi_r - ref_r)`` (summed completion log-probs), loss
  ``-(1 - eps) log sigmoid(beta d) - eps log sigmoid(-beta d)`` (conservative DPO; eps = 0 is
  the plain sigmoid loss); rewards ``beta (pi - ref)``.
* IPO: the same log-ratios averaged per completion token, loss ``(d_avg - 1 / (2 beta))^2``.
* ORPO: with mean per-token log-probs ``l_c, l_r``, ``log_odds = (l_c - l_r) -
  (log(1 - exp l_c) - log(1 - exp l_r))``; loss ``nll(chosen) - lambda log sigmoid(log_odds)``
  (the NLL the mean cross-entropy over the chosen sequences, prompt included, as TRL's
  ``ORPOTrainer``); rewards ``lambda l``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

#: ``train.dpo_loss`` values.
DPO_LOSSES = ("sigmoid", "ipo")


def token_logps(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """``log p(target)`` of each token, [B, T] float32, from logits [B, T, V]."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def sequence_logps(logps: jax.Array, mask: jax.Array, segment_ids: jax.Array,
                   pairs_per_row: int) -> tuple[jax.Array, jax.Array]:
    """Summed log-probs and token counts of each (pair, side) of packed rows.

    Args:
      logps: [B, T] per-token log-probs of the targets (``token_logps``).
      mask: [B, T] loss weights (1 on completion targets of the same segment as the input).
      segment_ids: [B, T] the input token's segment (0 = padding).
      pairs_per_row: M.

    Returns:
      ``(sums, counts)``, each [B, M, 2] float32 (index 0 chosen, 1 rejected).
    """
    onehot = jax.nn.one_hot(segment_ids - 1, 2 * pairs_per_row, dtype=jnp.float32)  # [B,T,2M]
    weights = mask.astype(jnp.float32)
    sums = jnp.einsum("bt,bts->bs", logps * weights, onehot)
    counts = jnp.einsum("bt,bts->bs", weights, onehot)
    shape = (*segment_ids.shape[:1], pairs_per_row, 2)
    return sums.reshape(shape), counts.reshape(shape)


def dpo_losses(policy_chosen: jax.Array, policy_rejected: jax.Array, ref_chosen: jax.Array,
               ref_rejected: jax.Array, *, beta: float, label_smoothing: float = 0.0,
               loss_type: str = "sigmoid", chosen_tokens: jax.Array | None = None,
               rejected_tokens: jax.Array | None = None
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-pair DPO / IPO losses and rewards.

    Args:
      policy_chosen, policy_rejected, ref_chosen, ref_rejected: [P] summed completion
        log-probs of the policy and the reference.
      beta: the DPO temperature (IPO: its regularisation tau).
      label_smoothing: eps of conservative DPO (sigmoid only).
      loss_type: ``sigmoid`` or ``ipo``.
      chosen_tokens, rejected_tokens: [P] completion token counts (IPO's averages).

    Returns:
      ``(losses, chosen_rewards, rejected_rewards)``, each [P]; rewards ``beta (pi - ref)``.
    """
    chosen_ratio = policy_chosen - ref_chosen
    rejected_ratio = policy_rejected - ref_rejected
    if loss_type == "sigmoid":
        d = beta * (chosen_ratio - rejected_ratio)
        losses = (-(1.0 - label_smoothing) * jax.nn.log_sigmoid(d)
                  - label_smoothing * jax.nn.log_sigmoid(-d))
    elif loss_type == "ipo":
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError("the ipo loss needs the completions' token counts")
        d = (chosen_ratio / jnp.maximum(chosen_tokens, 1.0)
             - rejected_ratio / jnp.maximum(rejected_tokens, 1.0))
        losses = (d - 1.0 / (2.0 * beta)) ** 2
    else:
        raise ValueError(f"loss_type must be one of {DPO_LOSSES}, got {loss_type!r}")
    rewards = jax.lax.stop_gradient((beta * chosen_ratio, beta * rejected_ratio))
    return losses, rewards[0], rewards[1]


def log1mexp(x: jax.Array) -> jax.Array:
    """``log(1 - exp(x))`` for x < 0, stable on both sides of ``-log 2``."""
    return jnp.where(x < -jnp.log(2.0), jnp.log1p(-jnp.exp(x)), jnp.log(-jnp.expm1(x)))


def orpo_odds_ratio(mean_chosen: jax.Array, mean_rejected: jax.Array
                    ) -> tuple[jax.Array, jax.Array]:
    """ORPO's ``log sigmoid(log_odds)`` and ``log_odds`` per pair, from [P] mean per-token
    log-probs of the chosen and rejected completions."""
    log_odds = (mean_chosen - mean_rejected) - (log1mexp(mean_chosen) - log1mexp(mean_rejected))
    return jax.nn.log_sigmoid(log_odds), log_odds


def reward_stats(chosen_rewards: jax.Array, rejected_rewards: jax.Array, valid: jax.Array
                 ) -> dict[str, jax.Array]:
    """Sums over the valid pairs (divide by their count): ``rewards/chosen``,
    ``rewards/rejected``, ``rewards/accuracy`` (chosen > rejected) and ``rewards/margin``."""
    valid = valid.astype(jnp.float32)
    return {"rewards/chosen": jnp.sum(chosen_rewards * valid),
            "rewards/rejected": jnp.sum(rejected_rewards * valid),
            "rewards/accuracy": jnp.sum((chosen_rewards > rejected_rewards) * valid),
            "rewards/margin": jnp.sum((chosen_rewards - rejected_rewards) * valid)}


__all__ = ["DPO_LOSSES", "dpo_losses", "log1mexp", "orpo_odds_ratio", "reward_stats",
           "sequence_logps", "token_logps"]
