"""The ``transformer-jax`` command (alias ``tjax``): one program, one subcommand per job
(``COMMANDS``). Each subcommand is a module with ``main(argv) -> exit status``, imported only
when it runs.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from importlib.metadata import version

from transformer_jax.cli.common import PROG

#: subcommand -> (module under transformer_jax, what it does)
COMMANDS = {
    "train": ("cli.train", "train a model, or resume a run (a preset or TOML + overrides)"),
    "generate": ("cli.generate", "sample from a run or a HF checkpoint"),
    "serve": ("cli.serve", "an OpenAI-compatible HTTP server over the batching engine"),
    "evaluate": ("cli.evaluate", "lm-evaluation-harness tasks on a checkpoint"),
    "export": ("cli.export", "write a run's checkpoint as a HuggingFace model directory"),
    "data": ("cli.data", "build tokenized ArrayRecord shards (data build)"),
    "compile": ("cli.compile", "compile the train step for a TPU topology (no TPU needed)"),
    "bench": ("bench.__main__", "benchmarks: train, decode, memory, serve, data, eval, ..."),
    "plot": ("cli.plot", "loss curves of one or several runs"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"usage: {PROG} {{{','.join(COMMANDS)}}} [options]", "",
             "A functional JAX/Flax LLaMA-family Transformer: training, generation, serving.", "",
             "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items()]
    lines += ["", f"`{PROG} COMMAND --help` lists a command's options."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``transformer-jax COMMAND [args]``; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print(usage())
        return 0
    if args and args[0] == "--version":
        print(f"{PROG} {version('transformer_jax')}")
        return 0
    if not args or args[0] not in COMMANDS:
        print(usage(), file=sys.stderr)
        if args:
            print(f"\n{PROG}: unknown command {args[0]!r}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"transformer_jax.{COMMANDS[args[0]][0]}")
    return module.main(args[1:]) or 0


def console() -> None:
    """The console script's entry point."""
    sys.exit(main())
