"""Mixture of experts: the router, the experts' gated FFNs computed three ways, and the
router's losses.

Shape letters: N tokens (B*T flattened), D model width, E experts, k experts per token, F an
expert's hidden width.

A token's output is ``sum_j w_j FFN_{e_j}(x)`` over its k chosen experts ``e_j`` with routing
weights ``w_j`` (``route``). ``experts_ffn`` computes it:

- ``"ragged"`` (dropless, any backend): the N*k (token, expert) pairs sorted by expert, each
  expert's rows a contiguous group, the three projections ``jax.lax.ragged_dot`` over the
  groups, the outputs unsorted and weighted. No token is dropped and no capacity is padded.
- ``"gather"``: each pair's expert matrices gathered ([N, k, D, F]) and applied by a batched
  product. It reads N*k expert matrices, so it is the decode path (few tokens: only the chosen
  experts' bytes are read), never the training one.
- ``"dense"``: every expert on every token, masked by the routing weights: E/k times the
  FLOPs, the reference the others are tested against.
- ``"tokamax"`` / ``"megablox"``: the ``"ragged"`` sort with a grouped-matmul kernel
  (``model/ops/moe_kernels.py``) for the products.
"""

from __future__ import annotations

from collections.abc import Callable

import flax.struct
import jax
import jax.numpy as jnp

from transformer_jax.model.ops.quantized import is_quantized, take_rows

#: ``activation(gate)`` of a gated FFN kind.
Activation = Callable[[jax.Array], jax.Array]

IMPLS = ("auto", "ragged", "gather", "dense", "tokamax", "megablox")


@flax.struct.dataclass
class Routing:
    """Where each token goes and with what weight.

    Attributes:
      weights: [N, k] float32 routing weights of the chosen experts.
      experts: [N, k] int32 expert indices, in decreasing probability (ties: lower index first).
      probs: [N, E] float32 softmax of the router logits (for the balance loss).
      logits: [N, E] float32 router logits (for the z-loss).
    """

    weights: jax.Array
    experts: jax.Array
    probs: jax.Array
    logits: jax.Array


def route(logits: jax.Array, top_k: int, renormalize: bool) -> Routing:
    """Softmax top-k routing.

    Args:
      logits: [N, E] router logits (any float dtype; the softmax runs in float32).
      top_k: k, experts per token.
      renormalize: divide the k chosen probabilities by their sum.

    Returns:
      The ``Routing``.
    """
    logits = logits.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return Routing(weights, experts.astype(jnp.int32), probs, logits)


def choose_impl(impl: str, n_tokens: int, top_k: int, n_experts: int) -> str:
    """The implementation ``"auto"`` stands for at these (static) sizes: ``"gather"`` when the
    token-expert pairs are no more than the experts (each chosen matrix read once costs no more
    than reading them all: decode), else ``"ragged"``."""
    if impl != "auto":
        return impl
    return "gather" if n_tokens * top_k <= n_experts else "ragged"


def experts_ffn(x: jax.Array, routing: Routing, w_gate: jax.Array, w_up: jax.Array,
                w_down: jax.Array, *, activation: Activation = jax.nn.silu,
                impl: str = "auto") -> jax.Array:
    """The routed experts' gated FFN, ``sum_j w_j (act(x G_e) * (x U_e)) D_e``.

    Args:
      x: [N, D] tokens.
      routing: their ``Routing`` (k experts each).
      w_gate: [E, D, F] gate projections.
      w_up: [E, D, F] up projections.
      w_down: [E, F, D] down projections.
      activation: the gate's activation (silu for SwiGLU experts).
      impl: ``"auto"`` (``choose_impl``), ``"ragged"``, ``"gather"``, ``"dense"``,
        ``"tokamax"`` or ``"megablox"`` (see the module docstring).

    Returns:
      [N, D] in x's dtype.
    """
    n, k = routing.experts.shape
    impl = choose_impl(impl, n, k, w_gate.shape[0])
    if impl == "dense":
        return _dense(x, routing, w_gate, w_up, w_down, activation)
    if impl == "gather":
        return _gather(x, routing, w_gate, w_up, w_down, activation)
    if impl in ("ragged", "tokamax", "megablox"):
        return _sorted(x, routing, w_gate, w_up, w_down, activation, impl)
    raise ValueError(f"moe impl must be one of {IMPLS}, got {impl!r}")


def _weights(w: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """A float expert weight in the compute dtype (quantised ones are dequantised)."""
    if is_quantized(w):
        return take_rows(w, jnp.arange(w.shape[0]))
    return w.astype(dtype)


def _dense(x, routing, w_gate, w_up, w_down, activation):
    n, e = x.shape[0], w_gate.shape[0]
    w_gate, w_up, w_down = (_weights(w, x.dtype) for w in (w_gate, w_up, w_down))
    h = activation(jnp.einsum("nd,edf->nef", x, w_gate)) * jnp.einsum("nd,edf->nef", x, w_up)
    y = jnp.einsum("nef,efd->ned", h, w_down)
    combine = jnp.zeros((n, e), jnp.float32).at[
        jnp.arange(n)[:, None], routing.experts].add(routing.weights)
    return jnp.einsum("ned,ne->nd", y.astype(jnp.float32), combine).astype(x.dtype)


def _gather(x, routing, w_gate, w_up, w_down, activation):
    def take(w: jax.Array) -> jax.Array:  # [N, k, ...]: only the chosen experts are read
        return take_rows(w, routing.experts).astype(x.dtype)

    h = activation(jnp.einsum("nd,nkdf->nkf", x, take(w_gate))) * jnp.einsum(
        "nd,nkdf->nkf", x, take(w_up))
    y = jnp.einsum("nkf,nkfd->nkd", h, take(w_down))
    return jnp.einsum("nkd,nk->nd", y.astype(jnp.float32), routing.weights).astype(x.dtype)


def sort_by_expert(experts: jax.Array, n_experts: int) -> tuple[jax.Array, jax.Array]:
    """The order that groups the N*k (token, slot) pairs by expert, and the group sizes.

    Args:
      experts: [N, k] int expert indices.
      n_experts: E.

    Returns:
      (order [N*k]: pair ``order[i]`` (a flat index ``token * k + slot``) is the i-th row of
      the sorted layout, stable within an expert; sizes [E] int32: rows per expert).
    """
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=n_experts).astype(jnp.int32)
    return order, sizes


def grouped_matmul(impl: str, x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    """``x[rows of group e] @ w[e]`` for every group: x [M, A] sorted by group, w [E, A, C],
    sizes [E] -> [M, C] (``jax.lax.ragged_dot``, or a kernel for ``tokamax``/``megablox``)."""
    if impl == "ragged":
        return jax.lax.ragged_dot(x, w, sizes)
    from transformer_jax.model.ops.moe_kernels import kernel_grouped_matmul

    return kernel_grouped_matmul(impl, x, w, sizes)


def _sorted(x, routing, w_gate, w_up, w_down, activation, impl):
    n, k = routing.experts.shape
    order, sizes = sort_by_expert(routing.experts, w_gate.shape[0])
    rows = x[order // k]  # [N*k, D], grouped by expert
    w_gate, w_up, w_down = (_weights(w, x.dtype) for w in (w_gate, w_up, w_down))
    h = activation(grouped_matmul(impl, rows, w_gate, sizes)) * grouped_matmul(
        impl, rows, w_up, sizes)
    y = grouped_matmul(impl, h, w_down, sizes)  # [N*k, D] in the sorted order
    y = jnp.zeros_like(y).at[order].set(y, unique_indices=True).reshape(n, k, -1)
    return jnp.einsum("nkd,nk->nd", y.astype(jnp.float32), routing.weights).astype(x.dtype)


def expert_load(experts: jax.Array, valid: jax.Array, n_experts: int) -> jax.Array:
    """[E] float32: how many valid (token, slot) pairs each expert received.

    Args:
      experts: [N, k] expert indices.
      valid: [N] bool, the tokens that count (False: padding).
      n_experts: E.
    """
    onehot = jax.nn.one_hot(experts, n_experts, dtype=jnp.float32)  # [N, k, E]
    return jnp.einsum("nke,n->e", onehot, valid.astype(jnp.float32))


def balance_loss(routing: Routing, valid: jax.Array) -> jax.Array:
    """The load-balancing loss ``E * sum_e f_e P_e`` (Switch Transformer, as HF's
    ``load_balancing_loss_func`` computes it for one layer): ``f_e`` the fraction of valid
    tokens that chose expert e among their k (so the f's sum to k), ``P_e`` the mean router
    probability of e over the valid tokens. Its minimum, k, is a uniform load.

    Args:
      routing: the layer's ``Routing`` ([N, E] probs, [N, k] experts).
      valid: [N] bool.

    Returns:
      A float32 scalar (0 with no valid token).
    """
    e = routing.probs.shape[-1]
    count = jnp.maximum(jnp.sum(valid.astype(jnp.float32)), 1.0)
    f = expert_load(routing.experts, valid, e) / count
    p = jnp.einsum("ne,n->e", routing.probs, valid.astype(jnp.float32)) / count
    return e * jnp.sum(f * p)


def router_z_loss(routing: Routing, valid: jax.Array) -> jax.Array:
    """ST-MoE's router z-loss: the mean over valid tokens of ``logsumexp(logits)^2``
    (float32 scalar), which keeps the router's logits small."""
    z = jax.nn.logsumexp(routing.logits, axis=-1) ** 2
    valid = valid.astype(jnp.float32)
    return jnp.sum(z * valid) / jnp.maximum(jnp.sum(valid), 1.0)
