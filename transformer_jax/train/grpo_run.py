"""GRPO in a run (``train.objective=grpo``): each step refreshes the serving engine's weights
from the train state in memory, samples G completions per prompt with it, scores them with the
reward functions, and takes one update of the clipped objective (``train.grpo``).

``run.run`` builds or restores the state as for any objective and hands over to ``train_grpo``.
The engine (``serving.Engine``) runs on the first device with the same forward as training, its
weights replaced by ``Engine.update_weights`` (one jitted prepare; no step program compiles
again). A step's prompts and every completion's sampling seed are functions of (seed, step), so
a resumed run samples exactly what an uninterrupted one would. The reference of the KL penalty is
the initial weights (kept in memory; recomputed from ``train.init_from`` or the seed after a
resume), or with LoRA the frozen base with the adapters off.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.checkpoint import loading
from transformer_jax.decode.weights import prepare
from transformer_jax.parallel import distributed
from transformer_jax.parallel import sharding as sharding_lib
from transformer_jax.serving.engine import Engine
from transformer_jax.serving.page_pool import pages_for
from transformer_jax.serving.paged_cache import page_bytes
from transformer_jax.serving.requests import SamplingParams
from transformer_jax.serving.scheduler import chunk_buckets, row_bucket
from transformer_jax.train.data import RunData
from transformer_jax.train.grpo import group_advantages, make_grpo_loss_fn, make_logps_fn
from transformer_jax.train.grpo import grpo_metrics as _grpo_metrics
from transformer_jax.train.grpo_data import (
    load_prompts,
    load_rewards,
    prompt_order,
    rollout_seeds,
    score,
)
from transformer_jax.train.log import RunSummary, StopOnSignal
from transformer_jax.train.memory import available_bytes
from transformer_jax.train.preference_run import base_params
from transformer_jax.train.step import ParamsLayout, _training_model, make_train_step

logger = logging.getLogger(__name__)

#: Positions per page of the rollout engine's KV pool.
PAGE_SIZE = 16
#: The most of one device's memory the rollout engine's pages may take.
ROLLOUT_MEMORY_SHARE = 0.25
#: The most prompt tokens (padding included) one rollout engine step prefills.
MAX_ROLLOUT_CHUNK = 4096
#: The keys of a GRPO batch (each [B, T], ``advantages`` [B]).
BATCH_KEYS = ("inputs", "targets", "positions", "segment_ids", "mask", "old_logps",
              "advantages")


def prompt_data(data_config: Any, tokenizer: Any, tc: Any) -> RunData:
    """The run's data for the checks and the resume fingerprint: the prompts' tokens (read
    again by ``train_grpo``); refuses bad records now (``FILE:LINE``)."""
    prompts = load_prompts(data_config.path, tokenizer, tc.seq_len - tc.grpo_max_tokens)
    return RunData(train_tokens=np.concatenate([p.tokens for p in prompts]),
                   val_tokens=np.zeros(0, np.int32))


@dataclasses.dataclass
class Rollout:
    """One step's completions: token ids, the engine's log-probs of them, rewards."""

    prompts: list[np.ndarray]  # [B] prompt ids (a prompt's G rows consecutive)
    completions: list[list[int]]
    logprobs: list[list[float]]
    rewards: np.ndarray  # [B]
    seconds: float


def sample(engine: Engine, prompts: list, tc: Any, step: int, eos_id: int
           ) -> tuple[list[np.ndarray], list[list[int]], list[list[float]], list[int]]:
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
    return (rows, [done[i].tokens for i in ids], [done[i].logprobs for i in ids],
            [r // g for r in range(len(ids))])


def batch_length(prompts: list[np.ndarray], completions: list[list[int]], seq_len: int) -> int:
    """T of a step's batch: its longest row (prompt + completion, less one) rounded up to a
    power of two from 16, at most ``seq_len`` (``scheduler.chunk_buckets``), so the update and
    the log-prob passes compile once per bucket and do not run ``seq_len`` when rows are
    short (as TRL pads to the batch's longest)."""
    longest = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True)) - 1
    buckets = chunk_buckets(seq_len)
    return next((t for t in buckets if t >= longest), seq_len)


def grpo_batch(prompts: list[np.ndarray], completions: list[list[int]],
               logprobs: list[list[float]], advantages: np.ndarray, seq_len: int
               ) -> dict[str, np.ndarray]:
    """The host batch of completions: row b is prompt b + completion b, shifted by one
    (``inputs`` / ``targets`` [B, T], T = ``seq_len``), ``mask`` 1 on the completion's
    targets, ``old_logps`` the engine's log-probs there, ``advantages`` [B]."""
    b = len(prompts)
    out = {k: np.zeros((b, seq_len), np.int32) for k in
           ("inputs", "targets", "positions", "segment_ids")}
    out["mask"] = np.zeros((b, seq_len), np.float32)
    out["old_logps"] = np.zeros((b, seq_len), np.float32)
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


def completion_text(tokenizer: Any, tokens: list[int]) -> str:
    """The text a reward reads: the completion without eos, ids past the tokenizer's
    vocabulary (a padded embedding's rows) left out."""
    return tokenizer.decode([t for t in tokens if t != tokenizer.eos_id
                             and 0 <= t < tokenizer.vocab_size])


def rollout_slots(model_config: Any, tc: Any, prompt_len: int) -> int:
    """The rollout engine's slots: one per completion of a step (the batch), so that every
    prompt is prefilled in the first engine steps, its G completions forked from it, and all
    decode together; fewer (at least G) when their pages would take more than
    ``ROLLOUT_MEMORY_SHARE`` of the first device's memory."""
    per_slot = pages_for(prompt_len + tc.grpo_max_tokens, PAGE_SIZE) * page_bytes(
        model_config, PAGE_SIZE)
    slots = tc.batch_size
    available = available_bytes(jax.devices()[0])
    if available is not None:
        fit = int(available[0] / available[1] * ROLLOUT_MEMORY_SHARE) // per_slot
        slots = min(slots, max(tc.grpo_group_size, fit))
    return slots


def make_engine(model_config: Any, params: Any, tc: Any, prompt_len: int) -> Engine:
    """An engine on the first device for one step's rollouts (``rollout_slots``), whose steps
    prefill up to all of a step's prompts at once (R rows of the longest prompt's bucket, at
    most ``MAX_ROLLOUT_CHUNK`` tokens): a step of ``bench grpo`` (32 prompts x G = 8, 4
    tokens) is a prefill step and 3 decode steps, where one prompt a step took some 35."""
    slots = rollout_slots(model_config, tc, prompt_len)
    pages = slots * pages_for(prompt_len + tc.grpo_max_tokens, PAGE_SIZE) + 2
    prompts = -(-tc.batch_size // tc.grpo_group_size)
    chunk = max(64, min(row_bucket(prompts) * max(16, row_bucket(prompt_len)),
                        MAX_ROLLOUT_CHUNK))
    weights = prepare(model_config, jax.device_put(params, jax.devices()[0]))
    return Engine(model_config, weights, num_slots=slots, num_pages=pages, page_size=PAGE_SIZE,
                  token_budget=slots + chunk)


def initial_model_params(model_config: Any, state: Any, start_step: int, initial: tuple
                         ) -> Any:
    """The reference's params (full fine-tuning): the state's at step 0 (copied), else the
    initial weights made again from ``train.init_from`` or the seed."""
    if start_step == 0:
        return jax.tree.map(jnp.copy, state.params)
    init, key, source, mesh, state_shardings = initial
    if source is None:
        return sharding_lib.shard_init(init, state_shardings)(key).params
    params = loading.load(source, mesh, scan_layers=model_config.scan_layers,
                          dtype=model_config.param_dtype, with_tokenizer=False).params
    return jax.jit(init, out_shardings=state_shardings)(key, params).params


def train_grpo(model_config: Any, tc: Any, data_config: Any, files: Any, ckpt: Any,
               state: Any, batch_sharding: Any, tokenizer: Any, configs: dict,
               main_process: bool, times: dict, wall_start: float, initial: tuple) -> Any:
    """The GRPO loop from ``state`` to ``train.steps``; returns ``log.RunSummary``.

    ``initial`` is ``(init, key, source, mesh, state_shardings)`` of ``run.run``: the state's
    shardings, and what makes the initial weights again after a resume (the KL reference of
    full fine-tuning)."""
    run_dir: Path = files.local
    layout = ParamsLayout.of(tc)
    start_step = step = int(state.step)
    state_shardings = initial[4]
    prompts = load_prompts(data_config.path, tokenizer, tc.seq_len - tc.grpo_max_tokens)
    rewards = load_rewards(tc.reward)
    per_step = tc.batch_size // tc.grpo_group_size
    longest = max(len(p.tokens) for p in prompts)
    model = _training_model(model_config, tc)
    # A copy: the state's buffers are donated to the next step, the engine's must survive it.
    to_model = jax.jit(lambda p: jax.tree.map(jnp.copy, layout.model_params(p)))
    engine = make_engine(model_config, to_model(state.params), tc, longest)
    engine.update_weights(to_model(state.params))  # compiles the refresh before the loop
    loss_fn = make_grpo_loss_fn(model, layout.model_params, loss_type=tc.grpo_loss,
                                clip_eps=tc.grpo_clip_eps, kl_beta=tc.grpo_kl_beta,
                                max_tokens=tc.grpo_max_tokens)
    train_step = sharding_lib.jit_train_step(
        make_train_step(model_config, tc, loss_fn=loss_fn, aux_metrics=_grpo_metrics),
        state_shardings, batch_sharding)
    logps = make_logps_fn(model)
    ref_params = None
    if not tc.grpo_kl_beta:
        ref_source, ref_fn = "none (grpo_kl_beta=0)", None
    elif layout.lora_config is not None:
        ref_source = "adapters-off (the frozen LoRA base)"
        ref_fn = jax.jit(lambda p, b: logps(base_params(layout, p), b))
    else:
        ref_source = "the initial weights (in memory)"
        ref_params = initial_model_params(model_config, state, start_step, initial)
        ref_fn = jax.jit(logps)
    logger.info("GRPO: %d prompts, %d per step x G=%d, max %d completion tokens, reward %s; "
                "KL reference: %s", len(prompts), per_step, tc.grpo_group_size,
                tc.grpo_max_tokens, tc.reward, ref_source)
    part, parts = distributed.process_batch_shard(batch_sharding, tc.batch_size)
    local = tc.batch_size // parts
    metrics_path = run_dir / "metrics.jsonl"
    last: dict[str, float] = {}
    interrupted = None
    shares = {"rollout": 0.0, "refresh": 0.0, "update": 0.0}
    timed = 0
    loop_start = time.perf_counter()
    with StopOnSignal() as stop:
        while step < tc.steps:
            t0 = time.perf_counter()
            if step > start_step:  # the engine holds the state's weights at the start
                engine.update_weights(to_model(state.params))
                jax.block_until_ready(engine.weights.params)
            t1 = time.perf_counter()
            chosen = [prompts[i] for i in prompt_order(len(prompts), per_step, step, tc.seed)]
            rows, completions, lps, owner = sample(engine, chosen, tc, step, tokenizer.eos_id)
            texts = [completion_text(tokenizer, c) for c in completions]
            reward = np.asarray([score(rewards, text, chosen[o])
                                 for text, o in zip(texts, owner, strict=True)], np.float32)
            t2 = time.perf_counter()
            adv = group_advantages(reward, tc.grpo_group_size, tc.grpo_scale_rewards)
            host = grpo_batch(rows, completions, lps, adv,
                              batch_length(rows, completions, tc.seq_len))
            batch = distributed.global_batch(
                {k: v[part * local:(part + 1) * local] for k, v in host.items()},
                batch_sharding, tc.batch_size)
            if ref_fn is None:
                batch["ref_logps"] = batch["old_logps"]
            else:
                batch["ref_logps"] = ref_fn(state.params if ref_params is None else ref_params,
                                            batch)
            state, metrics = train_step(state, batch)
            metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
            t3 = time.perf_counter()
            step += 1
            total = t3 - t0
            lengths = np.asarray([len(c) for c in completions])
            last = {"step": step, **metrics, "reward_mean": float(reward.mean()),
                    "reward_std": float(reward.std()), "completion_len": float(lengths.mean()),
                    "rollout_tokens_per_s": float(lengths.sum() / max(t2 - t1, 1e-9)),
                    "batch_len": int(host["inputs"].shape[1]),
                    "time/step_s": total, "time/refresh_share": (t1 - t0) / total,
                    "time/rollout_share": (t2 - t1) / total,
                    "time/update_share": (t3 - t2) / total}
            if step > start_step + 1:  # the first step compiles
                timed += 1
                for k, dt in (("refresh", t1 - t0), ("rollout", t2 - t1), ("update", t3 - t2)):
                    shares[k] += dt
            if main_process:
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(last) + "\n")
            if step % tc.log_every == 0 or step == tc.steps:
                logger.info("step %d: loss %.4f reward %.3f +- %.3f kl %.4f clip %.3f len %.1f "
                            "rollout %.0f tok/s; %.2f s (rollout %.0f%%, refresh %.1f%%, "
                            "update %.0f%%)", step, metrics["loss"], last["reward_mean"],
                            last["reward_std"], metrics["kl"], metrics["clip_fraction"],
                            last["completion_len"], last["rollout_tokens_per_s"], total,
                            100 * last["time/rollout_share"], 100 * last["time/refresh_share"],
                            100 * last["time/update_share"])
            if not np.isfinite(metrics["loss"]):
                raise FloatingPointError(f"step {step}: the GRPO loss is {metrics['loss']}")
            if stop.signal is not None or step == tc.steps or step % tc.ckpt_every == 0:
                start = time.perf_counter()
                ckpt.wait()
                with stop.deferred():
                    ckpt.save(step, state, meta=dict(configs, step=step,
                                                     train_loss=metrics["loss"]))
                times["checkpoint"] += time.perf_counter() - start
            if stop.signal is not None:
                interrupted = stop.signal
                logger.warning("%s: saved a checkpoint of step %d and stopped", interrupted,
                               step)
                break
        ckpt.wait()
    train_time = time.perf_counter() - loop_start
    times["train"] = train_time - times["checkpoint"]
    done = sum(shares.values())
    if timed:
        logger.info("GRPO time after the first step: rollout %.1f%%, weight refresh %.2f%%, "
                    "update %.1f%% (%.2f s per step)", *(100 * shares[k] / done for k in
                                                        ("rollout", "refresh", "update")),
                    done / timed)
    latest = ckpt.latest_step()
    summary = RunSummary(
        run_dir=files.name, start_step=start_step, final_step=step,
        train_loss=last.get("loss"), val_loss=None, val_ppl=None, loss_unit="grpo",
        tokens_seen=step * tc.batch_size * tc.seq_len,
        wall_time_s=time.perf_counter() - wall_start, train_time_s=train_time,
        compile_time_s=0.0, tokens_per_s=None,
        step_time_ms=1000 * done / timed if timed else None, mfu=None,
        checkpoint=str(ckpt.step_path(latest)) if latest is not None else None,
        interrupted=interrupted, time_s={k: round(v, 3) for k, v in times.items()})
    if main_process:
        (run_dir / "summary.json").write_text(json.dumps(dataclasses.asdict(summary),
                                                         indent=2))
        files.sync()
    return summary


__all__ = ["BATCH_KEYS", "PAGE_SIZE", "batch_length", "grpo_batch", "initial_model_params",
           "make_engine", "prompt_data", "rollout_slots", "sample", "train_grpo"]
