"""Dispatches ``python -m transformer_jax.bench KIND [args]`` to ``transformer_jax.bench.KIND``;
``--help`` describes the kinds (from their modules' docstrings, without importing them)."""

import ast
import importlib
import sys
import textwrap
from pathlib import Path

KINDS = ("train", "decode", "memory", "serve", "choices", "data", "eval", "quant", "qlora",
         "grpo", "speculative")


def describe(kind: str) -> str:
    """The first paragraph of ``transformer_jax/bench/KIND.py``'s docstring and the first
    sentence of its second, on one line."""
    source = (Path(__file__).parent / f"{kind}.py").read_text()
    paragraphs = [" ".join(p.split()) for p in
                  (ast.get_docstring(ast.parse(source)) or "").split("\n\n")]
    text = paragraphs[0]
    if len(paragraphs) > 1:
        sentence = paragraphs[1].split(". ")[0].rstrip(".:,")
        text += " " + sentence.removesuffix(", where").removesuffix(" where") + "."
    return text.replace("``", "`")


def usage() -> str:
    """The help text: usage, then each kind with its description."""
    lines = [f"usage: transformer-jax bench {{{','.join(KINDS)}}} [options]", "",
             "Benchmarks (not tests); `transformer-jax bench KIND --help` lists a "
             "kind's options.", ""]
    for kind in KINDS:
        lines += [f"  {kind}", *textwrap.wrap(describe(kind), 96, initial_indent="    ",
                                              subsequent_indent="    "), ""]
    return "\n".join(lines).rstrip()


def main(argv: list[str]) -> int:
    """Runs the benchmark ``argv[0]`` with the remaining arguments; returns the exit status."""
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if not argv or argv[0] not in KINDS:
        print(usage(), file=sys.stderr)
        if argv:
            print(f"\nbench: error: unknown kind {argv[0]!r}; choose from {', '.join(KINDS)}",
                  file=sys.stderr)
        return 2
    module = importlib.import_module(f"transformer_jax.bench.{argv[0]}")
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
