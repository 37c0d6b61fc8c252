"""GRPO: the loss as pure functions (after TRL's ``GRPOTrainer``; formulas in
docs/fine-tuning.md) and the objective a run trains with (``GRPO``): each step refreshes the
engine's weights, samples G completions per prompt (pure in (seed, step)), scores them, updates.

Shapes: B rows (a prompt then one completion, padded), T tokens, V vocabulary, P prompts,
G completions per prompt (B = P G, a prompt's G rows consecutive).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.data.instruct import row_indices
from transformer_jax.decode.weights import prepare
from transformer_jax.model.config import ModelConfig
from transformer_jax.parallel import distributed
from transformer_jax.serving.engine import Engine
from transformer_jax.serving.page_pool import pages_for
from transformer_jax.serving.paged_cache import page_bytes
from transformer_jax.serving.requests import SamplingParams
from transformer_jax.serving.scheduler import chunk_buckets, row_bucket
from transformer_jax.tokenizer import TextTokenizer
from transformer_jax.train.config import DataConfig, TrainConfig
from transformer_jax.train.context import Batch, Objective, RunContext
from transformer_jax.train.data import RunData
from transformer_jax.train.grpo_data import (
    PromptRecord,
    load_prompts,
    load_rewards,
    rollout_seeds,
    score,
)
from transformer_jax.train.memory import available_bytes
from transformer_jax.train.objective import GRPO_LOSSES
from transformer_jax.train.preference import base_params
from transformer_jax.train.preference import make_token_logps_fn as make_logps_fn
from transformer_jax.train.step import (
    Params,
    ParamsLayout,
    TrainState,
    _training_model,
    make_train_step,
)

logger = logging.getLogger(__name__)

#: Added to a group's reward std before dividing (TRL's).
ADVANTAGE_EPS = 1e-4
#: Positions per page of the rollout engine's KV pool.
PAGE_SIZE = 16
#: The most of one device's memory the rollout engine's pages may take.
ROLLOUT_MEMORY_SHARE = 0.25
#: The most prompt tokens (padding included) one rollout engine step prefills.
MAX_ROLLOUT_CHUNK = 4096


def group_advantages(rewards: np.ndarray, group_size: int, scale: bool = True) -> np.ndarray:
    """Advantages [P G] from rewards [P G]: ``r - mean`` over each group of G, divided by
    ``std + ADVANTAGE_EPS`` when ``scale``."""
    r = np.asarray(rewards, np.float64).reshape(-1, group_size)
    centred = r - r.mean(axis=1, keepdims=True)
    if scale:
        std = r.std(axis=1, ddof=1, keepdims=True) if group_size > 1 else np.zeros_like(r)
        centred = centred / (std + ADVANTAGE_EPS)
    return centred.reshape(-1).astype(np.float32)


def token_terms(logps: jax.Array, old_logps: jax.Array, ref_logps: jax.Array | None,
                advantages: jax.Array, *, clip_eps: float, kl_beta: float
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The clipped objective per token, ``-min(ratio A, clip(ratio, 1 - eps, 1 + eps) A) +
    kl_beta k3``, ``ratio = exp(logp - old_logp)``, ``k3 = exp(ref - logp) - (ref - logp) - 1``.

    Args:
      logps: [B, T] the policy's log-probs of the sampled tokens (differentiated).
      old_logps: [B, T] those of the policy that sampled them.
      ref_logps: [B, T] the reference's, or None (``kl_beta = 0``).
      advantages: [B] one per completion.
      clip_eps, kl_beta: the clip's eps and the k3 KL penalty's weight.

    Returns:
      ``(loss, kl, clipped)``, each [B, T] float32: the per-token loss, the k3 estimate (0
      without a reference) and 1 where the clip is active.
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
    """``(total, count)``, both sums, with ``total / count`` the batch's loss under ``loss_type``.

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


def make_grpo_loss_fn(model: Any, model_params: Callable[[Params], Params], *,
                      loss_type: str, clip_eps: float, kl_beta: float, max_tokens: int,
                      temperature: float = 1.0) -> Callable[[Params, Batch], tuple]:
    """``loss_sums(params, batch) -> (objective, (objective, 0, count, stats))``, the contract
    of ``step.make_train_step``'s ``loss_fn``. ``batch`` holds SFT's keys [B, T] (``mask`` 1 on
    completion targets), ``old_logps`` and ``ref_logps`` [B, T] and ``advantages`` [B]; the
    stats are ``kl``, ``clip_fraction`` (normalised as the loss) and ``tokens``."""
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


class Samples(NamedTuple):
    """One step's completions in row order (a prompt's G rows consecutive: row r's is r // G)."""

    prompts: list[np.ndarray]  # each row's prompt ids
    completions: list[list[int]]  # each row's sampled ids
    logprobs: list[list[float]]  # the engine's log-probs of them


def sample(engine: Engine, prompts: list[PromptRecord], tc: TrainConfig, step: int, eos_id: int
           ) -> Samples:
    """G completions of each prompt (``PromptRecord``s) from ``engine``, in row order."""
    g = tc.grpo_group_size
    stop = (eos_id,) if eos_id >= 0 else ()
    ids, rows = [], []
    for r, seed in enumerate(rollout_seeds(tc.seed, step, len(prompts) * g)):
        prompt = prompts[r // g].tokens
        params = SamplingParams(max_tokens=tc.grpo_max_tokens, temperature=tc.grpo_temperature,
                                seed=seed, logprobs=True, stop_token_ids=stop)
        ids.append(engine.add_request(prompt.tolist(), params))
        rows.append(prompt)
    # Each request ends within its prompt's chunks and max_tokens steps: a bound, not a hang.
    limit = len(ids) * (tc.grpo_max_tokens + 1 + -(-max(map(len, rows)) // 16))
    done = engine.run_until_idle(max_steps=limit)
    if not engine.idle:
        raise RuntimeError(f"rollouts unfinished after {limit} engine steps: "
                           f"{engine.scheduler.describe()}")
    return Samples(rows, [done[i].tokens for i in ids], [done[i].logprobs for i in ids])


def batch_length(prompts: list[np.ndarray], completions: list[list[int]], seq_len: int) -> int:
    """T of a step's batch: its longest row (prompt + completion, less one) rounded up to a
    power of two from 16, at most ``seq_len`` (``scheduler.chunk_buckets``)."""
    longest = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True)) - 1
    return next((t for t in chunk_buckets(seq_len) if t >= longest), seq_len)


def grpo_batch(prompts: list[np.ndarray], completions: list[list[int]],
               logprobs: list[list[float]], advantages: np.ndarray, seq_len: int
               ) -> dict[str, np.ndarray]:
    """The host batch: row b is prompt b + completion b, shifted by one (``inputs`` / ``targets``
    [B, T], T = ``seq_len``), ``mask`` 1 on the completion's targets, ``old_logps`` the
    engine's log-probs there, ``advantages`` [B]."""
    b = len(prompts)
    ids = ("inputs", "targets", "positions", "segment_ids")
    out = {k: np.zeros((b, seq_len), np.int32 if k in ids else np.float32)
           for k in (*ids, "mask", "old_logps")}
    out["positions"][:] = np.arange(seq_len)
    for i, (prompt, tokens, lps) in enumerate(zip(prompts, completions, logprobs, strict=True)):
        row = np.concatenate([prompt, np.asarray(tokens, np.int32)])
        n = len(row) - 1
        out["inputs"][i, :n] = row[:-1]
        out["targets"][i, :n] = row[1:]
        out["segment_ids"][i, :n] = 1
        start = len(prompt) - 1
        out["mask"][i, start:n] = 1.0
        out["old_logps"][i, start:n] = lps
    out["advantages"] = np.asarray(advantages, np.float32)
    return out


def completion_text(tokenizer: TextTokenizer, tokens: list[int]) -> str:
    """The text a reward reads: the completion without eos and ids past the vocabulary."""
    return tokenizer.decode([t for t in tokens if t != tokenizer.eos_id
                             and 0 <= t < tokenizer.vocab_size])


def make_engine(model_config: ModelConfig, params: Params, tc: TrainConfig, prompt_len: int
                ) -> Engine:
    """An engine on the first device for one step's rollouts: a slot per completion (fewer,
    at least G, past ``ROLLOUT_MEMORY_SHARE`` of its memory), prefilling all prompts at once."""
    row_pages = pages_for(prompt_len + tc.grpo_max_tokens, PAGE_SIZE)
    slots = tc.batch_size
    if (available := available_bytes(jax.devices()[0])) is not None:
        fit = (int(available[0] / available[1] * ROLLOUT_MEMORY_SHARE)
               // (row_pages * page_bytes(model_config, PAGE_SIZE)))
        slots = min(slots, max(tc.grpo_group_size, fit))
    prompts = -(-tc.batch_size // tc.grpo_group_size)
    chunk = max(64, min(row_bucket(prompts) * max(16, row_bucket(prompt_len)), MAX_ROLLOUT_CHUNK))
    weights = prepare(model_config, jax.device_put(params, jax.devices()[0]))
    return Engine(model_config, weights, num_slots=slots, num_pages=slots * row_pages + 2,
                  page_size=PAGE_SIZE, token_budget=slots + chunk)


class GRPO(Objective):
    """GRPO: a step's batch is its rollouts; its records add rewards, lengths and timings."""

    records = '{"messages"} or {"prompt"} (GRPO prompts)'
    on_policy = True
    fixed_shapes = False  # a batch is cut to its longest row's bucket (``batch_length``)

    def load_data(self, data_config: DataConfig, tokenizer: TextTokenizer) -> RunData:
        """The prompts (a bad one refused now: ``FILE:LINE``); the resume fingerprint's tokens."""
        self.prompts = load_prompts(data_config.path, tokenizer,
                                    self.tc.seq_len - self.tc.grpo_max_tokens)
        return RunData(train_tokens=np.concatenate([p.tokens for p in self.prompts]),
                       val_tokens=np.zeros(0, np.int32))

    def start(self, run: RunContext, state: TrainState) -> None:
        """Loads the rewards, makes the rollout engine and the KL reference."""
        super().start(run, state)
        tc = self.tc
        layout = ParamsLayout.of(tc)
        self.start_step = int(state.step)
        self.rewards = load_rewards(tc.reward)
        # A copy: the state's buffers are donated to the next step, the engine's must survive it.
        self.to_model = jax.jit(lambda p: jax.tree.map(jnp.copy, layout.model_params(p)))
        self.engine = make_engine(run.model_config, self.to_model(state.params), tc,
                                  max(len(p.tokens) for p in self.prompts))
        self.engine.update_weights(self.to_model(state.params))  # compiles the refresh now
        # ref_logps(state params, batch): the reference's log-probs of the batch.
        logps = make_logps_fn(_training_model(run.model_config, tc))
        if not tc.grpo_kl_beta:
            ref_source, self.ref_logps = "none (grpo_kl_beta=0)", lambda p, b: b["old_logps"]
        elif layout.lora_config is not None:
            ref_source = "adapters-off (the frozen LoRA base)"
            self.ref_logps = jax.jit(lambda p, b: logps(base_params(layout, p), b))
        else:
            ref_source = "the initial weights (in memory)"
            ref = (jax.tree.map(jnp.copy, state.params) if self.start_step == 0
                   else run.initial_state().params)
            ref_fn = jax.jit(logps)
            self.ref_logps = lambda p, b: ref_fn(ref, b)
        logger.info("GRPO: %d prompts, %d per step x G=%d, max %d completion tokens, reward %s; "
                    "KL reference: %s", len(self.prompts), tc.batch_size // tc.grpo_group_size,
                    tc.grpo_group_size, tc.grpo_max_tokens, tc.reward, ref_source)

    def step_fn(self, model_config: ModelConfig, data: RunData) -> Callable[..., Any]:
        tc = self.tc
        loss_fn = make_grpo_loss_fn(_training_model(model_config, tc),
                                    ParamsLayout.of(tc).model_params, loss_type=tc.grpo_loss,
                                    clip_eps=tc.grpo_clip_eps, kl_beta=tc.grpo_kl_beta,
                                    max_tokens=tc.grpo_max_tokens)
        return make_train_step(model_config, tc, loss_fn=loss_fn)

    def batch(self, step: int, state: TrainState) -> Batch:
        """Refreshes the engine's weights, samples and scores the step's completions."""
        tc, run = self.tc, self.run
        start = time.perf_counter()
        if step > self.start_step:  # the engine holds the state's weights at the start
            self.engine.update_weights(self.to_model(state.params))
            jax.block_until_ready(self.engine.weights.params)
        refreshed = time.perf_counter()
        per_step = tc.batch_size // tc.grpo_group_size
        chosen = [self.prompts[i] for i in row_indices(tc.seed, step, per_step, len(self.prompts))]
        samples = sample(self.engine, chosen, tc, step, run.tokenizer.eos_id)
        rewards = np.asarray([score(self.rewards, completion_text(run.tokenizer, c),
                                    chosen[r // tc.grpo_group_size])
                              for r, c in enumerate(samples.completions)], np.float32)
        scored = time.perf_counter()
        host = grpo_batch(samples.prompts, samples.completions, samples.logprobs,
                          group_advantages(rewards, tc.grpo_group_size, tc.grpo_scale_rewards),
                          batch_length(samples.prompts, samples.completions, tc.seq_len))
        part, parts = distributed.process_batch_shard(run.batch_sharding, tc.batch_size)
        local = tc.batch_size // parts
        batch = distributed.global_batch(
            {k: v[part * local:(part + 1) * local] for k, v in host.items()},
            run.batch_sharding, tc.batch_size)
        batch["ref_logps"] = self.ref_logps(state.params, batch)
        lengths = np.asarray([len(c) for c in samples.completions])
        # The step's record, its update's share of the time added by ``update``.
        self.marks = {"start": start, "refreshed": refreshed, "scored": scored}
        self.record = {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
                       "completion_len": float(lengths.mean()), "rollout_tokens_per_s":
                       float(lengths.sum() / max(scored - refreshed, 1e-9)),
                       "batch_len": int(host["inputs"].shape[1])}
        return batch

    def update(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, Any]]:
        """The update, its metrics read at once to time it (the next rollout waits anyway)."""
        state, metrics = self.train_step(state, batch)
        metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        m, end = self.marks, time.perf_counter()
        parts = {"refresh": m["refreshed"] - m["start"], "rollout": m["scored"] - m["refreshed"],
                 "update": end - m["scored"]}
        total = end - m["start"]  # the three parts' sum
        return state, {**metrics, **self.record, "time/step_s": total,
                       **{f"time/{k}_share": v / total for k, v in parts.items()}}

    def loss_unit(self, data_config: DataConfig) -> str:
        return "grpo"

    def describe(self, m: dict[str, float]) -> str:
        return (f"loss {m['loss']:.4f} reward {m['reward_mean']:.3f} +- {m['reward_std']:.3f} "
                f"kl {m['kl']:.4f} clip {m['clip_fraction']:.3f} len {m['completion_len']:.1f} "
                f"rollout {m['rollout_tokens_per_s']:.0f} tok/s; {m['time/step_s']:.2f} s "
                f"(rollout {100 * m['time/rollout_share']:.0f}%, refresh "
                f"{100 * m['time/refresh_share']:.1f}%, update "
                f"{100 * m['time/update_share']:.0f}%)")


__all__ = ["ADVANTAGE_EPS", "GRPO", "GRPO_LOSSES", "PAGE_SIZE", "Samples", "batch_length",
           "group_advantages", "grpo_batch", "make_engine", "make_grpo_loss_fn", "make_logps_fn",
           "normalised_sum", "sample", "token_terms"]
