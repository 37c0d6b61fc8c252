"""``python -m transformer_jax.evaluate``: ``transformer-jax evaluate`` (``cli/evaluate.py``)."""

import sys

from transformer_jax.cli.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
