"""``python -m transformer_jax.data build ...``: see ``transformer_jax.data.build``."""

import sys

from transformer_jax.data.build import main

sys.exit(main())
