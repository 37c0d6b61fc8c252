"""``python -m transformer_jax.hf export --checkpoint RUN_DIR --out DIR``: the CLI of
``transformer_jax.hf_export``, kept out of ``transformer_jax.hf`` so that the library (load,
save) and the export (which uses it) do not import each other."""

import sys

from transformer_jax.hf_export import main

if __name__ == "__main__":
    sys.exit(main())
