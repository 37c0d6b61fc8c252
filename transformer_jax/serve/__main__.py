"""``python -m transformer_jax.serve``: ``transformer-jax serve`` (``cli/serve.py``)."""

import sys

from transformer_jax.cli.serve import main

if __name__ == "__main__":
    sys.exit(main())
