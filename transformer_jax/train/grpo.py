"""GRPO as pure functions: group-normalised advantages, the clipped-ratio objective with a k3 KL
penalty, its three normalisations, and the loss a train step differentiates.

Shapes: B rows (one completion each: a prompt's tokens then its completion's, padded), T
tokens, V vocabulary, P prompts, G completions per prompt (B = P G, a prompt's G rows
consecutive).

The formulas follow TRL's ``GRPOTrainer`` (and DeepSeekMath, DAPO, Dr. GRPO):

* advantage ``A_i = (r_i - mean_g r) / (std_g r + 1e-4)`` over the G rewards of a prompt
  (``std`` unbiased, as ``torch.std``); Dr. GRPO leaves out the division (``scale=False``);
* per completion token t, ``ratio = exp(logp - old_logp)``, loss
  ``-min(ratio A, clip(ratio, 1 - eps, 1 + eps) A) + beta k3`` with
  ``k3 = exp(ref - logp) - (ref - logp) - 1`` (Schulman's unbiased, positive KL estimator);
* normalisation (``GRPO_LOSSES``): ``sequence`` (GRPO: each completion's mean over its tokens,
  then the mean over completions), ``token`` (DAPO: the sum over every completion token of the
  batch over their count), ``dr_grpo`` (the sum over the batch's tokens over
  ``B * max_completion_tokens``, a constant: no length bias).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.train.preference import token_logps

#: ``train.grpo_loss`` values (how the per-token losses are averaged).
GRPO_LOSSES = ("token", "sequence", "dr_grpo")
#: Added to a group's reward std before dividing (TRL's).
ADVANTAGE_EPS = 1e-4

Params = dict[str, Any]
Batch = dict[str, jax.Array]


def group_advantages(rewards: np.ndarray, group_size: int, scale: bool = True) -> np.ndarray:
    """Per-completion advantages [P G] from rewards [P G] (a prompt's G consecutive):
    ``r - mean`` over the group, divided by ``std + ADVANTAGE_EPS`` when ``scale``."""
    r = np.asarray(rewards, np.float64).reshape(-1, group_size)
    centred = r - r.mean(axis=1, keepdims=True)
    if scale:
        std = r.std(axis=1, ddof=1, keepdims=True) if group_size > 1 else np.zeros_like(r)
        centred = centred / (std + ADVANTAGE_EPS)
    return centred.reshape(-1).astype(np.float32)


def token_terms(logps: jax.Array, old_logps: jax.Array, ref_logps: jax.Array | None,
                advantages: jax.Array, *, clip_eps: float, kl_beta: float
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The clipped objective per token.

    Args:
      logps: [B, T] the policy's log-probs of the sampled tokens (differentiated).
      old_logps: [B, T] those of the policy that sampled them.
      ref_logps: [B, T] the reference's, or None (``kl_beta = 0``).
      advantages: [B] one per completion.
      clip_eps: eps of ``clip(ratio, 1 - eps, 1 + eps)``.
      kl_beta: weight of the k3 KL penalty.

    Returns:
      ``(loss, kl, clipped)``, each [B, T] float32: the per-token loss, the k3 estimate (0
      without a reference) and 1 where the clip is active (ratio outside the range on the side
      the advantage pushes towards).
    """
    adv = advantages[:, None]
    ratio = jnp.exp(logps - old_logps)
    clipped_ratio = jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    loss = -jnp.minimum(ratio * adv, clipped_ratio * adv)
    clipped = (((ratio < 1.0 - clip_eps) & (adv < 0)) | ((ratio > 1.0 + clip_eps) & (adv > 0)))
    if ref_logps is None:
        kl = jnp.zeros_like(loss)
    else:
        delta = ref_logps - logps
        kl = jnp.exp(delta) - delta - 1.0
        loss = loss + kl_beta * kl
    return loss, kl, clipped.astype(jnp.float32)


def normalised_sum(values: jax.Array, mask: jax.Array, loss_type: str, max_tokens: int
                   ) -> tuple[jax.Array, jax.Array]:
    """``(total, count)`` with ``total / count`` the batch's loss under ``loss_type``, both
    sums (so micro-batches and devices add up to the whole batch's).

    Args:
      values: [B, T] per-token values.
      mask: [B, T] 1 on completion tokens.
      loss_type: one of ``GRPO_LOSSES``.
      max_tokens: the most completion tokens (``dr_grpo``'s constant).
    """
    mask = mask.astype(jnp.float32)
    per_row = jnp.sum(values * mask, axis=-1)  # [B]
    tokens = jnp.sum(mask, axis=-1)
    rows = jnp.sum((tokens > 0).astype(jnp.float32))
    if loss_type == "token":
        return jnp.sum(per_row), jnp.sum(tokens)
    if loss_type == "sequence":
        return jnp.sum(per_row / jnp.maximum(tokens, 1.0)), rows
    if loss_type == "dr_grpo":
        return jnp.sum(per_row) / max_tokens, rows
    raise ValueError(f"loss_type must be one of {GRPO_LOSSES}, got {loss_type!r}")


def make_logps_fn(model: Any, temperature: float = 1.0
                  ) -> Callable[[Params, Batch], jax.Array]:
    """``logps(model_params, batch) -> [B, T]``: log-probs of ``batch["targets"]`` under
    ``model`` (a ``Transformer``) with the logits divided by ``temperature``."""
    def logps(model_params: Params, batch: Batch) -> jax.Array:
        logits = model.apply({"params": model_params}, batch["inputs"],
                             positions=batch["positions"],
                             segment_ids=batch["segment_ids"]).logits
        if temperature != 1.0:
            logits = logits.astype(jnp.float32) / temperature
        return token_logps(logits, batch["targets"])

    return logps


def make_grpo_loss_fn(model: Any, model_params: Callable[[Params], Params], *,
                      loss_type: str, clip_eps: float, kl_beta: float, max_tokens: int,
                      temperature: float = 1.0) -> Callable[[Params, Batch], tuple]:
    """``loss_sums(params, batch) -> (objective, (objective, 0, count, stats))``, the contract
    of ``step.make_train_step``'s ``loss_fn`` (sums; the step divides by ``count``).

    ``batch`` holds ``inputs``, ``targets``, ``positions``, ``segment_ids`` and ``mask`` [B, T]
    (``mask`` 1 on completion targets), ``old_logps`` and ``ref_logps`` [B, T] and
    ``advantages`` [B]. ``stats`` are sums normalised as the loss (divide by ``count``):
    ``kl``, ``clip_fraction``; and ``tokens`` (completion tokens).
    """
    def loss_sums(params: Params, batch: Batch):
        logps = make_logps_fn(model, temperature)(model_params(params), batch)
        loss, kl, clipped = token_terms(
            logps, batch["old_logps"], batch["ref_logps"] if kl_beta else None,
            batch["advantages"], clip_eps=clip_eps, kl_beta=kl_beta)
        mask = batch["mask"]
        objective, count = normalised_sum(loss, mask, loss_type, max_tokens)
        stats = {"kl": normalised_sum(kl, mask, loss_type, max_tokens)[0],
                 "clip_fraction": normalised_sum(clipped, mask, loss_type, max_tokens)[0],
                 "tokens": jnp.sum(mask.astype(jnp.float32))}
        return objective, (objective, jnp.zeros((), jnp.float32), count,
                           jax.lax.stop_gradient(stats))

    return loss_sums


def grpo_metrics(stats: dict[str, jax.Array], count: jax.Array) -> dict[str, jax.Array]:
    """The step's summed ``stats`` over the loss's ``count`` (``tokens`` stays a count)."""
    return {k: v if k == "tokens" else v / count for k, v in stats.items()}


__all__ = ["ADVANTAGE_EPS", "GRPO_LOSSES", "grpo_metrics", "group_advantages",
           "make_grpo_loss_fn", "make_logps_fn", "normalised_sum", "token_terms"]
