"""``python train.py [--config NAME] [section.key=value ...]``: ``transformer-jax train``.

The command itself is ``transformer_jax/cli/train.py``; this file keeps the original entry point.
"""

import sys

from transformer_jax.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
