"""Position-wise feed-forward networks: SwiGLU (default), GeGLU, GELU and ReLU."""

from collections.abc import Callable

import jax
import jax.numpy as jnp


def swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """SwiGLU: ``(silu(x W_gate) * (x W_up)) W_down``.

    Args:
      x: [B, T, D] activations.
      w_gate: [D, F] gate projection.
      w_up: [D, F] up projection.
      w_down: [F, D] down projection.

    Returns:
      [B, T, D].
    """
    gate = jnp.einsum("BTD,DF->BTF", x, w_gate)
    up = jnp.einsum("BTD,DF->BTF", x, w_up)
    return jnp.einsum("BTF,FD->BTD", jax.nn.silu(gate) * up, w_down)


def geglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """GeGLU: ``(gelu(x W_gate) * (x W_up)) W_down`` with the exact (erf) GELU.

    Args:
      x: [B, T, D] activations.
      w_gate: [D, F] gate projection.
      w_up: [D, F] up projection.
      w_down: [F, D] down projection.

    Returns:
      [B, T, D].
    """
    gate = jnp.einsum("BTD,DF->BTF", x, w_gate)
    up = jnp.einsum("BTD,DF->BTF", x, w_up)
    return jnp.einsum("BTF,FD->BTD", jax.nn.gelu(gate, approximate=False) * up, w_down)


def gelu_ffn(x: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """Two-layer FFN with the exact GELU: ``gelu(x W_up) W_down``.

    Args:
      x: [B, T, D] activations.
      w_up: [D, F] up projection.
      w_down: [F, D] down projection.

    Returns:
      [B, T, D].
    """
    hidden = jax.nn.gelu(jnp.einsum("BTD,DF->BTF", x, w_up), approximate=False)
    return jnp.einsum("BTF,FD->BTD", hidden, w_down)


def relu_ffn(x: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """Two-layer FFN of the original Transformer: ``relu(x W_up) W_down``.

    Args:
      x: [B, T, D] activations.
      w_up: [D, F] up projection.
      w_down: [F, D] down projection.

    Returns:
      [B, T, D].
    """
    hidden = jax.nn.relu(jnp.einsum("BTD,DF->BTF", x, w_up))
    return jnp.einsum("BTF,FD->BTD", hidden, w_down)


# Gated variants take (x, w_gate, w_up, w_down); plain ones (x, w_up, w_down).
FFN_FUNCTIONS: dict[str, tuple[Callable[..., jax.Array], bool]] = {
    "swiglu": (swiglu, True),
    "geglu": (geglu, True),
    "gelu": (gelu_ffn, False),
    "relu": (relu_ffn, False),
}
