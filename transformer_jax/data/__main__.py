"""``python -m transformer_jax.data build ...``: ``transformer-jax data build`` (cli/data.py)."""

import sys

from transformer_jax.cli.data import main

if __name__ == "__main__":
    sys.exit(main())
