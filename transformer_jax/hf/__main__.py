"""``python -m transformer_jax.hf export ...``: ``transformer-jax export ...`` (cli/export.py)."""

import sys

from transformer_jax.cli.export import main

if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] != ["export"] and not set(args) & {"-h", "--help"}:
        print("usage: python -m transformer_jax.hf export --checkpoint PATH --out DIR ...\n"
              "(the same as: transformer-jax export ...)", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(args[1:] if args[:1] == ["export"] else args))
