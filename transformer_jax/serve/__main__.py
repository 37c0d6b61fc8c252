"""``python -m transformer_jax.serve``: see ``transformer_jax.serve.cli``."""

import sys

from transformer_jax.serve.cli import main

if __name__ == "__main__":
    sys.exit(main())
