"""Token embedding lookup and the tied LM head (the transposed embedding)."""

import chex
import jax
import jax.numpy as jnp

from transformer_jax.model.ops.quantized import einsum, take_rows


def embed(tokens: jax.Array, table: jax.Array) -> jax.Array:
    """Looks up token vectors.

    Args:
      tokens, table: [B, T] integer ids in [0, V), a [V, D] table (float or quantised).

    Returns:
      [B, T, D] in the table's dtype.
    """
    chex.assert_rank(tokens, 2)
    chex.assert_equal(len(table.shape), 2)
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise TypeError(f"tokens must be integers, got {tokens.dtype}")
    return take_rows(table, tokens)


def tied_logits(x: jax.Array, table: jax.Array) -> jax.Array:
    """LM head tied to the embedding: ``x @ table^T``.

    Args:
      x, table: [B, T, D] final hidden states, the [V, D] token table (float or quantised).

    Returns:
      [B, T, V] float32 logits.
    """
    chex.assert_rank(x, 3)
    chex.assert_equal(len(table.shape), 2)
    chex.assert_equal(x.shape[-1], table.shape[-1])
    return einsum("BTD,VD->BTV", x, table.astype(x.dtype), preferred_element_type=jnp.float32)
