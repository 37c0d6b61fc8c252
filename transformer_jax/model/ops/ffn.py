"""Position-wise feed-forward networks: SwiGLU (default), GeGLU, GELU and ReLU."""

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

#: ``matmul(spec, x, w)``: how each projection is computed.
Matmul = Callable[[str, jax.Array, jax.Array], jax.Array]


def swiglu_glu(gate: jax.Array, up: jax.Array, *, limit: float | None = None,
               alpha: float = 1.0, up_offset: float = 0.0) -> jax.Array:
    """SwiGLU's gated hidden ``gate sigmoid(alpha gate) (up + up_offset)``, gate clamped to at most
    ``limit`` and up to [-limit, limit] first with one (defaults: ``silu(gate) up``), [..., F]."""
    if limit is not None:
        gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
    return gate * jax.nn.sigmoid(alpha * gate) * (up + up_offset)


def gated_ffn(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, *,
              activation: Callable[[jax.Array], jax.Array],
              matmul: Matmul = jnp.einsum,
              glu: Callable[[jax.Array, jax.Array], jax.Array] | None = None) -> jax.Array:
    """Gated FFN: ``(activation(x W_gate) * (x W_up)) W_down``.

    Args:
      x: [B, T, D] activations.
      w_gate, w_up, w_down: [D, F], [D, F], [F, D] projections.
      activation: the gate's elementwise nonlinearity.
      matmul: ``matmul(spec, x, w)``, each projection's product (``jnp.einsum``, ``dense``).
      glu: optional ``glu(gate, up)`` in place of ``activation(gate) * up``.

    Returns:
      [B, T, D].
    """
    gate = matmul("BTD,DF->BTF", x, w_gate)
    up = matmul("BTD,DF->BTF", x, w_up)
    h = activation(gate) * up if glu is None else glu(gate, up)
    return matmul("BTF,FD->BTD", h, w_down)


def swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, *,
           matmul: Matmul = jnp.einsum) -> jax.Array:
    """SwiGLU: ``gated_ffn`` (same shapes) with the SiLU gate."""
    return gated_ffn(x, w_gate, w_up, w_down, matmul=matmul, activation=jax.nn.silu)


def geglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, *,
          matmul: Matmul = jnp.einsum, approximate: bool = False) -> jax.Array:
    """GeGLU: ``gated_ffn`` (same shapes) with the exact (erf) GELU or, with ``approximate``,
    its tanh approximation (``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``)."""
    return gated_ffn(x, w_gate, w_up, w_down, matmul=matmul,
                     activation=functools.partial(jax.nn.gelu, approximate=approximate))


def plain_ffn(x: jax.Array, w_up: jax.Array, w_down: jax.Array, *,
              activation: Callable[[jax.Array], jax.Array],
              matmul: Matmul = jnp.einsum) -> jax.Array:
    """Two-layer FFN: ``activation(x W_up) W_down``.

    Args:
      x: [B, T, D] activations.
      w_up, w_down: [D, F], [F, D] projections.
      activation: the elementwise nonlinearity.
      matmul: as in ``gated_ffn``.

    Returns:
      [B, T, D].
    """
    return matmul("BTF,FD->BTD", activation(matmul("BTD,DF->BTF", x, w_up)), w_down)


gelu_ffn = functools.partial(plain_ffn, activation=functools.partial(jax.nn.gelu,
                                                                     approximate=False))
relu_ffn = functools.partial(plain_ffn, activation=jax.nn.relu)

#: The gate's activation of each gated kind (what a mixture's experts apply).
GATE_ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "swiglu": jax.nn.silu,
    "geglu": functools.partial(jax.nn.gelu, approximate=False),
    "geglu_tanh": functools.partial(jax.nn.gelu, approximate=True),
}

# Gated variants take (x, w_gate, w_up, w_down); plain ones (x, w_up, w_down).
FFN_FUNCTIONS: dict[str, tuple[Callable[..., jax.Array], bool]] = {
    **{kind: (functools.partial(gated_ffn, activation=act), True)
       for kind, act in GATE_ACTIVATIONS.items()},
    "gelu": (gelu_ffn, False),
    "relu": (relu_ffn, False),
}
