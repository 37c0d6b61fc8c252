"""``python -m transformer_jax.plot``: ``transformer-jax plot`` (``cli/plot.py``); the library's
functions are ``transformer_jax.train.plot``'s."""

import sys

from transformer_jax.cli.plot import main
from transformer_jax.train.plot import plot_run, plot_runs, read_metrics

__all__ = ["main", "plot_run", "plot_runs", "read_metrics"]

if __name__ == "__main__":
    sys.exit(main())
