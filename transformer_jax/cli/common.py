"""What every subcommand of ``transformer-jax`` shares: the program's name in its usage lines,
how a command reports an error, and how it shows a byte count."""

import sys

#: The console script (``[project.scripts]``); ``tjax`` is its short alias.
PROG = "transformer-jax"


def fail(message: str, code: int = 2) -> int:
    """Prints ``error: <message>`` to stderr; returns the exit status ``code`` (2: bad input)."""
    print(f"error: {message}", file=sys.stderr)
    return code


def gib(n: int | None) -> str:
    """A byte count in GiB, ``"1.500 GiB"`` (``"?"`` for None)."""
    return "?" if n is None else f"{n / 2.0**30:.3f} GiB"
