"""Train a model: ``transformer-jax train [--config NAME] [section.key=value ...]``.

A config is a TOML file (or the name of one in ``configs/``) with ``[model]``, ``[train]`` and
``[data]`` tables; ``section.key=value`` arguments override single fields, type-checked. With
no arguments it trains the ``tiny`` preset on the Python standard library's sources; running
again with the same ``train.run_dir`` resumes from the latest checkpoint.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback

import jax

from transformer_jax.checkpoint.manager import CheckpointError
from transformer_jax.cli.common import PROG, fail
from transformer_jax.parallel import distributed
from transformer_jax.parallel.sharding import configure_cpu_devices
from transformer_jax.train.config import ConfigError, build_configs, config_help
from transformer_jax.train.log import NonFiniteLossError, SaveAborted
from transformer_jax.train.perf import enable_cpu_fast_math
from transformer_jax.train.run import RunSummary, format_times, run

__all__ = ["ConfigError", "build_configs", "main"]

EXIT_CODES = {"SIGINT": 130, "SIGTERM": 143}


def _setup_logging(verbose: bool) -> None:
    from tqdm.auto import tqdm

    class TqdmHandler(logging.Handler):
        """Writes log lines above the progress bar instead of through it."""

        def emit(self, record: logging.LogRecord) -> None:
            tqdm.write(self.format(record), file=sys.stderr)

    handler = TqdmHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname).1s %(message)s",
                                           datefmt="%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    logging.getLogger("transformer_jax").setLevel(logging.DEBUG if verbose else logging.INFO)


def _enable_compilation_cache(cache_dir: str) -> None:
    """Keeps compiled programs on disk, so a restarted or repeated run starts in seconds."""
    if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        jax.config.update("jax_compilation_cache_dir",
                          os.path.join(os.path.expanduser(cache_dir), "xla"))


def _print_summary(s: RunSummary) -> None:
    def fmt_time(seconds: float) -> str:
        minutes, sec = divmod(seconds, 60)
        return f"{int(minutes)}m {sec:04.1f}s" if minutes else f"{sec:.1f}s"

    lines = [f"steps        {s.start_step} -> {s.final_step} ({s.tokens_seen:,} tokens seen)"]
    if s.interrupted:
        lines.append(f"stopped by   {s.interrupted}")
    if s.train_loss is not None:
        lines.append(f"train loss   {s.train_loss:.4f} {s.loss_unit}")
    if s.val_loss is not None:
        ppl = f" (perplexity {s.val_ppl:.2f})" if s.val_ppl is not None else ""
        lines.append(f"val loss     {s.val_loss:.4f} {s.loss_unit}{ppl}")
    lines.append(f"wall time    {fmt_time(s.wall_time_s)} ({format_times(s.time_s)})")
    if s.tokens_per_s:
        lines.append(f"throughput   {s.tokens_per_s:,.0f} tokens/s, {s.step_time_ms:.1f} ms/step, "
                     f"MFU {100 * (s.mfu or 0):.1f}%")
    lines.append(f"checkpoint   {s.checkpoint}")
    lines.append(f"run dir      {s.run_dir} (metrics.jsonl, loss.png, summary.json, tb/, "
                 "tokenizer/)")
    print("\n".join(["", "summary", *("  " + line for line in lines)]), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=f"{PROG} train", description=__doc__.split("\n\n")[0], epilog=config_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="tiny",
                        help="preset name (listed below) or TOML path (default: tiny)")
    parser.add_argument("--no-progress", action="store_true", help="log instead of a bar")
    parser.add_argument("--no-fast-math", action="store_true",
                        help="keep XLA's exact CPU math (fast math is on by default on CPU)")
    parser.add_argument("--cpu-devices", type=int, default=0, metavar="N",
                        help="split the CPU into N devices for data parallelism (default: one "
                             "per core that divides the batch; 1 disables)")
    parser.add_argument("--coordinator-address", default=None, metavar="HOST:PORT",
                        help="multi-host: address of process 0 (or $JAX_COORDINATOR_ADDRESS)")
    parser.add_argument("--num-processes", type=int, default=None,
                        help="multi-host: number of processes (or $JAX_NUM_PROCESSES)")
    parser.add_argument("--process-id", type=int, default=None,
                        help="multi-host: this process's index (or $JAX_PROCESS_ID)")
    parser.add_argument("--no-memory-check", action="store_true",
                        help="start even when the rough memory estimate says the run will not fit")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="override one field of the config (the keys are listed below)")
    args = parser.parse_intermixed_args(argv)
    if args.cpu_devices < 0:
        parser.error(f"--cpu-devices must be >= 0 (0: one per core that divides the batch), "
                     f"got {args.cpu_devices}")
    try:
        model, train, data = build_configs(args.config, args.overrides)
    except (ConfigError, FileNotFoundError) as e:
        return fail(str(e))
    # Both before JAX creates its CPU backend, which reads the flags.
    if not args.no_fast_math:
        enable_cpu_fast_math()
    try:
        configure_cpu_devices(train.micro_batch_size, args.cpu_devices)
    except ValueError as e:
        return fail(f"--cpu-devices {args.cpu_devices}: the micro-batch of "
                    f"{train.micro_batch_size} rows (train.batch_size / train.grad_accum) is split "
                    f"over the devices: {e}")
    try:
        several = distributed.maybe_initialize(args.coordinator_address, args.num_processes,
                                               args.process_id)
    except ValueError as e:
        return fail(str(e))
    _setup_logging(args.verbose)
    if not distributed.is_main_process():  # logs and progress come from process 0 only
        logging.getLogger().setLevel(logging.WARNING)
    _enable_compilation_cache(data.cache_dir)
    try:
        summary = run(model, train, data, progress=not args.no_progress,
                      memory_check=not args.no_memory_check)
    except NonFiniteLossError as e:
        return _failed(f"{e}; stopped without saving (earlier checkpoints are kept)", 1, several)
    except CheckpointError as e:  # a full disk, or no intact checkpoint to resume from
        return _failed(str(e), 1, several)
    except SaveAborted as e:  # a third SIGINT/SIGTERM: leave now, not after orbax's threads
        return _failed(str(e), EXIT_CODES.get(e.signal, 1), True)
    except (ValueError, FileNotFoundError, PermissionError) as e:
        return _failed(str(e), 2, several)
    except BaseException:
        if not several:
            raise
        traceback.print_exc()
        return _failed(f"process {jax.process_index()} stopped on the exception above", 1, several)
    _print_summary(summary)
    return EXIT_CODES.get(summary.interrupted, 1) if summary.interrupted else 0


def _failed(message: str, code: int, exit_now: bool) -> int:
    """Reports an error; in a multi-process run (or an aborted save), leaves at once: a normal
    exit would wait at ``jax.distributed``'s shutdown barrier (or for orbax's writer threads)."""
    print(f"error: {message}", file=sys.stderr)
    if exit_now:
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(code)
    return code

