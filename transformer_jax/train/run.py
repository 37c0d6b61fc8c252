"""The training run, top to bottom: data -> init or restore -> steps with progress, evaluation,
samples, logs and checkpoints -> summary (``run``). The objective (``context``: SFT;
``preference``: DPO, ORPO; ``grpo``) gives data, batches and loss; the state is created sharded
over the mesh of ``train.mesh`` and each process loads only its rows of the batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import jax

from transformer_jax import storage
from transformer_jax.checkpoint import loading
from transformer_jax.checkpoint.manager import CheckpointManager
from transformer_jax.data.eval_sets import EvalSet, load_eval_sets
from transformer_jax.model import lora
from transformer_jax.model.config import ModelConfig
from transformer_jax.parallel import distributed
from transformer_jax.parallel import sharding as sharding_lib
from transformer_jax.tokenizer import MODEL_TYPES, TextTokenizer, load_tokenizer
from transformer_jax.train.checks import (
    RunDirectory,
    attention_used,
    check_config,
    check_dtype,
    check_memory,
    check_run,
    params_shardings,
    run_directory,
)
from transformer_jax.train.config import DataConfig, TrainConfig
from transformer_jax.train.context import Batch, Objective, RunContext
from transformer_jax.train.data import RunData, prepare_data, prepare_shard_data
from transformer_jax.train.executable import check_header
from transformer_jax.train.grpo import GRPO
from transformer_jax.train.init_from import architecture_changes
from transformer_jax.train.log import (
    NonFiniteLossError,
    RunLog,
    RunSummary,
    SaveAborted,
    StopOnSignal,
    abandon_save,
    mesh_peak_flops,
    progress_bar,
)
from transformer_jax.train.perf import describe_params, flops_per_token
from transformer_jax.train.preference import DPO, ORPO
from transformer_jax.train.resume import check_resume
from transformer_jax.train.step import ParamsLayout, TrainState, make_eval_step, make_init_fn
from transformer_jax.train.validation import (
    EVAL_BATCH_FACTOR,
    eval_batching,
    evaluate,
    evaluate_and_sample,
    placing,
    sample_text,
)

logger = logging.getLogger(__name__)

#: The parts of a run's wall time in ``RunSummary.time_s`` (seconds).
TIME_PARTS = ("startup", "compile", "train", "eval", "sample", "plot", "checkpoint", "data")

#: Where a run keeps its copy of the tokenizer (relative to the run directory).
TOKENIZER_DIR = loading.RUN_TOKENIZER_DIR


def make_objective(train_config: TrainConfig) -> Objective:
    """The ``context.Objective`` of ``train.objective``."""
    classes = {"sft": Objective, "dpo": DPO, "orpo": ORPO, "grpo": GRPO}
    return classes[train_config.objective](train_config)


def run(model_config: ModelConfig, train_config: TrainConfig, data_config: DataConfig, *,
        progress: bool = True, memory_check: bool = True) -> RunSummary:
    """Trains (or resumes) a model; the whole loop, top to bottom.

    Resumes exactly from the newest intact checkpoint in ``run_dir/checkpoints`` (saved configs
    of another model, tokenizer, optimizer structure or corpus are refused, naming the keys); a
    run already at ``train.steps`` returns the summary it wrote. SIGTERM/SIGINT save and stop.
    The run directory keeps ``tokenizer/``, ``config.json``, ``metrics.jsonl``, ``loss.png``,
    TensorBoard events, ``summary.json`` and, with ``train.profile_steps``, ``profile/``.

    Args:
      model_config: the model; its ``vocab_size`` is replaced by the tokenizer's.
      train_config: optimisation, evaluation, logging and checkpoint settings.
      data_config: corpus and tokenizer.
      progress: show a tqdm progress bar (loss, training step rate, tokens/s, MFU, ETA).
      memory_check: refuse a run whose rough memory estimate (``train.memory``) is above the
        device's (CPU: the host's available) memory.

    Returns:
      The run's summary.

    Raises:
      NonFiniteLossError: the loss became NaN/inf (earlier checkpoints are kept).
      ValueError, FileNotFoundError, PermissionError: bad input, before any training.
      CheckpointError: a checkpoint could not be written or none could be read (one line).
      SaveAborted: a third SIGTERM/SIGINT; the save in flight was abandoned (its files removed).
    """
    tc = train_config
    wall_start = time.perf_counter()
    times = dict.fromkeys(TIME_PARTS, 0.0)
    objective = make_objective(tc)

    # 1. Checks that need no data, before any expensive work (and before checkpoints/ exists).
    files = run_directory(tc.run_dir, jax.process_index())
    mesh = sharding_lib.make_mesh(sharding_lib.MeshConfig.parse(tc.mesh),
                                  dcn_config=sharding_lib.MeshConfig.parse(tc.dcn_mesh))
    num_batch_devices = sharding_lib.batch_devices(mesh)  # data x fsdp (x expert)
    check_config(model_config, tc, num_devices=num_batch_devices)
    if tc.compiled_step:  # the tokenizer may still change vocab_size: checked again at compile
        check_header(tc.compiled_step, model_config, tc, mesh, skip_model=("vocab_size",))
    objective.check_data(data_config)
    where = f"train.init_from={tc.init_from}"
    source = loading.locate(tc.init_from, where=where) if tc.init_from else None
    if source is not None and (changes := architecture_changes(source.model, model_config)):
        raise ValueError(f"train.init_from={tc.init_from}: the model differs from the "
                         f"checkpoint's: {'; '.join(changes)}")
    if memory_check and not tc.pairs_per_step:  # from shapes (the preset's vocab_size):
        check_memory(model_config, tc, mesh)  # before minutes of data work
    main_process = distributed.is_main_process()

    # 2. Data: tokenizer, token file or packed instruction rows, splits.
    given = (None if data_config.tokenizer in MODEL_TYPES
             else storage.local_copy(data_config.tokenizer))
    if source is not None:  # the checkpoint's, unless data.tokenizer is a file
        tokenizer = loading.open_tokenizer(source, given, where=where,
                                           missing="pass data.tokenizer=FILE")
    elif given is not None and (data_config.is_instruct or data_config.is_shards):
        tokenizer = load_tokenizer(given.expanduser())
    else:
        tokenizer = None  # a text run loads or trains its own in prepare_data (shards: theirs)
    if data_config.is_shards:
        tokenizer, shard_data = prepare_shard_data(
            data_config, tc.seq_len, tokenizer, where=where if source is not None else
            f"data.tokenizer={data_config.tokenizer}")
        data = RunData(shards=shard_data)
    elif data_config.is_instruct:
        if tokenizer is None:
            raise ValueError(f"instruction data ({data_config.path}) needs the model's "
                             "tokenizer: pass train.init_from=CHECKPOINT or data.tokenizer=FILE")
        data = objective.load_data(data_config, tokenizer)
    else:
        tokenizer, train_tokens, val_tokens = prepare_data(
            data_config, model_config.vocab_size, tokenizer)
        data = RunData(train_tokens=train_tokens, val_tokens=val_tokens)
    if source is None and tokenizer.vocab_size != model_config.vocab_size:
        logger.info("model vocab_size %d -> %d (the tokenizer's)", model_config.vocab_size,
                    tokenizer.vocab_size)
        model_config = model_config.replace(vocab_size=tokenizer.vocab_size)
    data, settled = objective.settle(data, num_batch_devices)
    if settled is not tc and memory_check:  # train.pairs_per_step: the rows known now
        check_memory(model_config, settled, mesh)
    tc = settled
    if data_config.is_instruct:  # packed rows or GRPO's prompts: no windows of seq_len
        check_dtype(model_config)
    else:
        check_run(model_config, tc, data.num_train_tokens, num_devices=num_batch_devices)
    eval_batch_size, eval_max_batches = eval_batching(tc, data.num_val_tokens)
    eval_kw = dict(batch_size=eval_batch_size, seq_len=tc.seq_len, max_batches=eval_max_batches)
    if data.num_val_tokens:
        data.eval_batches(**eval_kw)  # raises now if val cannot fill a batch
    eval_sets = load_eval_sets(tc.eval_sets, tokenizer, tc.seq_len)  # bad files: one line now
    layout = ParamsLayout.of(tc)
    configs = {"model": dataclasses.asdict(model_config), "train": dataclasses.asdict(tc),
               "data": dataclasses.asdict(data_config), "tokenizer": str(tokenizer.path),
               "tokenizer_dir": TOKENIZER_DIR, "tokenizer_fingerprint": tokenizer.fingerprint,
               "data_fingerprint": data.fingerprint()}
    if layout.lora_config is not None:
        configs["lora"] = layout.lora_config.to_dict()  # how loading merges the adapters
    if source is not None and source.hf_model_type:  # the family export writes by default
        configs["hf_model_type"] = source.hf_model_type

    with CheckpointManager(files.checkpoints, keep=tc.keep_ckpts) as ckpt:
        ckpt.remove_unfinished(primary=main_process)  # of a run killed while it saved
        # 3. State: the newest checkpoint, or initialised sharded (from init_from's weights).
        key = jax.random.key(tc.seed)
        init = make_init_fn(model_config, tc)
        abstract_state = jax.eval_shape(init, key)
        state_shardings = sharding_lib.state_shardings(
            abstract_state, params_shardings(model_config, mesh, abstract_state.params, layout))

        def initial_state(donate: bool = False) -> TrainState:
            """Step 0's state: init_from's weights (``donate``: handed over) or the seed's."""
            if source is None:
                return sharding_lib.shard_init(init, state_shardings)(key)
            params = loading.load(source, mesh, scan_layers=model_config.scan_layers,
                                  dtype=model_config.param_dtype, with_tokenizer=False,
                                  mtp_depth=None if model_config.mtp_depth else 0).params
            return jax.jit(init, out_shardings=state_shardings,
                           donate_argnums=(1,) if donate else ())(key, params)

        if ckpt.all_steps():
            check_resume(ckpt.read_meta(), configs, ckpt.directory)
            abstract = sharding_lib.with_shardings(abstract_state, state_shardings)
            state, _ = ckpt.restore(abstract, quarantine=main_process)
            logger.info("resumed from %s (step %d)", ckpt.step_path(int(state.step)),
                        int(state.step))
        else:
            # Full fine-tuning hands the loaded buffers over to the state.
            state = initial_state(donate=layout.lora_config is None)
            if source is not None:
                logger.info("initialised from %s (%s)%s", source.path, source.kind,
                            "" if layout.lora_config is None else
                            f"; LoRA rank {layout.lora_config.rank}, "
                            f"{lora.adapter_count(state.params[lora.ADAPTERS]):,} trained "
                            "params")
        start_step = int(state.step)
        if start_step >= tc.steps:
            return _finished(files, start_step, tc, ckpt, objective.loss_unit(data_config))
        if main_process:
            _save_tokenizer(tokenizer, files.local / TOKENIZER_DIR)
            (files.local / "config.json").write_text(json.dumps(configs, indent=2))
        context = RunContext(
            model_config=model_config, tc=tc, data_config=data_config, files=files, mesh=mesh,
            batch_sharding=sharding_lib.batch_sharding(mesh), state_shardings=state_shardings,
            tokenizer=tokenizer, data=data, configs=configs, main_process=main_process,
            initial_state=initial_state)
        objective.start(context, state)
        return _train(context, objective, ckpt, state, eval_kw=eval_kw, eval_sets=eval_sets,
                      progress=progress and main_process, times=times, wall_start=wall_start)


def _train(run: RunContext, objective: Objective, ckpt: CheckpointManager, state: TrainState,
           *, eval_kw: dict[str, Any], eval_sets: list[EvalSet], progress: bool,
           times: dict[str, float], wall_start: float) -> RunSummary:
    """Steps 4-6 of ``run``, the same for every objective: compile, loop, summary."""
    tc, files, run_dir, main_process = run.tc, run.files, run.files.local, run.main_process
    model_config, mesh, batch_sharding = run.model_config, run.mesh, run.batch_sharding
    start_step = int(state.step)
    # 4. Compile the step once (ahead of time, so its cost is reported separately).
    compile_start = time.perf_counter()
    batch_times: list[float] = []  # host seconds of each batch the loop made

    def get_batch(step: int, state: TrainState) -> Batch:
        start = time.perf_counter()
        batch = objective.batch(step, state)
        batch_times.append(time.perf_counter() - start)
        return batch

    batch: Batch | None = get_batch(start_step, state)
    batch_times.clear()  # the loop's batches only
    objective.compile(state, batch)
    compile_time = time.perf_counter() - compile_start
    eval_step = sharding_lib.jit_sharded(
        make_eval_step(model_config, tc), mesh, (run.state_shardings.params, batch_sharding),
        sharding_lib.replicated(mesh))
    eval_part, eval_parts = distributed.process_batch_shard(batch_sharding, eval_kw["batch_size"])
    eval_kw = dict(eval_kw, process_index=eval_part, process_count=eval_parts)
    eval_step = placing(eval_step, functools.partial(
        distributed.global_batch, sharding=batch_sharding, global_batch_size=eval_kw["batch_size"]))
    flops = flops_per_token(model_config, tc.seq_len)
    peak, peak_source = mesh_peak_flops(list(mesh.devices.flat), tc.peak_flops)
    logger.info("%s train step in %.1f s; attention %s; %s; %.3g FLOPs/token; peak "
                "%.3g FLOP/s (%s); mesh %s; eval batch %d",
                "loaded" if tc.compiled_step else "compiled", compile_time,
                attention_used(model_config, tc), describe_params(model_config), flops, peak,
                peak_source, dict(mesh.shape), eval_kw["batch_size"])
    times["compile"] = compile_time
    times["startup"] = time.perf_counter() - wall_start - compile_time

    log = RunLog(run_dir, start_step, tc, flops, peak, log_train=not progress,
                 write=main_process, every_step=objective.on_policy, describe=objective.describe)
    last_val: float | None = None
    interrupted: str | None = None
    step = start_step
    plotted_step: int | None = None  # loss.png drawn with the records up to this step
    profile = tc.profile_range
    tracing = False
    bar = progress_bar(progress, start_step, tc.steps)
    ended = False  # the loop and its last save completed (else the finally uploads the logs)
    try:
        with StopOnSignal() as stop:
            log.start_timer()
            # 5. The loop: the host reads each step's metrics one step late, so it never waits
            # for the device while there is work to queue (on-policy objectives wait anyway).
            while step < tc.steps:
                if batch is None:
                    batch = get_batch(step, state)
                if profile and not tracing and profile[0] <= step + 1 <= profile[1]:
                    jax.profiler.start_trace(str(run_dir / "profile"))
                    tracing = True
                    logger.info("profiling steps %d-%d into %s", step + 1, profile[1],
                                run_dir / "profile")
                state, metrics = objective.update(state, batch)
                step += 1
                if tracing and step >= profile[1]:
                    jax.block_until_ready((state, metrics))
                    jax.profiler.stop_trace()
                    tracing, profile = False, None
                log.push(step, metrics)
                batch = (get_batch(step, state) if step < tc.steps and not objective.on_policy
                         else None)
                log.flush(keep_last=0 if objective.on_policy else 1)
                last = step == tc.steps
                evaluate_now = bool(tc.eval_every and step % tc.eval_every == 0) or last
                if evaluate_now or stop.signal is not None or step % tc.ckpt_every == 0:
                    log.flush()  # checks every pending loss before anything is saved
                    log.stop_timer()
                    if evaluate_now:
                        last_val = evaluate_and_sample(state, step, eval_step, run.data,
                                                        eval_kw, run.tokenizer, model_config,
                                                        tc, log, times, eval_sets)
                        if main_process:
                            _plot(run_dir, times)
                            plotted_step = step
                    # A signal that came during the evaluation still saves this step.
                    if stop.signal is not None or last or step % tc.ckpt_every == 0:
                        save_start = time.perf_counter()
                        # A third signal aborts the previous save at once, this one's start after.
                        ckpt.wait()
                        with stop.deferred():
                            ckpt.save(step, state, meta=dict(run.configs, step=step,
                                                             train_loss=log.last_loss))
                        if main_process:
                            log.flush_events()
                            files.sync()  # a remote run's metrics, plot and events
                        times["checkpoint"] += time.perf_counter() - save_start
                    log.start_timer()
                bar.update(1)
                bar.set_postfix_str(log.postfix(), refresh=False)
                if stop.signal is not None:
                    interrupted = stop.signal
                    logger.warning("%s: saved a checkpoint of step %d and stopped",
                                   interrupted, step)
                    break
            log.flush()
            # Still under StopOnSignal: a third signal during this save aborts it.
            close_start = time.perf_counter()
            ckpt.wait()  # the last save is complete on disk before the summary names it
            times["checkpoint"] += time.perf_counter() - close_start
            if main_process and plotted_step != step:  # the last step's evaluation drew it
                _plot(run_dir, times)
        ended = True
    except NonFiniteLossError:
        latest_good = ckpt.latest_step()
        logger.error("stopped without saving; the last good checkpoint is %s",
                     ckpt.step_path(latest_good) if latest_good is not None else "none")
        raise
    except SaveAborted as e:
        raise abandon_save(ckpt, e) from None
    finally:
        if tracing:
            with contextlib.suppress(Exception):
                jax.profiler.stop_trace()
        bar.close()
        log.close()
        if main_process and not ended:  # a normal end uploads with its summary, below
            files.sync(failing=True)

    # 6. Summary.
    latest = ckpt.latest_step()
    train_time = log.train_time
    # The log times the steps after each process's first (see RunLog); so does this.
    per_batch = sum(batch_times[1:]) / (len(batch_times) - 1) if len(batch_times) > 1 else 0.0
    times["data"] = min(per_batch * log.timed_steps, train_time)
    times["train"] = train_time - times["data"]
    wall_time = time.perf_counter() - wall_start
    summary = RunSummary(
        run_dir=files.name, start_step=start_step, final_step=step,
        train_loss=log.last_loss, val_loss=last_val,
        val_ppl=math.exp(last_val) if last_val is not None and last_val < 700 else None,
        loss_unit=objective.loss_unit(run.data_config),
        tokens_seen=step * tc.tokens_per_step, wall_time_s=wall_time,
        train_time_s=train_time, compile_time_s=compile_time,
        tokens_per_s=log.tokens_per_s(overall=True), mfu=log.mfu(overall=True),
        step_time_ms=1000 * train_time / log.timed_steps if log.timed_steps else None,
        checkpoint=str(ckpt.step_path(latest)) if latest is not None else None,
        interrupted=interrupted, time_s={k: round(v, 3) for k, v in times.items()})
    logger.info("time: %s; wall %.1f s", format_times(summary.time_s), wall_time)
    if train_time > 0:
        logger.info("data: %.2f ms of host time per batch, %.1f%% of the train time",
                    1000 * per_batch, 100 * times["data"] / train_time)
    if main_process:
        (run_dir / "summary.json").write_text(json.dumps(dataclasses.asdict(summary), indent=2))
        files.sync()
    return summary


def _finished(files: RunDirectory, step: int, tc: TrainConfig, ckpt: CheckpointManager,
              unit: str) -> RunSummary:
    """A resumed run with no step left: says so and returns the summary it wrote (kept)."""
    logger.info("nothing to do: the run in %s is at step %d of train.steps=%d; raise "
                "train.steps to train further (its summary.json is kept)", files.name, step,
                tc.steps)
    try:
        kept = json.loads((files.local / "summary.json").read_text())
        if kept.get("final_step") == step:
            return RunSummary(**kept)
    except (OSError, ValueError, TypeError):
        pass  # no summary of this step (the run was killed after its last checkpoint)
    return RunSummary(
        run_dir=files.name, start_step=step, final_step=step,
        train_loss=ckpt.read_meta().get("train_loss"), val_loss=None, val_ppl=None,
        loss_unit=unit, tokens_seen=step * tc.tokens_per_step, wall_time_s=0.0, train_time_s=0.0,
        compile_time_s=0.0, tokens_per_s=None, step_time_ms=None, mfu=None,
        checkpoint=str(ckpt.step_path(ckpt.latest_step())))


def format_times(time_s: dict[str, float]) -> str:
    """``"startup 1.2 s, compile 3.4 s, ..."`` of ``RunSummary.time_s``."""
    return ", ".join(f"{name} {seconds:.1f} s" for name, seconds in time_s.items())


def _save_tokenizer(tokenizer: TextTokenizer, directory: Path) -> None:
    """Keeps a copy of the tokenizer in the run directory (unless the same one is there)."""
    try:
        if load_tokenizer(directory).fingerprint == tokenizer.fingerprint:
            return
    except (OSError, ValueError):
        pass
    tokenizer.save(directory)


def _plot(run_dir: Path, times: dict[str, float]) -> None:
    """Redraws ``run_dir/loss.png``; a failure is a warning, never the end of the run."""
    start = time.perf_counter()
    try:
        from transformer_jax.train.plot import plot_run

        plot_run(run_dir)
    except Exception as e:  # noqa: BLE001 - a plot must not stop training
        logger.warning("could not draw %s: %s", run_dir / "loss.png", e)
    times["plot"] += time.perf_counter() - start


__all__ = ["EVAL_BATCH_FACTOR", "TIME_PARTS", "TOKENIZER_DIR", "RunSummary", "check_config",
           "check_run", "evaluate", "format_times", "run", "sample_text"]
