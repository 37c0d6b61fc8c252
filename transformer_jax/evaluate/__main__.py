"""``python -m transformer_jax.evaluate``: see ``transformer_jax.evaluate.cli``."""

import sys

from transformer_jax.evaluate.cli import main

if __name__ == "__main__":
    sys.exit(main())
