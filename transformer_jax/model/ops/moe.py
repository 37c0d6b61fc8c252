"""Mixture of experts: the experts' gated FFNs (N tokens, D width, E experts, k per token, F an
expert's width), ``sum_j w_j FFN_{e_j}(x)``, by one of ``IMPLS`` (``choose_impl``): ``"ragged"``,
``"gather"`` (decode), ``"dense"`` (the reference), ``"tiled"`` (CPU), ``"tokamax"`` /
``"megablox"`` (``ops.moe_kernels``). The router (``ops.router``) is re-exported."""

from __future__ import annotations

import functools
from collections.abc import Callable

import flax.struct
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from transformer_jax.model import remat
from transformer_jax.model.ops import target
from transformer_jax.model.ops.quantized import dequantize, is_quantized, take_rows
from transformer_jax.model.ops.router import (  # noqa: F401  (the router, re-exported)
    Routing,
    balance_loss,
    expert_load,
    route,
    router_z_loss,
)

#: ``activation(gate)`` of a gated FFN kind.
Activation = Callable[[jax.Array], jax.Array]
#: ``glu(gate, up)``: the gated hidden (default ``activation(gate) * up``).
Glu = Callable[[jax.Array, jax.Array], jax.Array]

IMPLS = ("auto", "ragged", "tiled", "gather", "dense", "tokamax", "megablox")


@flax.struct.dataclass
class ExpertList:
    """One of a mixture's expert stacks as E separate arrays, in prepared CPU decode weights: a
    ``lax.switch`` reads one expert's matrix once, where ``w[e]`` of a stack copies it first.

    Attributes:
      experts: E arrays, each one expert's matrix ([L, ...] stacked), float or quantised.
    """

    experts: tuple

    @property
    def shape(self) -> tuple[int, ...]:
        """The stack's shape, (E, ...)."""
        return (len(self.experts), *self.experts[0].shape)

    def stacked(self, dtype: jnp.dtype) -> jax.Array:
        """The [E, ...] stack, dequantised, in ``dtype``."""
        return jnp.stack([dequantize(w, dtype) for w in self.experts])


def choose_impl(impl: str, n_tokens: int, top_k: int, n_experts: int,
                backend: str | None = None, widths: tuple[int, int] = (0, 0)) -> str:
    """The implementation ``"auto"`` stands for at these (static) sizes on ``backend``
    (default: the traced target's): ``"gather"`` when the token-expert pairs are no more than
    the experts (decode); else ``"tiled"`` on CPU, ``"megablox"`` on TPU when the widths
    ``(D, F)`` are multiples of 128, else ``"ragged"``."""
    if impl != "auto":
        return impl
    if n_tokens * top_k <= n_experts:
        return "gather"
    backend = backend or target.platform()
    if backend == "cpu":
        return "tiled"
    if backend == "tpu" and widths[0] and not (widths[0] % 128 or widths[1] % 128):
        return "megablox"
    return "ragged"


def experts_ffn(x: jax.Array, routing: Routing, w_gate: jax.Array, w_up: jax.Array,
                w_down: jax.Array, *, activation: Activation = jax.nn.silu,
                impl: str = "auto", glu: Glu | None = None,
                biases: tuple[jax.Array, jax.Array, jax.Array] | None = None) -> jax.Array:
    """The routed experts' gated FFN, ``sum_j w_j (act(x G_e) * (x U_e)) D_e``.

    Args:
      x: [N, D] tokens.
      routing: their ``Routing``; an expert id of E is an empty slot, adding nothing.
      w_gate, w_up, w_down: [E, D, F], [E, D, F], [E, F, D] the experts' projections.
      activation: the gate's activation.
      impl: one of ``IMPLS`` (``"auto"``: ``choose_impl``).
      glu: optional ``glu(gate, up)`` in place of ``activation(gate) * up``.
      biases: optional ([E, F], [E, F], [E, D]) gate, up and down biases (down None: none).

    Returns:
      [N, D] in x's dtype.
    """
    n, k = routing.experts.shape
    e = w_gate.shape[0]
    impl = choose_impl(impl, n, k, e, widths=w_gate.shape[1:])
    routed = routing
    if impl != "gather":  # an empty slot (id E) computes expert 0 with weight 0
        empty = routing.experts >= e
        routed = routing.replace(experts=jnp.where(empty, 0, routing.experts),
                                 weights=jnp.where(empty, 0.0, routing.weights))

    def glu_of(gate, up, ids):  # of rows whose experts are ``ids``, their gate and up biases added
        if biases is not None:
            gate, up = (h + jnp.take(b.astype(x.dtype), ids, axis=0, mode="fill", fill_value=0)
                        for h, b in zip((gate, up), biases[:2], strict=True))
        # Named for the remat policies (``model.remat``), whichever product made them.
        gate, up = checkpoint_name(gate, remat.MOE_GATE), checkpoint_name(up, remat.MOE_UP)
        return activation(gate) * up if glu is None else glu(gate, up)

    computes = {"dense": _dense, "tiled": _tiled,
                "gather": _switched if isinstance(w_gate, ExpertList) else _gather,
                **{name: functools.partial(_sorted, impl=name)
                   for name in ("ragged", "tokamax", "megablox")}}
    if impl not in computes:
        raise ValueError(f"moe impl must be one of {IMPLS}, got {impl!r}")
    y = computes[impl](x, routed, w_gate, w_up, w_down, glu_of)
    if biases is None or biases[2] is None:
        return y
    return (y + down_bias(routing, biases[2])).astype(x.dtype)


def down_bias(routing: Routing, bias: jax.Array) -> jax.Array:
    """The routed experts' down biases [E, D], weighted as their outputs -> [N, D] float32."""
    down = jnp.take(bias, routing.experts, axis=0, mode="fill", fill_value=0)
    return jnp.einsum("nk,nkd->nd", routing.weights, down.astype(jnp.float32))


def _weights(w: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """A float expert weight in the compute dtype (quantised ones are dequantised)."""
    if isinstance(w, ExpertList):
        return w.stacked(dtype)
    if is_quantized(w):
        return take_rows(w, jnp.arange(w.shape[0]))
    return w.astype(dtype)


def _dense(x, routing, w_gate, w_up, w_down, activation):
    n, e = x.shape[0], w_gate.shape[0]
    w_gate, w_up, w_down = (_weights(w, x.dtype) for w in (w_gate, w_up, w_down))
    h = activation(jnp.einsum("nd,edf->nef", x, w_gate), jnp.einsum("nd,edf->nef", x, w_up),
                   jnp.arange(e))
    y = jnp.einsum("nef,efd->ned", h, w_down)
    combine = jnp.zeros((n, e), jnp.float32).at[
        jnp.arange(n)[:, None], routing.experts].add(routing.weights)
    return jnp.einsum("ned,ne->nd", y.astype(jnp.float32), combine).astype(x.dtype)


def _gather(x, routing, w_gate, w_up, w_down, activation):
    def take(w: jax.Array) -> jax.Array:  # [N, k, ...]: only the chosen experts are read
        return take_rows(w, routing.experts, fill=True).astype(x.dtype)  # empty slots: 0

    h = activation(jnp.einsum("nd,nkdf->nkf", x, take(w_gate)),
                   jnp.einsum("nd,nkdf->nkf", x, take(w_up)), routing.experts)
    y = jnp.einsum("nkf,nkfd->nkd", h, take(w_down))
    return jnp.einsum("nkd,nk->nd", y.astype(jnp.float32), routing.weights).astype(x.dtype)


def _switched(x, routing, w_gate, w_up, w_down, activation):
    """``_gather`` over ``ExpertList``s: a loop over the N*k pairs, each a switch to its expert."""
    n, k = routing.experts.shape

    def expert(e: int) -> Callable[[jax.Array], jax.Array]:
        def ffn(row: jax.Array) -> jax.Array:  # [1, D] -> [1, D]
            g, u, d = (dequantize(w.experts[e], x.dtype) for w in (w_gate, w_up, w_down))
            return activation(row @ g, row @ u, e) @ d
        return ffn

    branches = [expert(e) for e in range(w_gate.shape[0])] + [jnp.zeros_like]  # empty slot
    experts, weights = routing.experts.reshape(-1), routing.weights.reshape(-1)

    def body(p, y):
        i = p // k
        out = jax.lax.switch(experts[p], branches, jax.lax.dynamic_slice_in_dim(x, i, 1))
        return y.at[i].add(out[0].astype(jnp.float32) * weights[p])

    y = jax.lax.fori_loop(0, n * k, body, jnp.zeros(x.shape, jnp.float32))
    return y.astype(x.dtype)


def sort_by_expert(experts: jax.Array, n_experts: int) -> tuple[jax.Array, jax.Array]:
    """The order that groups the N*k (token, slot) pairs by expert, and the group sizes.

    Args:
      experts, n_experts: [N, k] int expert indices, E.

    Returns:
      (order [N*k]: the flat pair ``token * k + slot`` of each sorted row, stable; sizes [E] int32).
    """
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=n_experts).astype(jnp.int32)
    return order, sizes


def grouped_matmul(impl: str, x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    """``x[rows of group e] @ w[e]``: x [M, A] by group, w [E, A, C], sizes [E] -> [M, C]."""
    if impl == "ragged":
        return jax.lax.ragged_dot(x, w, sizes)
    from transformer_jax.model.ops.moe_kernels import kernel_grouped_matmul

    return kernel_grouped_matmul(impl, x, w, sizes)


def _sorted(x, routing, w_gate, w_up, w_down, activation, impl):
    n, k = routing.experts.shape
    order, sizes = sort_by_expert(routing.experts, w_gate.shape[0])
    rows = x[order // k]  # [N*k, D], grouped by expert
    w_gate, w_up, w_down = (_weights(w, x.dtype) for w in (w_gate, w_up, w_down))
    h = activation(grouped_matmul(impl, rows, w_gate, sizes),
                   grouped_matmul(impl, rows, w_up, sizes), routing.experts.reshape(-1)[order])
    y = grouped_matmul(impl, h, w_down, sizes)  # [N*k, D] in the sorted order
    y = jnp.zeros_like(y).at[order].set(y, unique_indices=True).reshape(n, k, -1)
    return jnp.einsum("nkd,nk->nd", y.astype(jnp.float32), routing.weights).astype(x.dtype)


# --------------------------------------------------- "tiled": the grouped matmul for XLA:CPU
# XLA:CPU lowers ``jax.lax.ragged_dot`` as a dense product with every group. "tiled" pads each
# expert's rows to whole tiles of m rows and loops over the tiles in use (a dynamic trip count),
# with a hand-written backward of the same shape.


@flax.struct.dataclass
class TileLayout:
    """Where the N*k (token, slot) pairs sit in a buffer of whole tiles grouped by expert.

    Attributes:
      pair_row, row_pair: [N*k] the buffer row of each pair, [R] the pair of each row (N*k: none).
      tile_expert: [n_tiles] each tile's expert (tiles past ``used`` repeat the last).
      used: int32 scalar, how many tiles hold rows.
      tile: static tile size m.
    """

    pair_row: jax.Array
    row_pair: jax.Array
    tile_expert: jax.Array
    used: jax.Array
    tile: int = flax.struct.field(pytree_node=False, default=128)


def tile_layout(experts: jax.Array, n_experts: int, tile: int | None = None) -> TileLayout:
    """The ``TileLayout`` of [N, k] expert choices; ``R = (N*k // m + E) * m`` rows bound any."""
    n, k = experts.shape
    pairs = n * k
    if tile is None:
        per_expert = -(-pairs // n_experts)  # rounded up to a power of two
        tile = int(min(128, max(8, 1 << max(0, int(per_expert - 1).bit_length()))))
    order, sizes = sort_by_expert(experts, n_experts)
    tiles = (sizes + tile - 1) // tile
    tile_end = jnp.cumsum(tiles)
    n_tiles = pairs // tile + n_experts
    tile_expert = jnp.searchsorted(tile_end, jnp.arange(n_tiles), side="right")
    tile_expert = jnp.minimum(tile_expert, n_experts - 1).astype(jnp.int32)
    start = jnp.cumsum(sizes) - sizes
    expert_of = experts.reshape(-1)[order]
    rows = ((tile_end - tiles)[expert_of] * tile + jnp.arange(pairs) - start[expert_of])
    pair_row = jnp.zeros((pairs,), jnp.int32).at[order].set(rows.astype(jnp.int32),
                                                            unique_indices=True)
    row_pair = jnp.full((n_tiles * tile,), pairs, jnp.int32).at[pair_row].set(
        jnp.arange(pairs, dtype=jnp.int32), unique_indices=True)
    return TileLayout(pair_row, row_pair, tile_expert, tile_end[-1].astype(jnp.int32), tile)


@jax.custom_vjp
def gather_rows(x: jax.Array, index: jax.Array, inverse: jax.Array) -> jax.Array:
    """Rows ``index`` [P] of x [R, D] (index R: a zero row) -> [P, D], whose gradient is a
    gather too: ``inverse`` [R, j] lists the j positions p with ``index[p] == r`` (P: none).
    (The transpose of a plain gather is a scatter-add, XLA:CPU's slowest op.)"""
    return jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])[index]


def _gather_rows_bwd(inverse, ct):
    ext = jnp.concatenate([ct, jnp.zeros((1, ct.shape[1]), ct.dtype)])
    return ext[inverse].sum(1), None, None


gather_rows.defvjp(lambda x, index, inverse: (gather_rows(x, index, inverse), inverse),
                   _gather_rows_bwd)


def _gmm(layout: TileLayout, x: jax.Array, w: jax.Array, transpose: bool = False) -> jax.Array:
    """x [R, A] in tiles, w [E, A, C] (or an ``ExpertList``) -> [R, C]: each used tile times
    its expert's matrix (with ``transpose``, w [E, C, A] times its transpose, read as it is
    stored)."""
    m = layout.tile
    contract = 1 if transpose else 0

    def product(w_e: jax.Array, rows: jax.Array) -> jax.Array:
        w_e = dequantize(w_e, x.dtype)
        return jax.lax.dot_general(rows, w_e, (((1,), (contract,)), ((), ())))

    def body(t, out):
        rows = jax.lax.dynamic_slice_in_dim(x, t * m, m)
        e = layout.tile_expert[t]
        if isinstance(w, ExpertList):  # each tile switches to its expert's arrays
            y = jax.lax.switch(e, [functools.partial(product, w_e) for w_e in w.experts], rows)
        else:
            y = product(w[e], rows)
        return jax.lax.dynamic_update_slice_in_dim(out, y.astype(out.dtype), t * m, 0)

    cols = w.shape[1] if transpose else w.shape[2]
    return jax.lax.fori_loop(0, layout.used, body, jnp.zeros((x.shape[0], cols), x.dtype))


def _tgmm(layout: TileLayout, x: jax.Array, dy: jax.Array, n_experts: int) -> jax.Array:
    """The weights' gradient of ``_gmm``: [E, A, C], each tile's x^T dy added to its expert."""
    m = layout.tile

    def body(t, acc):
        rows = jax.lax.dynamic_slice_in_dim(x, t * m, m)
        grads = jax.lax.dynamic_slice_in_dim(dy, t * m, m)
        e = layout.tile_expert[t]
        return acc.at[e].add((rows.T @ grads).astype(acc.dtype))

    return jax.lax.fori_loop(0, layout.used, body,
                             jnp.zeros((n_experts, x.shape[1], dy.shape[1]), x.dtype))


@jax.custom_vjp
def tiled_matmul(layout: TileLayout, x: jax.Array, w: jax.Array) -> jax.Array:
    """The grouped matmul over a ``TileLayout``: x [R, A], w [E, A, C] -> [R, C]."""
    return _gmm(layout, x, w)


def _tiled_bwd(res, dy):
    layout, x, w = res
    return None, _gmm(layout, dy, w, transpose=True), _tgmm(layout, x, dy, w.shape[0])


tiled_matmul.defvjp(lambda layout, x, w: (_gmm(layout, x, w), (layout, x, w)), _tiled_bwd)


def _tiled(x, routing, w_gate, w_up, w_down, activation):
    n, k = routing.experts.shape
    layout = tile_layout(routing.experts, w_gate.shape[0])
    # Row r of the buffer holds token row_pair[r] // k; token t's k rows are pair_row[t*k:..].
    src = jnp.where(layout.row_pair < n * k, layout.row_pair // k, n)
    rows = gather_rows(x, src, layout.pair_row.reshape(n, k))
    ids = jnp.take(routing.experts.reshape(-1), layout.row_pair, mode="fill",
                   fill_value=w_gate.shape[0])  # each buffer row's expert (padding: E)
    if isinstance(w_gate, ExpertList):  # decode weights (no gradient): switched per tile
        h = activation(_gmm(layout, rows, w_gate), _gmm(layout, rows, w_up), ids)
        y = _gmm(layout, h, w_down)
    else:
        w_gate, w_up, w_down = (_weights(w, x.dtype) for w in (w_gate, w_up, w_down))
        # Gate and up in one product: half the loop trips, twice the columns per tile.
        gate, up = jnp.split(tiled_matmul(layout, rows, jnp.concatenate([w_gate, w_up], -1)), 2, -1)
        y = tiled_matmul(layout, activation(gate, up, ids), w_down)
    y = gather_rows(y, layout.pair_row, layout.row_pair[:, None]).reshape(n, k, -1)
    return jnp.einsum("nkd,nk->nd", y.astype(jnp.float32), routing.weights).astype(x.dtype)
