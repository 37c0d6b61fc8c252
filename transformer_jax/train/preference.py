"""DPO and ORPO: the losses as pure functions (after TRL's; formulas in docs/fine-tuning.md)
and the objectives a run trains with (``DPO``, ``ORPO``), with DPO's reference log-probs.

Shapes: B rows, T tokens, V vocabulary, M pairs per row (pair k of a row is segments 2k + 1
(chosen) and 2k + 2 (rejected)), P pairs (any leading shape).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.data.instruct import count, row_indices
from transformer_jax.data.preference import (
    PreferenceRows,
    group_pairs,
    is_preference_file,
    load_preference_data,
    pair_batch,
)
from transformer_jax.model import lora
from transformer_jax.model.config import ModelConfig
from transformer_jax.parallel import distributed
from transformer_jax.parallel import sharding as sharding_lib
from transformer_jax.tokenizer import TextTokenizer
from transformer_jax.train.config import DataConfig, TrainConfig
from transformer_jax.train.context import Batch, Objective, RunContext
from transformer_jax.train.data import RunData, split_index
from transformer_jax.train.objective import DPO_LOSSES
from transformer_jax.train.step import (
    Params,
    ParamsLayout,
    TrainState,
    _training_model,
    make_train_step,
)

logger = logging.getLogger(__name__)

#: Where a full fine-tuning DPO run stores its reference log-probs (in the run directory).
REFERENCE_FILE = "reference_logps.npz"


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
               rejected_tokens: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
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


def make_token_logps_fn(model: Any, temperature: float = 1.0
                        ) -> Callable[[Params, Batch], jax.Array]:
    """``logps(model_params, batch) -> [B, T]``: log-probs of ``batch["targets"]`` under
    ``model`` (a ``Transformer``) with the logits divided by ``temperature``."""
    def logps(model_params: Params, batch: Batch) -> jax.Array:
        logits = model.apply({"params": model_params}, batch["inputs"],
                             positions=batch["positions"], segment_ids=batch["segment_ids"]).logits
        if temperature != 1.0:
            logits = logits.astype(jnp.float32) / temperature
        return token_logps(logits, batch["targets"])

    return logps


def base_params(layout: ParamsLayout, params: Params) -> Params:
    """The frozen LoRA base's model params (adapters off, dequantised), without gradient."""
    base = params[lora.BASE]
    if layout.base_quant:
        from transformer_jax.model.quant import dequantize_params

        base = dequantize_params(base)
    return jax.lax.stop_gradient(base)


def make_logps_fn(model_config: ModelConfig, tc: TrainConfig, pairs_per_row: int
                  ) -> Callable[[Params, Batch], tuple[jax.Array, jax.Array]]:
    """``logps(model_params, batch, key="mask") -> (sums, counts)`` [B, M, 2] of each (pair,
    side) over ``batch[key]``'s targets; ``key=("mask", "sequence_mask")`` gives one such
    pair per key from one forward."""
    forward = make_token_logps_fn(_training_model(model_config, tc))

    def logps(model_params: Params, batch: Batch, key: str | tuple[str, ...] = "mask") -> Any:
        per_token = forward(model_params, batch)
        keys = (key,) if isinstance(key, str) else key
        out = [sequence_logps(per_token, batch[k], batch["segment_ids"], pairs_per_row)
               for k in keys]
        return out[0] if isinstance(key, str) else out

    return logps


class Preference(Objective):
    """DPO and ORPO: a loss summed over the batch's pairs (their count divides it). ``batch``
    has SFT's keys plus ``pair_ids`` [B, M] (full-fine-tuning DPO: ``ref_logps`` [B, M, 2]).
    A subclass gives ``pair_loss(logps, layout, params, batch, valid) -> (objective, stats)``."""

    records = '{"prompt", "chosen", "rejected"}'

    def load_data(self, data_config: DataConfig, tokenizer: TextTokenizer) -> RunData:
        """Reads, packs and splits the pairs; refuses a file whose first record is not a pair."""
        files, seq_len = data_config.instruction_files(), self.tc.seq_len
        for file in files:
            if not is_preference_file(file):
                raise ValueError(f"train.objective={self.tc.objective} needs preference records "
                                 f"{self.records}; {file} holds other records (its first record "
                                 "lacks those keys)")
        pairs = load_preference_data(files, tokenizer, seq_len)
        train, val = split_index(pairs.rows.num_rows, data_config.val_fraction)
        logger.info("preference data (%s): %s in %s of %d tokens: %d train / %d val rows",
                    files[0] if len(files) == 1 else f"{len(files)} files",
                    count(pairs.num_pairs, "pair"), count(pairs.rows.num_rows, "packed row"),
                    seq_len + 1, len(train), 0 if val is None else len(val))
        kept = pairs.take(train)
        return RunData(train_rows=kept.rows, val_rows=None if val is None else
                       pairs.take(val).rows, pairs=kept)

    def settle(self, data: RunData, num_batch_devices: int) -> tuple[RunData, TrainConfig]:
        """With ``train.pairs_per_step``: the pairs grouped by step, ``batch_size`` their rows."""
        tc, pairs = self.tc, data.pairs
        kept = int(pairs.row_pairs.sum())
        if not tc.pairs_per_step:
            per_step = step_pair_counts(pairs, tc)
            logger.info("train.batch_size=%d packed rows a step hold %d-%d pairs (%.1f on "
                        "average over the first %s; up to %d a row): a TRL recipe's batch "
                        "counts pairs, train.pairs_per_step=N trains on exactly N a step",
                        tc.batch_size, per_step.min(), per_step.max(), per_step.mean(),
                        count(len(per_step), "step"), pairs.pairs_per_row)
            return data, tc
        n = tc.pairs_per_step
        grouped = group_pairs(pairs, n, tc.seed, num_batch_devices * tc.grad_accum)
        self.tc = tc = dataclasses.replace(tc, batch_size=grouped.step_rows)
        steps, rest = -(-kept // n), kept % n
        if kept <= n:
            which = f"all {kept} pairs of the data (fewer than {n}: an epoch is one step)"
        else:
            which = f"{n} pairs" + (f" (the last of each epoch's {steps} steps on {rest})"
                                    if rest else f" (an epoch is {steps} steps)")
        logger.info("train.pairs_per_step=%d: each step trains on %s, packed into "
                    "train.batch_size=%d rows of %d tokens (%.1f hold pairs, on average; "
                    "the others are padding)", n, which, tc.batch_size, tc.seq_len + 1,
                    (grouped.row_pairs > 0).sum() / steps)
        return dataclasses.replace(data, pairs=grouped), tc

    def step_fn(self, model_config: ModelConfig, data: RunData) -> Callable[..., Any]:
        loss_fn = self.loss_fn(model_config, data.pairs.pairs_per_row)
        return make_train_step(model_config, self.tc, loss_fn=loss_fn)

    def loss_fn(self, model_config: ModelConfig, pairs_per_row: int
                ) -> Callable[[Params, Batch], tuple[jax.Array, tuple]]:
        """``loss_sums(params, batch)`` of the objective (see the class)."""
        layout = ParamsLayout.of(self.tc)
        logps = make_logps_fn(model_config, self.tc, pairs_per_row)

        def loss_sums(params: Params, batch: Batch):
            valid = (batch["pair_ids"] >= 0).astype(jnp.float32)  # [B, M]
            objective, stats = self.pair_loss(logps, layout, params, batch, valid)
            stats.update(tokens=jnp.sum(batch["mask"].astype(jnp.float32)), pairs=jnp.sum(valid))
            return objective, (objective, jnp.zeros((), jnp.float32), jnp.sum(valid), stats)

        return loss_sums


class DPO(Preference):
    """DPO (``train.dpo_loss``: sigmoid or IPO) against a reference: the initial weights'
    log-probs, stored (full fine-tuning), or the frozen LoRA base with the adapters off."""

    def start(self, run: RunContext, state: TrainState) -> None:
        """Attaches the reference log-probs (full fine-tuning): read from ``REFERENCE_FILE``,
        or computed at step 0 and stored; ValueError at a later step without them."""
        super().start(run, state)
        tc = self.tc
        if tc.lora_rank:
            logger.info("DPO reference log-probs: adapters-off (the frozen LoRA base, in the "
                        "same step; no second copy of the weights)")
            return
        path = run.files.local / REFERENCE_FILE
        # What the stored reference depends on: the data and the initial weights.
        key = hashlib.sha256(repr((run.data.fingerprint(), tc.init_from, tc.seed, tc.quant)
                                  ).encode()).hexdigest()
        step = int(state.step)
        if path.is_file():
            with np.load(path) as stored:
                if str(stored["key"]) == key:
                    logger.info("DPO reference log-probs: first-pass, restored from %s (%d "
                                "pairs)", path, len(stored["logps"]))
                    run.data = dataclasses.replace(run.data, reference=stored["logps"])
                    return
        if step:
            raise ValueError(f"{path}: the DPO reference log-probs of this run are missing or "
                             f"are another run's, and the run is at step {step} (its initial "
                             "weights are gone); start it again in a new train.run_dir")
        start = time.perf_counter()
        reference = reference_pass(run.model_config, tc, state.params, run.data.pairs,
                                   run.batch_sharding)
        if run.main_process:
            tmp = path.with_suffix(".tmp.npz")
            np.savez(tmp, logps=reference, key=np.asarray(key))
            os.replace(tmp, path)
        logger.info("DPO reference log-probs: first-pass over %d pairs with the initial "
                    "weights (%.1f s), stored in %s", len(reference),
                    time.perf_counter() - start, path)
        run.data = dataclasses.replace(run.data, reference=reference)

    def pair_loss(self, logps: Callable[..., Any], layout: ParamsLayout, params: Params,
                  batch: Batch, valid: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        tc = self.tc
        sums, counts = logps(layout.model_params(params), batch)
        ref = (batch["ref_logps"] if layout.lora_config is None
               else logps(base_params(layout, params), batch)[0])
        losses, chosen, rejected = dpo_losses(
            sums[..., 0], sums[..., 1], ref[..., 0], ref[..., 1], beta=tc.dpo_beta,
            label_smoothing=tc.dpo_label_smoothing, loss_type=tc.dpo_loss,
            chosen_tokens=counts[..., 0], rejected_tokens=counts[..., 1])
        return jnp.sum(losses * valid), reward_stats(chosen, rejected, valid)


class ORPO(Preference):
    """ORPO (no reference). Its NLL is the mean over every target of the micro-batch's chosen
    sequences (``sequence_mask``), weighted by its pairs: with ``grad_accum = 1`` exactly TRL's
    ``nll - lambda * mean(log sigmoid(log_odds))``."""

    def start(self, run: RunContext, state: TrainState) -> None:
        super().start(run, state)
        logger.info("ORPO: no reference model (the odds ratio of the policy's own log-probs)")

    def pair_loss(self, logps: Callable[..., Any], layout: ParamsLayout, params: Params,
                  batch: Batch, valid: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        lam = self.tc.orpo_lambda
        (sums, counts), (full, full_counts) = logps(layout.model_params(params), batch,
                                                    ("mask", "sequence_mask"))
        pairs = jnp.sum(valid)
        # A padded pair's means are set to -1 so nothing there is infinite.
        means = jnp.where(valid[..., None] > 0, sums / jnp.maximum(counts, 1.0), -1.0)
        ratio, log_odds = orpo_odds_ratio(means[..., 0], means[..., 1])
        nll = -jnp.sum(full[..., 0] * valid) / jnp.maximum(
            jnp.sum(full_counts[..., 0] * valid), 1.0)
        rewards = jax.lax.stop_gradient(lam * means)
        stats = {**reward_stats(rewards[..., 0], rewards[..., 1], valid),
                 "nll_loss": pairs * nll, "log_odds": jnp.sum(log_odds * valid)}
        return pairs * nll - lam * jnp.sum(ratio * valid), stats


def step_pair_counts(pairs: PreferenceRows, tc: TrainConfig, most: int = 10_000) -> np.ndarray:
    """[S] the pairs of each of the first S steps' batches (an epoch, at most ``most``)."""
    per_row = pairs.row_pairs
    steps = min(-(-len(per_row) // tc.batch_size), tc.steps, most)
    return np.asarray([per_row[row_indices(tc.seed, s, tc.batch_size, len(per_row))].sum()
                       for s in range(steps)])


def reference_pass(model_config: ModelConfig, tc: TrainConfig, params: Params,
                   pairs: PreferenceRows, batch_sharding: Any) -> np.ndarray:
    """Summed completion log-probs of every pair under ``params`` (a train state's), rows in
    order in batches of ``train.batch_size``: [num_pairs, 2] float32 (chosen, rejected; 0 for
    a pair that was dropped)."""
    layout = ParamsLayout.of(tc)
    logps = make_logps_fn(model_config, tc, pairs.pairs_per_row)
    forward = jax.jit(lambda p, b: logps(layout.model_params(p), b)[0],
                      out_shardings=sharding_lib.replicated(batch_sharding.mesh))
    size = tc.batch_size
    part, parts = distributed.process_batch_shard(batch_sharding, size)
    local = size // parts
    mine = slice(part * local, (part + 1) * local)
    out = np.zeros((pairs.num_pairs, 2), np.float32)
    num_rows = pairs.rows.num_rows
    for start in range(0, num_rows, size):
        index = np.arange(start, start + size)
        real = index < num_rows
        host = pair_batch(pairs, np.where(real, index, 0))
        forward_keys = ("inputs", "targets", "segment_ids", "positions", "mask")
        batch = distributed.global_batch({k: host[k][mine] for k in forward_keys},
                                         batch_sharding, size)
        sums = np.asarray(forward(params, batch))[real]
        ids = host["pair_ids"][real]
        out[ids[ids >= 0]] = sums[ids >= 0]
    return out


__all__ = ["DPO", "DPO_LOSSES", "ORPO", "REFERENCE_FILE", "Preference", "base_params",
           "dpo_losses", "log1mexp", "make_logps_fn", "make_token_logps_fn", "orpo_odds_ratio",
           "reference_pass", "reward_stats", "sequence_logps", "step_pair_counts", "token_logps"]
