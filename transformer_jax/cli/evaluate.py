"""``transformer-jax evaluate --checkpoint PATH --tasks T1,T2 --output results.json``.

Runs lm-evaluation-harness tasks on a checkpoint (a HF directory, a training run or a LoRA
run) through ``JaxLM``, prints the results table and writes the results as JSON. Every
argument, the output file and the tasks are checked before any weights are read (exit 2).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
import sys
import time
from pathlib import Path
from typing import Any

from transformer_jax.bench import args as types
from transformer_jax.checkpoint import loading
from transformer_jax.checkpoint.files import CheckpointError
from transformer_jax.cli.common import PROG, fail
from transformer_jax.parallel import sharding
from transformer_jax.storage.files import atomic_writer

#: The harness's seeds go to numpy, which takes [0, 2**32).
_SEED_LIMIT = 2**32


def _limit(text: str) -> int | float:
    """``--limit``: a count of documents (an integer >= 1) or a share in (0, 1)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0 and (value < 1 or value.is_integer())):
        raise argparse.ArgumentTypeError(f"must be a count of documents (an integer >= 1) or a "
                                         f"share in (0, 1), got {text!r}")
    return int(value) if value >= 1 else value


def _seed(text: str) -> int:
    value = types.nonnegative_int(text)
    if value >= _SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2**32), got {text!r}")
    return value


def _tasks(text: str) -> list[str]:
    tasks = [t.strip() for t in text.split(",") if t.strip()]
    if not tasks:
        raise argparse.ArgumentTypeError(f"names no task: {text!r}")
    return tasks


def _mesh(text: str) -> sharding.MeshConfig:
    try:
        return sharding.MeshConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    """The CLI's arguments, each checked as it is parsed; each help states its default once."""
    p = argparse.ArgumentParser(prog=f"{PROG} evaluate", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="HF checkpoint directory or a training run "
                   "(run directory, its checkpoints/ or a step directory); LoRA runs are merged")
    p.add_argument("--tasks", type=_tasks, required=True,
                   help="comma-separated lm-eval task (or group) names")
    p.add_argument("--include-path", type=types.existing_dir, action="append", default=[],
                   metavar="DIR",
                   help="directory of task YAML files; repeatable (default: built-in tasks only)")
    p.add_argument("--limit", type=_limit, help="at most this many documents per task (a "
                   "fraction below 1: that share) (default: all)")
    p.add_argument("--num-fewshot", type=types.nonnegative_int,
                   help="few-shot examples (default: the task's)")
    p.add_argument("--batch-size", type=types.positive_int, default=8,
                   help="packed rows per forward and prompts per generate call "
                   "(default: %(default)s)")
    p.add_argument("--max-length", type=types.positive_int,
                   help="context window in tokens, at most the model's max_seq_len (default: "
                   "its max_seq_len)")
    p.add_argument("--tokenizer", type=types.existing_path, help="tokenizer file or directory "
                   "(default: the checkpoint's)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="compute dtype (default: the checkpoint's)")
    p.add_argument("--mesh", type=_mesh, help="place the params on a device mesh "
                   "'data,fsdp,tensor' (default: one device)")
    p.add_argument("--output", type=types.output_file, required=True,
                   help="JSON file the results are written to (checked before the run)")
    p.add_argument("--seed", type=_seed, default=0, help="the harness's seeds (few-shot "
                   "sampling) (default: %(default)s)")
    p.add_argument("--bootstrap-iters", type=types.nonnegative_int, default=100000,
                   help="bootstrap resamples of the metrics' standard errors; 0 skips them "
                   "(default: %(default)s, the harness's)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="log at INFO level (default: warnings only)")
    return p


def unreadable_task_files(include_paths: list[str]) -> dict[Path, str]:
    """The task YAML files under ``include_paths`` the harness cannot read (it skips them
    silently), each with its error on one line."""
    try:  # the loader the harness's index reads task files with (private: may move)
        from lm_eval.tasks._yaml_loader import load_yaml
    except ImportError:
        return {}
    bad = {}
    for root in include_paths:
        for path in sorted(Path(root).glob("**/*.yaml")):
            try:
                load_yaml(path, resolve_func=False, recursive=True)
            except Exception as e:  # noqa: BLE001 (the harness skips a file for any error)
                bad[path] = " ".join(str(e).split()) or type(e).__name__
    return bad


def _names_task(path: Path, task: str) -> bool:
    """Whether an unreadable task file looks like the one defining ``task`` (its name, or a
    ``task: NAME`` line)."""
    if path.stem == task:
        return True
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return False
    return re.search(rf"^\s*task\s*:\s*['\"]?{re.escape(task)}['\"]?\s*$", text, re.M) is not None


def _unreadable_message(bad: dict[Path, str]) -> str:
    return "; ".join(f"{path} does not parse: {error}" for path, error in bad.items())


def task_manager(include_paths: list[str], tasks: list[str]) -> Any:
    """The harness's ``TaskManager``: only ``include_paths`` when they hold every task named
    (indexing the built-in tasks takes seconds), else those and the built-in ones.

    Raises:
      ValueError: a task not found (naming the task files under ``include_paths`` that do not
        parse, at once if one of them looks like the task's), or not a directory.
    """
    from lm_eval.tasks import TaskManager

    for path in include_paths:
        if not Path(path).is_dir():
            raise ValueError(f"--include-path {path}: no such directory")
    bad: dict[Path, str] = {}
    if include_paths:
        local = TaskManager(include_path=include_paths, include_defaults=False)
        missing = [t for t in tasks if not local.match_tasks([t])]
        if not missing:
            return local
        bad = unreadable_task_files(include_paths)
        theirs = {p: e for p, e in bad.items() if any(_names_task(p, t) for t in missing)}
        if theirs:
            raise ValueError(f"--tasks: task(s) {', '.join(missing)} not loaded: "
                             f"{_unreadable_message(theirs)}")
    manager = TaskManager(include_path=include_paths or None)
    missing = [t for t in tasks if not manager.match_tasks([t])]
    if missing:
        where = f" nor under {', '.join(include_paths)}" if include_paths else ""
        unread = f"; {_unreadable_message(bad)}" if bad else ""
        raise ValueError(f"--tasks: unknown task(s) {', '.join(missing)} (not built in{where})"
                         f"{unread}")
    return manager


def main(argv: list[str] | None = None) -> int:
    """Runs the CLI; returns the exit status (2: a bad argument, 1: a failed run)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        import lm_eval
        from lm_eval.utils import handle_non_serializable, make_table

        from transformer_jax.evaluate.harness import JaxLM

        manager = task_manager(args.include_path, args.tasks)
    except ValueError as e:
        parser.error(str(e))
    try:
        source = loading.locate(args.checkpoint)
        if args.max_length is not None and args.max_length > source.model.max_seq_len:
            parser.error(f"--max-length {args.max_length} exceeds the model's max_seq_len "
                         f"{source.model.max_seq_len}")
        mesh = None if args.mesh is None else sharding.make_mesh(args.mesh)
        start = time.perf_counter()
        lm = JaxLM(source, mesh=mesh, batch_size=args.batch_size,
                   max_length=args.max_length, tokenizer=args.tokenizer, dtype=args.dtype)
        results = lm_eval.simple_evaluate(
            model=lm, tasks=args.tasks, limit=args.limit, num_fewshot=args.num_fewshot,
            task_manager=manager, log_samples=False, random_seed=args.seed,
            numpy_random_seed=args.seed, torch_random_seed=None,  # no torch here
            fewshot_random_seed=args.seed, bootstrap_iters=args.bootstrap_iters)
        elapsed = time.perf_counter() - start
    except (ValueError, OSError, CheckpointError) as e:
        return fail(str(e), 1)
    results = dict(results)
    results["transformer_jax"] = {"checkpoint": str(args.checkpoint), "seconds": elapsed,
                                  "batch_size": lm.batch_size, "max_length": lm.max_length}
    # The table first: the numbers are shown even if the file cannot be written after all.
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    output = Path(args.output).expanduser()
    try:
        with atomic_writer(output) as f:  # whole or not at all
            f.write(json.dumps(results, indent=2, default=handle_non_serializable).encode())
    except OSError as e:
        return fail(f"--output {output}: {e}", 1)
    print(f"[{elapsed:.1f} s; results in {output}]", file=sys.stderr)
    return 0
