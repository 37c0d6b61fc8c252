"""What every subcommand of ``transformer-jax`` shares: the program's name, ``fail``, ``gib``."""

import sys

#: The console script (``[project.scripts]``); ``tjax`` is its short alias.
PROG = "transformer-jax"


def fail(message: str, code: int = 2) -> int:
    """Writes ``error: <message>`` on stderr (for the commands' ``main`` only: the library
    logs); returns the exit status ``code`` (2: bad input)."""
    sys.stderr.write(f"error: {message}\n")
    return code


def gib(n: int | None) -> str:
    """A byte count in GiB, ``"1.500 GiB"`` (``"?"`` for None)."""
    return "?" if n is None else f"{n / 2.0**30:.3f} GiB"


def peak_of(peak: int, hbm: int | None, fits: bool) -> str:
    """``compile``'s ``"PEAK of HBM = SHARE of HBM: fits"`` (or ``DOES NOT FIT``), in GiB."""
    share = f" = {peak / hbm:.1%} of HBM" if hbm else ""
    return f"{gib(peak)} of {gib(hbm)}{share}: " + ("fits" if fits else "DOES NOT FIT")
