"""DPO / ORPO in a run: the objective's loss and train step, and the reference log-probs.

The step is ``step.make_train_step`` with the loss of ``make_preference_loss_fn``: its sums are
over the batch's pairs and divided by their count, so grad accumulation and the mesh work as
for SFT (the batch is sharded over its rows; both sides of a pair are in one row).

DPO's reference (``attach_reference``):

* full fine-tuning: the initial weights' summed completion log-probs of every pair, computed
  in a first pass before the first step and stored in ``run_dir/reference_logps.npz`` (keyed by
  the data, ``train.init_from`` and the seed), so a resumed run reads exactly the same values;
  each batch then carries ``ref_logps`` [B, M, 2];
* LoRA: the frozen base with the adapters off, run in the same step (no second copy).

ORPO has no reference.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.data.preference import PreferenceRows, pair_batch
from transformer_jax.model import lora
from transformer_jax.model.config import ModelConfig
from transformer_jax.parallel import distributed
from transformer_jax.parallel import sharding as sharding_lib
from transformer_jax.train.config import DataConfig, TrainConfig
from transformer_jax.train.preference import (
    dpo_losses,
    orpo_odds_ratio,
    reward_stats,
    sequence_logps,
    token_logps,
)
from transformer_jax.train.step import ParamsLayout, _training_model, make_train_step

logger = logging.getLogger(__name__)

Params = dict[str, Any]
Batch = dict[str, jax.Array]

#: Where a full fine-tuning DPO run stores its reference log-probs (in the run directory).
REFERENCE_FILE = "reference_logps.npz"
#: The batch keys the model's forward reads.
FORWARD_KEYS = ("inputs", "targets", "segment_ids", "positions", "mask")


def check_objective_data(tc: TrainConfig, data_config: DataConfig) -> None:
    """Raises for a preference objective without ``.jsonl`` data (one line)."""
    if (tc.is_preference or tc.is_grpo) and not data_config.is_instruct:
        records = ('{"messages"} or {"prompt"} (GRPO prompts)' if tc.is_grpo else
                   '{"prompt", "chosen", "rejected"}')
        raise ValueError(f"train.objective={tc.objective} needs data.path=FILE.jsonl of "
                         f"{records} records, got data.path={data_config.path!r}")


def base_params(layout: ParamsLayout, params: Params) -> Params:
    """The model params of a LoRA state's frozen base, adapters off (dequantised if stored
    quantised), without gradient."""
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
    model = _training_model(model_config, tc)

    def logps(model_params: Params, batch: Batch, key: str | tuple[str, ...] = "mask") -> Any:
        logits = model.apply({"params": model_params}, batch["inputs"],
                             positions=batch["positions"], segment_ids=batch["segment_ids"]).logits
        per_token = token_logps(logits, batch["targets"])
        keys = (key,) if isinstance(key, str) else key
        out = [sequence_logps(per_token, batch[k], batch["segment_ids"], pairs_per_row)
               for k in keys]
        return out[0] if isinstance(key, str) else out

    return logps


def make_preference_loss_fn(model_config: ModelConfig, tc: TrainConfig, pairs_per_row: int
                            ) -> Callable[[Params, Batch], tuple[jax.Array, tuple]]:
    """``loss_sums(params, batch) -> (objective, (objective, 0, pairs, stats))`` of
    ``train.objective`` (``step.make_loss_fn``'s contract, summed over the valid pairs).

    ``batch`` has SFT's keys plus ``pair_ids`` [B, M] (and, full-fine-tuning DPO,
    ``ref_logps`` [B, M, 2]). ``stats`` are sums over pairs (``reward_stats``; ORPO also
    ``nll_loss`` and ``log_odds``) and ``tokens``. ORPO's NLL is the mean over every target of
    the micro-batch's chosen sequences, prompt included (``sequence_mask``, as TRL's
    ``ORPOTrainer``), weighted by its pairs: with ``grad_accum = 1`` exactly TRL's
    ``nll - lambda * mean(log sigmoid(log_odds))``.
    """
    layout = ParamsLayout.of(tc)
    logps = make_logps_fn(model_config, tc, pairs_per_row)

    def loss_sums(params: Params, batch: Batch):
        if tc.objective == "orpo":
            (sums, counts), (full, full_counts) = logps(layout.model_params(params), batch,
                                                        ("mask", "sequence_mask"))
        else:
            sums, counts = logps(layout.model_params(params), batch)
        valid = (batch["pair_ids"] >= 0).astype(jnp.float32)  # [B, M]
        pairs = jnp.sum(valid)
        tokens = jnp.sum(batch["mask"].astype(jnp.float32))
        if tc.objective == "dpo":
            if layout.lora_config is not None:
                ref, _ = logps(base_params(layout, params), batch)
            else:
                ref = batch["ref_logps"]
            losses, chosen, rejected = dpo_losses(
                sums[..., 0], sums[..., 1], ref[..., 0], ref[..., 1], beta=tc.dpo_beta,
                label_smoothing=tc.dpo_label_smoothing, loss_type=tc.dpo_loss,
                chosen_tokens=counts[..., 0], rejected_tokens=counts[..., 1])
            objective = jnp.sum(losses * valid)
            stats = reward_stats(chosen, rejected, valid)
        else:  # orpo; a padded pair's means are set to -1 so nothing there is infinite
            means = jnp.where(valid[..., None] > 0, sums / jnp.maximum(counts, 1.0), -1.0)
            ratio, log_odds = orpo_odds_ratio(means[..., 0], means[..., 1])
            nll = -jnp.sum(full[..., 0] * valid) / jnp.maximum(
                jnp.sum(full_counts[..., 0] * valid), 1.0)
            objective = pairs * nll - tc.orpo_lambda * jnp.sum(ratio * valid)
            rewards = jax.lax.stop_gradient(tc.orpo_lambda * means)
            stats = {**reward_stats(rewards[..., 0], rewards[..., 1], valid),
                     "nll_loss": pairs * nll, "log_odds": jnp.sum(log_odds * valid)}
        stats["tokens"] = tokens
        return objective, (objective, jnp.zeros((), jnp.float32), pairs, stats)

    return loss_sums


def pair_metrics(stats: dict[str, jax.Array], pairs: jax.Array) -> dict[str, jax.Array]:
    """The step's summed ``stats`` as means over its pairs (``tokens`` stays a count)."""
    return {k: v if k == "tokens" else v / pairs for k, v in stats.items()}


def make_objective_step(model_config: ModelConfig, tc: TrainConfig, data: Any
                        ) -> Callable[..., Any]:
    """The run's pure train step: SFT's, or the preference objective's over ``data.pairs``."""
    if not tc.is_preference:
        return make_train_step(model_config, tc)
    loss_fn = make_preference_loss_fn(model_config, tc, data.pairs.pairs_per_row)
    return make_train_step(model_config, tc, loss_fn=loss_fn, aux_metrics=pair_metrics)


def reference_pass(model_config: ModelConfig, tc: TrainConfig, params: Params,
                   pairs: PreferenceRows, batch_sharding: Any) -> np.ndarray:
    """Summed completion log-probs of every pair under ``params`` (a train state's), rows in
    order in batches of ``train.batch_size``: [num_pairs, 2] float32 (chosen, rejected; 0 for
    a pair that was dropped)."""
    layout = ParamsLayout.of(tc)
    logps = make_logps_fn(model_config, tc, pairs.pairs_per_row)
    mesh = batch_sharding.mesh
    forward = jax.jit(lambda p, b: logps(layout.model_params(p), b)[0],
                      out_shardings=sharding_lib.replicated(mesh))
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
        batch = distributed.global_batch({k: host[k][mine] for k in FORWARD_KEYS},
                                         batch_sharding, size)
        sums = np.asarray(forward(params, batch))[real]
        ids = host["pair_ids"][real]
        out[ids[ids >= 0]] = sums[ids >= 0]
    return out


def reference_key(tc: TrainConfig, data: Any) -> str:
    """What the stored reference depends on: the data and the initial weights."""
    return hashlib.sha256(repr((data.fingerprint(), tc.init_from, tc.seed, tc.quant)
                               ).encode()).hexdigest()


def attach_reference(data: Any, tc: TrainConfig, model_config: ModelConfig, state: Any,
                     batch_sharding: Any, run_dir: Path, main_process: bool) -> Any:
    """``data`` with DPO's stored reference log-probs when the run needs them (full fine-tuning
    DPO), loaded from ``run_dir/REFERENCE_FILE`` or computed by ``reference_pass`` from the
    state at step 0 and stored; logs the reference's source once.

    Raises:
      ValueError: a resumed run (step > 0) whose stored reference is missing or is another
        run's (the initial weights are gone, so it cannot be recomputed here).
    """
    if not tc.is_preference:
        return data
    if tc.objective == "orpo":
        logger.info("ORPO: no reference model (the odds ratio of the policy's own log-probs)")
        return data
    if tc.lora_rank:
        logger.info("DPO reference log-probs: adapters-off (the frozen LoRA base, in the same "
                    "step; no second copy of the weights)")
        return data
    path = run_dir / REFERENCE_FILE
    key = reference_key(tc, data)
    step = int(state.step)
    if path.is_file():
        with np.load(path) as stored:
            if str(stored["key"]) == key:
                logger.info("DPO reference log-probs: first-pass, restored from %s (%d pairs)",
                            path, len(stored["logps"]))
                return dataclasses.replace(data, reference=stored["logps"])
    if step:
        raise ValueError(f"{path}: the DPO reference log-probs of this run are missing or are "
                         f"another run's, and the run is at step {step} (its initial weights "
                         "are gone); start it again in a new train.run_dir")
    start = time.perf_counter()
    reference = reference_pass(model_config, tc, state.params, data.pairs, batch_sharding)
    if main_process:
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, logps=reference, key=np.asarray(key))
        os.replace(tmp, path)
    logger.info("DPO reference log-probs: first-pass over %d pairs with the initial weights "
                "(%.1f s), stored in %s", len(reference), time.perf_counter() - start, path)
    return dataclasses.replace(data, reference=reference)


__all__ = ["REFERENCE_FILE", "attach_reference", "base_params", "check_objective_data",
           "make_logps_fn", "make_objective_step", "make_preference_loss_fn", "pair_metrics",
           "reference_pass"]
