"""The training run, top to bottom: data -> init or restore -> steps with progress, evaluation,
samples, logs and checkpoints -> summary (``run``).

The pieces it puts together, each in its own module:

* ``train_config`` -- ``TrainConfig`` / ``DataConfig`` and ``build_configs`` (preset + overrides);
* ``loss`` -- masked next-token cross-entropy with z-loss;
* ``optim`` -- AdamW with warmup + cosine decay, clipping, the weight-decay mask;
* ``train_step`` -- ``TrainState`` and the pure init / train / eval step functions;
* ``run_log`` -- metrics checks, ``metrics.jsonl``, TensorBoard, progress bar, signals;
* ``perf`` -- FLOPs per token and the matmul peak behind MFU.

The state is created directly sharded over the mesh of ``train.mesh`` (data x fsdp x tensor, see
``sharding``) and each process loads only its rows of the batch; on CPU,
``sharding.configure_cpu_devices`` makes one device per core, which is what lets a small model's
step use every core.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np

from transformer_jax import data as data_lib
from transformer_jax import distributed
from transformer_jax import sharding as sharding_lib
from transformer_jax.checkpoint import CheckpointManager, ensure_writable_dir
from transformer_jax.config import ModelConfig
from transformer_jax.perf import flops_per_token, measure_matmul_peak
from transformer_jax.run_log import NonFiniteLossError, RunLog, StopOnSignal, progress_bar
from transformer_jax.tokenizer import MODEL_TYPES, Tokenizer
from transformer_jax.train_config import DataConfig, TrainConfig
from transformer_jax.train_step import TrainState, make_eval_step, make_init_fn, make_train_step

logger = logging.getLogger(__name__)

Params = dict[str, Any]
Batch = dict[str, jax.Array]
Metrics = dict[str, jax.Array]


def prepare_data(data_config: DataConfig, vocab_size: int
                 ) -> tuple[Tokenizer, np.ndarray, np.ndarray]:
    """Loads or trains the tokenizer and tokenizes the corpus (both cached), then splits it.

    Args:
      data_config: the corpus and tokenizer settings.
      vocab_size: vocabulary size to train a bpe/unigram tokenizer with if the data config
        does not give one.

    Returns:
      ``(tokenizer, train_tokens [N_train], val_tokens [N_val])``.

    Raises:
      FileNotFoundError: for a missing corpus or tokenizer file.
      ValueError: for an empty corpus or a tokenizer file that does not load.
    """
    dc = data_config
    cache_dir = Path(dc.cache_dir).expanduser()
    if dc.patterns:
        files = data_lib.resolve_corpus(dc.patterns)
    else:
        files = data_lib.default_corpus(dc.max_bytes)
    ensure_writable_dir(cache_dir, "data cache directory")
    if dc.tokenizer in MODEL_TYPES:
        tokenizer = Tokenizer.train_or_load(files, cache_dir, dc.vocab_size or vocab_size,
                                            dc.tokenizer)
    else:
        tokenizer = Tokenizer.load(Path(dc.tokenizer).expanduser())
    tokens = data_lib.tokenize_corpus(files, tokenizer, cache_dir)
    train_tokens, val_tokens = data_lib.split(tokens, dc.val_fraction)
    logger.info("data: %d files, %d train / %d val tokens, tokenizer %s", len(files),
                len(train_tokens), len(val_tokens), tokenizer)
    return tokenizer, train_tokens, val_tokens


def check_run(model_config: ModelConfig, train_config: TrainConfig, num_train_tokens: int,
              num_devices: int | None = None) -> None:
    """Raises a clear ValueError for a run that cannot work, before anything is compiled.

    Args:
      model_config: the model (with its final vocab size).
      train_config: the run.
      num_train_tokens: size of the train split.
      num_devices: devices the batch is split over; ``jax.device_count()`` by default.
    """
    tc = train_config
    if tc.seq_len > model_config.max_seq_len:
        raise ValueError(f"train.seq_len={tc.seq_len} is above the model's max_seq_len="
                         f"{model_config.max_seq_len}")
    num_devices = jax.device_count() if num_devices is None else num_devices
    if tc.micro_batch_size % num_devices:
        raise ValueError(f"train.batch_size={tc.batch_size} (micro-batch "
                         f"{tc.micro_batch_size} with grad_accum={tc.grad_accum}) is not "
                         f"divisible by the number of devices ({num_devices})")
    if num_train_tokens <= tc.seq_len:
        raise ValueError(f"the train split has {num_train_tokens} tokens, not more than "
                         f"train.seq_len={tc.seq_len}; use more data or a shorter seq_len")
    if model_config.param_dtype != "float32":
        logger.warning("param_dtype=%s: training keeps its master weights in this dtype",
                       model_config.param_dtype)


@dataclasses.dataclass
class RunSummary:
    """What a run did (also written to ``run_dir/summary.json``)."""

    run_dir: str
    start_step: int
    final_step: int
    train_loss: float | None
    val_loss: float | None
    val_ppl: float | None
    loss_unit: str
    tokens_seen: int
    wall_time_s: float
    train_time_s: float
    compile_time_s: float
    tokens_per_s: float | None
    step_time_ms: float | None
    mfu: float | None
    checkpoint: str | None
    interrupted: str | None = None


def run(model_config: ModelConfig, train_config: TrainConfig, data_config: DataConfig, *,
        progress: bool = True) -> RunSummary:
    """Trains (or resumes) a model; the whole loop, top to bottom.

    Resumes from the latest complete checkpoint in ``run_dir/checkpoints`` if there is one, and
    then gives exactly the losses and parameters of an uninterrupted run. SIGTERM/SIGINT save a
    checkpoint of the current step and stop; a non-finite loss stops without saving.

    Args:
      model_config: the model; its ``vocab_size`` is replaced by the tokenizer's.
      train_config: optimisation, evaluation, logging and checkpoint settings.
      data_config: corpus and tokenizer.
      progress: show a tqdm progress bar (loss, tokens/s, MFU, ETA).

    Returns:
      The run's summary.

    Raises:
      NonFiniteLossError: the loss became NaN/inf (earlier checkpoints are kept).
      ValueError, FileNotFoundError, PermissionError: bad input, before any training.
    """
    tc = train_config
    wall_start = time.perf_counter()

    # 1. Where things go, checked before any expensive work.
    run_dir = ensure_writable_dir(tc.run_dir, "run directory")
    ckpt = CheckpointManager(run_dir / "checkpoints", keep=tc.keep_ckpts)

    # 2. Data: tokenizer, token file, splits.
    tokenizer, train_tokens, val_tokens = prepare_data(data_config, model_config.vocab_size)
    if tokenizer.vocab_size != model_config.vocab_size:
        logger.info("model vocab_size %d -> %d (the tokenizer's)", model_config.vocab_size,
                    tokenizer.vocab_size)
        model_config = model_config.replace(vocab_size=tokenizer.vocab_size)
    mesh = sharding_lib.make_mesh(sharding_lib.MeshConfig.parse(tc.mesh))
    batch_sharding = sharding_lib.batch_sharding(mesh)
    check_run(model_config, tc, len(train_tokens),
              num_devices=mesh.shape["data"] * mesh.shape["fsdp"])
    main_process = distributed.is_main_process()
    eval_kw = dict(batch_size=tc.micro_batch_size, seq_len=tc.seq_len,
                   max_batches=tc.eval_batches or None)
    if len(val_tokens):
        data_lib.eval_batches(val_tokens, **eval_kw)  # raises now if val cannot fill a batch
    configs = {"model": dataclasses.asdict(model_config), "train": dataclasses.asdict(tc),
               "data": dataclasses.asdict(data_config), "tokenizer": str(tokenizer.path)}

    # 3. State: restore the latest checkpoint, or initialise directly sharded over the mesh
    # (parameters and optimizer state by the logical-axis rules; batches over data x fsdp).
    key = jax.random.key(tc.seed)
    init = make_init_fn(model_config, tc)
    state_shardings = sharding_lib.state_shardings(
        jax.eval_shape(init, key), sharding_lib.param_shardings(model_config, mesh))
    init_fn = sharding_lib.shard_init(init, state_shardings)
    latest = ckpt.latest_step()
    if latest is not None:
        abstract = sharding_lib.with_shardings(jax.eval_shape(init, key), state_shardings)
        state, meta = ckpt.restore(abstract, latest)
        _check_same_model(meta.get("model"), configs["model"], ckpt.step_path(latest))
        logger.info("resumed from %s (step %d)", ckpt.step_path(latest), latest)
    else:
        state = init_fn(key)
    start_step = int(state.step)
    if main_process:
        (run_dir / "config.json").write_text(json.dumps(configs, indent=2))

    # 4. Compile the step once (ahead of time, so its cost is reported separately).
    compile_start = time.perf_counter()
    part, parts = distributed.process_batch_shard(batch_sharding, tc.batch_size)

    def get_batch(step: int) -> Batch:
        rows = data_lib.get_batch(train_tokens, tc.seed, step, tc.batch_size, tc.seq_len,
                                  process_index=part, process_count=parts)
        return distributed.global_batch(rows, batch_sharding, tc.batch_size)

    batch = get_batch(start_step)
    train_step = sharding_lib.jit_train_step(make_train_step(model_config, tc), state_shardings,
                                             batch_sharding)
    train_step = train_step.lower(state, batch).compile()
    compile_time = time.perf_counter() - compile_start
    eval_step = sharding_lib.jit_sharded(
        make_eval_step(model_config), mesh, (state_shardings.params, batch_sharding),
        sharding_lib.replicated(mesh))
    eval_part, eval_parts = distributed.process_batch_shard(batch_sharding, tc.micro_batch_size)
    eval_kw.update(process_index=eval_part, process_count=eval_parts)
    eval_step = _placing(eval_step, functools.partial(
        distributed.global_batch, sharding=batch_sharding, global_batch_size=tc.micro_batch_size))
    flops = flops_per_token(model_config, tc.seq_len)
    peak = measure_matmul_peak()
    logger.info("compiled train step in %.1f s; %.3g FLOPs/token; matmul peak %.3g FLOP/s; "
                "mesh %s", compile_time, flops, peak, dict(mesh.shape))

    progress = progress and main_process
    log = RunLog(run_dir, start_step, tc, flops, peak, log_train=not progress,
                  write=main_process)
    last_val: float | None = None
    interrupted: str | None = None
    step = start_step
    bar = progress_bar(progress, start_step, tc.steps)
    try:
        with StopOnSignal() as stop:
            log.start_timer()
            # 5. The loop: one jitted step per batch; the host reads each step's metrics one
            # step late, so it never waits for the device while there is work to queue.
            while step < tc.steps:
                state, metrics = train_step(state, batch)
                step += 1
                log.push(step, metrics)
                if step < tc.steps:
                    batch = get_batch(step)
                log.flush(keep_last=1)
                bar.update(1)
                bar.set_postfix_str(log.postfix(), refresh=False)
                last = step == tc.steps
                if stop.signal is not None or last or step % tc.ckpt_every == 0 or (
                        tc.eval_every and step % tc.eval_every == 0):
                    log.flush()  # checks every pending loss before anything is saved
                    log.stop_timer()
                    if (tc.eval_every and step % tc.eval_every == 0) or last:
                        last_val = _evaluate_and_sample(state, step, eval_step, val_tokens,
                                                        eval_kw, tokenizer, model_config, tc,
                                                        log)
                    if stop.signal is not None or last or step % tc.ckpt_every == 0:
                        ckpt.save(step, state, meta=dict(configs, step=step,
                                                         train_loss=log.last_loss))
                    log.start_timer()
                if stop.signal is not None:
                    interrupted = stop.signal
                    logger.warning("%s: saved a checkpoint of step %d and stopped",
                                   interrupted, step)
                    break
        log.flush()
    except NonFiniteLossError:
        latest_good = ckpt.latest_step()
        logger.error("stopped without saving; the last good checkpoint is %s",
                     ckpt.step_path(latest_good) if latest_good is not None else "none")
        raise
    finally:
        bar.close()
        ckpt.close()
        log.close()

    # 6. Summary.
    latest = ckpt.latest_step()
    train_time = log.train_time
    summary = RunSummary(
        run_dir=str(run_dir), start_step=start_step, final_step=step,
        train_loss=log.last_loss, val_loss=last_val,
        val_ppl=math.exp(last_val) if last_val is not None and last_val < 700 else None,
        loss_unit="nats/char" if data_config.tokenizer == "char" else "nats/token",
        tokens_seen=step * tc.tokens_per_step, wall_time_s=time.perf_counter() - wall_start,
        train_time_s=train_time, compile_time_s=compile_time,
        tokens_per_s=log.tokens_per_s(overall=True), mfu=log.mfu(overall=True),
        step_time_ms=1000 * train_time / log.timed_steps if log.timed_steps else None,
        checkpoint=str(ckpt.step_path(latest)) if latest is not None else None,
        interrupted=interrupted)
    if main_process:
        (run_dir / "summary.json").write_text(json.dumps(dataclasses.asdict(summary),
                                                         indent=2))
    return summary


def evaluate(eval_step: Callable[[Params, Batch], Metrics], params: Params,
             batches: Iterator[dict[str, np.ndarray]]) -> float:
    """Mean cross-entropy over all target tokens of ``batches`` (nats per token)."""
    loss_sum = tokens = 0.0
    for batch in batches:
        # One batch in flight at a time: queueing them all makes XLA:CPU's multi-device
        # collectives wait on each other until its rendezvous times out (seen with 2 devices).
        sums = jax.device_get(eval_step(params, batch))
        loss_sum += float(sums["loss_sum"])
        tokens += float(sums["tokens"])
    return loss_sum / max(tokens, 1.0)


def sample_text(model_config: ModelConfig, params: Params, tokenizer: Tokenizer, prompt: str,
                max_new_tokens: int, temperature: float, seed: int) -> str:
    """Generates a continuation of ``prompt`` (KV-cached decode) and returns prompt + it."""
    from transformer_jax.generation import generate

    ids = tokenizer.encode(prompt) or [max(tokenizer.bos_id, 0)]
    ids = ids[-(model_config.max_seq_len // 2):]
    max_new_tokens = min(max_new_tokens, model_config.max_seq_len - len(ids))
    if max_new_tokens <= 0:
        return prompt
    result = generate(model_config, params, [ids], max_new_tokens=max_new_tokens,
                      temperature=temperature, seed=seed)
    return tokenizer.decode(ids + list(result.tokens[0]))


# Helpers of run ----------------------------------------------------------------------------------

def _placing(step_fn: Callable[[Params, Batch], Metrics], place: Callable[[np.ndarray], Any]
             ) -> Callable[[Params, Batch], Metrics]:
    return lambda params, batch: step_fn(params, jax.tree.map(place, batch))


def _evaluate_and_sample(state: TrainState, step: int, eval_step, val_tokens: np.ndarray,
                         eval_kw: dict[str, Any], tokenizer: Tokenizer,
                         model_config: ModelConfig, tc: TrainConfig, log: RunLog
                         ) -> float | None:
    val_loss = None
    if len(val_tokens):
        val_loss = evaluate(eval_step, state.params,
                            data_lib.eval_batches(val_tokens, **eval_kw))
        log.record_eval(step, val_loss)
    # The sample decodes on one host's devices, so it needs the params whole on each process.
    if tc.sample_tokens and jax.process_count() == 1:
        text = sample_text(model_config, state.params, tokenizer, tc.sample_prompt,
                           tc.sample_tokens, tc.sample_temperature, seed=step)
        log.record_sample(step, text)
    return val_loss


def _check_same_model(saved: dict[str, Any] | None, current: dict[str, Any], where: Path
                      ) -> None:
    if saved is None:
        return
    diffs = [f"{k}: {saved.get(k)!r} in the checkpoint, {v!r} now"
             for k, v in current.items() if saved.get(k) != v]
    if diffs:
        raise ValueError(f"checkpoint {where} was written for another model ("
                         + "; ".join(diffs) + "); use another train.run_dir")
