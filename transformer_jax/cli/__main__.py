"""``python -m transformer_jax.cli``: the ``transformer-jax`` command."""

from transformer_jax.cli import console

console()
