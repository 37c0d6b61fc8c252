"""What every subcommand of ``transformer-jax`` shares: the program's name in its usage lines."""

#: The console script (``[project.scripts]``); ``tjax`` is its short alias.
PROG = "transformer-jax"
