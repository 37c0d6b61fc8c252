"""``transformer-jax plot RUN_DIR [RUN_DIR ...]``: loss curves of training runs."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from transformer_jax.cli.common import PROG, fail
from transformer_jax.train.plot import plot_run, plot_runs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"{PROG} plot",
        description="Plot the train and validation loss (and learning rate) of training runs "
                    "from their metrics.jsonl. One run: writes RUN_DIR/loss.png. Several runs: "
                    "draws them on one figure for comparison.",
        epilog="examples:\n"
               "  transformer-jax plot runs/tiny\n"
               "  transformer-jax plot runs/a runs/b --out compare.png",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                   help="run directory holding metrics.jsonl (as written by training)")
    p.add_argument("--out", metavar="FILE",
                   help="PNG to write (default: RUN_DIR/loss.png for one run, runs.png in the "
                        "current directory for several); the runs are only read")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if len(args.run_dirs) == 1:
            out = plot_run(args.run_dirs[0], args.out)
        else:
            out = plot_runs(args.run_dirs, args.out or "runs.png")
    except (FileNotFoundError, ValueError) as e:
        return fail(str(e))
    except OSError as e:  # e.g. loss.png into a read-only run directory
        hint = "" if args.out else "; pass --out FILE to write the plot elsewhere"
        return fail(f"{e}{hint}")
    print(out)
    return 0

