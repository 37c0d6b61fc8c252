"""Dispatches ``python -m transformer_jax.bench KIND [args]`` to ``transformer_jax.bench.KIND``."""

import importlib
import sys

KINDS = ("train", "decode", "memory")


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in KINDS:
        print(f"usage: python -m transformer_jax.bench {{{','.join(KINDS)}}} [options]",
              file=sys.stderr)
        return 2
    module = importlib.import_module(f"transformer_jax.bench.{argv[0]}")
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
