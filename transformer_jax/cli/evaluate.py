"""``transformer-jax evaluate --checkpoint PATH --tasks T1,T2 --output results.json``.

Runs lm-evaluation-harness tasks on a checkpoint (a HF directory, a training run or a LoRA
run) through ``JaxLM``, prints the harness's results table and writes its results as JSON.
Progress bars count the requests of each kind.

**Offline, with local data.** A task is a YAML file in a directory given to
``--include-path``; ``dataset_path: json`` with ``dataset_kwargs: {data_files: {test:
/path/to/data.jsonl}}`` reads a local JSONL file (one document per line) through the
``datasets`` library's JSON builder, which needs no network (set ``HF_DATASETS_OFFLINE=1`` to be
sure nothing is fetched). When every task named is found under ``--include-path``, the
harness's hundreds of built-in task files are not even indexed (saves ~15 s).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from transformer_jax.checkpoint.files import CheckpointError
from transformer_jax.cli.common import PROG
from transformer_jax.parallel import sharding


def build_parser() -> argparse.ArgumentParser:
    """The CLI's arguments; each help states its default once."""
    p = argparse.ArgumentParser(prog=f"{PROG} evaluate",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="HF checkpoint directory or a training "
                   "run (run directory, its checkpoints/ or a step directory); LoRA runs are "
                   "merged")
    p.add_argument("--tasks", required=True,
                   help="comma-separated lm-eval task (or group) names")
    p.add_argument("--include-path", action="append", default=[], metavar="DIR",
                   help="directory of task YAML files; repeatable (default: built-in tasks "
                   "only)")
    p.add_argument("--limit", type=float, help="at most this many documents per task (a "
                   "fraction below 1: that share) (default: all)")
    p.add_argument("--num-fewshot", type=int, help="few-shot examples (default: the task's)")
    p.add_argument("--batch-size", type=int, default=8,
                   help="packed rows per forward and prompts per generate call "
                   "(default: %(default)s)")
    p.add_argument("--max-length", type=int,
                   help="context window in tokens (default: the model's max_seq_len)")
    p.add_argument("--tokenizer", help="tokenizer file or directory (default: the "
                   "checkpoint's)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="compute dtype (default: the checkpoint's)")
    p.add_argument("--mesh", help="place the params on a device mesh 'data,fsdp,tensor' "
                   "(default: one device)")
    p.add_argument("--output", required=True, help="JSON file the results are written to")
    p.add_argument("--seed", type=int, default=0, help="the harness's seeds (few-shot "
                   "sampling) (default: %(default)s)")
    p.add_argument("--bootstrap-iters", type=int, default=100000,
                   help="bootstrap resamples of the metrics' standard errors; 0 skips them "
                   "(default: %(default)s, the harness's)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="log at INFO level (default: warnings only)")
    return p


def task_manager(include_paths: list[str], tasks: list[str]):
    """The harness's ``TaskManager``: only ``include_paths`` when they hold every task named
    (indexing the built-in tasks takes seconds), else those and the built-in ones."""
    from lm_eval.tasks import TaskManager

    for path in include_paths:
        if not Path(path).is_dir():
            raise FileNotFoundError(f"--include-path {path}: no such directory")
    if include_paths:
        local = TaskManager(include_path=include_paths, include_defaults=False)
        if all(local.match_tasks([t]) for t in tasks):
            return local
    manager = TaskManager(include_path=include_paths or None)
    missing = [t for t in tasks if not manager.match_tasks([t])]
    if missing:
        raise ValueError(f"--tasks: unknown task(s) {', '.join(missing)} (not built in"
                         f"{' nor under ' + ', '.join(include_paths) if include_paths else ''})")
    return manager


def main(argv: list[str] | None = None) -> int:
    """Runs the CLI; returns the exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        print(f"error: --tasks names no task: {args.tasks!r}", file=sys.stderr)
        return 2
    if args.limit is not None and not args.limit > 0:
        print(f"error: --limit must be > 0, got {args.limit}", file=sys.stderr)
        return 2
    if args.batch_size < 1:
        print(f"error: --batch-size must be >= 1, got {args.batch_size}", file=sys.stderr)
        return 2
    try:
        import lm_eval
        from lm_eval.utils import handle_non_serializable, make_table

        from transformer_jax.evaluate.harness import JaxLM

        manager = task_manager(args.include_path, tasks)
        mesh = None
        if args.mesh:
            mesh = sharding.make_mesh(sharding.MeshConfig.parse(args.mesh))
        start = time.perf_counter()
        lm = JaxLM(args.checkpoint, mesh=mesh, batch_size=args.batch_size,
                   max_length=args.max_length, tokenizer=args.tokenizer, dtype=args.dtype)
        limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
        results = lm_eval.simple_evaluate(
            model=lm, tasks=tasks, limit=limit, num_fewshot=args.num_fewshot,
            task_manager=manager, log_samples=False, random_seed=args.seed,
            numpy_random_seed=args.seed, torch_random_seed=None,  # no torch here
            fewshot_random_seed=args.seed, bootstrap_iters=args.bootstrap_iters)
        elapsed = time.perf_counter() - start
    except (ValueError, OSError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    results = dict(results)
    results["transformer_jax"] = {"checkpoint": str(args.checkpoint), "seconds": elapsed,
                                  "batch_size": lm.batch_size, "max_length": lm.max_length}
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=2, default=handle_non_serializable))
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    print(f"[{elapsed:.1f} s; results in {output}]", file=sys.stderr)
    return 0
