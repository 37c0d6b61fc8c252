"""What every subcommand of ``transformer-jax`` shares: its name and the logging set-up."""

from __future__ import annotations

import logging
import sys

#: The console script (``[project.scripts]``); ``tjax`` is its short alias.
PROG = "transformer-jax"


def setup_logging(verbose: bool = False, *, default: int = logging.INFO) -> None:
    """Log lines ``HH:MM:SS L message`` on stderr: ``transformer_jax``'s at ``default`` (DEBUG
    with ``verbose``), other libraries' at WARNING."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname).1s %(message)s",
                                           datefmt="%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    logging.getLogger("transformer_jax").setLevel(logging.DEBUG if verbose else default)
