"""Expert parallelism: a mixture's experts split over mesh axes, inside ``shard_map``. Each
device (n tokens, e = E/X experts, j = min(k, e)) sends the tokens that chose another device's
experts there by ``all_to_all`` in regions of n rows, applies its experts (``experts_ffn``),
and a second ``all_to_all`` returns the sums; tokens not split over the expert axes (decode)
stay, one ``psum`` adding the experts' shares."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P

from transformer_jax.model.ops import moe as moe_ops
from transformer_jax.model.ops.quantized import is_quantized

Axes = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class ExpertSplit:
    """How a mesh splits a mixture's FFN (each field a tuple of mesh axis names).

    Attributes:
      mesh: the (abstract) mesh.
      tokens, experts: the axes splitting the N tokens, and E (the all_to_alls').
      embed, mlp: the axes splitting the expert matrices' D (all-gathered) and F (summed).
      exchange: tokens go to their experts' devices (False: not split over the expert axes).
    """

    mesh: AbstractMesh
    tokens: Axes
    experts: Axes
    embed: Axes = ()
    mlp: Axes = ()
    exchange: bool = True

    @property
    def n_shards(self) -> int:
        """X, the devices the experts are split over."""
        return math.prod(self.mesh.shape[a] for a in self.experts)

    @property
    def token_shards(self) -> int:
        """The parts the N tokens are split into."""
        return math.prod(self.mesh.shape[a] for a in self.tokens)


def expert_split(mesh: AbstractMesh, tokens: Sequence[str] | str | None,
                 experts: Sequence[str] | str | None, embed: Sequence[str] | str | None = None,
                 mlp: Sequence[str] | str | None = None) -> ExpertSplit | None:
    """The ``ExpertSplit`` of ``mesh`` for these axes (each as a logical rule maps it; axes the
    mesh lacks are ignored), or None when the experts are not split over more than one device
    (or already inside a ``shard_map`` over those axes): then nothing is dispatched."""
    def axes(value) -> Axes:
        names = () if value is None else (value,) if isinstance(value, str) else tuple(value)
        return tuple(a for a in names if a in mesh.axis_names)

    if mesh.empty:
        return None
    experts = axes(experts)
    if not experts or math.prod(mesh.shape[a] for a in experts) == 1:
        return None
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    if any(types[a] == AxisType.Manual for a in experts):
        return None
    tokens = axes(tokens)
    exchange = all(a in tokens for a in experts)
    return ExpertSplit(mesh, tokens, experts, axes(embed), axes(mlp), exchange)


def dispatch_experts_ffn(x: jax.Array, routing: moe_ops.Routing, w_gate: jax.Array,
                         w_up: jax.Array, w_down: jax.Array, split: ExpertSplit, *,
                         activation: moe_ops.Activation = jax.nn.silu, impl: str = "auto",
                         glu: moe_ops.Glu | None = None,
                         biases: tuple[jax.Array, jax.Array, jax.Array] | None = None
                         ) -> jax.Array:
    """``moe.experts_ffn`` with the experts split over ``split.experts``, equal to it up to
    float32 summation order.

    Args:
      x, routing, w_gate, w_up, w_down, activation, impl, glu, biases: as ``experts_ffn``
        takes them (float weights; biases split as their experts' matrices).
      split: the mesh's ``ExpertSplit`` (``expert_split``).

    Returns:
      [N, D] in x's dtype.

    Raises:
      ValueError: E or N not divisible by the devices splitting them, or quantised experts.
    """
    n, e = x.shape[0], w_gate.shape[0]
    if e % split.n_shards:
        raise ValueError(f"moe.n_experts={e} is not divisible by the {split.n_shards} devices "
                         f"of mesh axis {'x'.join(split.experts)}; change the mesh or n_experts")
    if n % split.token_shards:
        raise ValueError(f"{n} tokens (batch x length) do not split over the "
                         f"{split.token_shards} devices of mesh axes {'x'.join(split.tokens)}")
    if any(is_quantized(w) for w in (w_gate, w_up, w_down)):
        raise ValueError("expert parallelism needs float expert weights; quantised experts "
                         "run on a mesh without an expert axis")
    tokens = P(split.tokens)
    by_e, by_d, by_f = split.experts, split.embed or None, split.mlp or None
    w_in, w_out = P(by_e, by_d, by_f), P(by_e, by_f, by_d)
    b_specs = None if biases is None else (P(by_e, by_f), P(by_e, by_f), P(by_e, by_d))
    body = functools.partial(_local if split.exchange else _local_shares, split=split,
                             n_experts=e, ffn=dict(activation=activation, impl=impl, glu=glu))
    # check_vma=False: the local grouped product is not typed for values that vary over manual
    # axes; the untyped transpose is exact here (the output is the same on the devices its
    # spec leaves out, after the psum).
    mapped = jax.shard_map(body, mesh=split.mesh,
                           in_specs=(tokens, tokens, tokens, w_in, w_in, w_out, b_specs),
                           out_specs=tokens, check_vma=False)
    return mapped(x, routing.weights, routing.experts, w_gate, w_up, w_down, biases)


def _gathered(split: ExpertSplit, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
              biases: tuple[jax.Array, jax.Array, jax.Array] | None
              ) -> tuple[jax.Array, jax.Array, jax.Array, tuple | None]:
    """The expert matrices (and the down bias) with their D all-gathered over ``split.embed``."""
    if split.embed:
        w_gate, w_up = (jax.lax.all_gather(w, split.embed, axis=1, tiled=True)
                        for w in (w_gate, w_up))
        w_down = jax.lax.all_gather(w_down, split.embed, axis=2, tiled=True)
        if biases is not None:
            biases = (*biases[:2], jax.lax.all_gather(biases[2], split.embed, axis=1, tiled=True))
    return w_gate, w_up, w_down, biases


def _experts(x, routing, w_gate, w_up, w_down, biases, ffn):
    """``experts_ffn`` of this device's share of F, with the gate and up biases but not the
    down one (added once, after any ``psum`` over the F split): ([rows, D] partial sums,
    [rows, D] float32 weighted down biases, or None)."""
    gate_up = None if biases is None else (*biases[:2], None)
    y = moe_ops.experts_ffn(x, routing, w_gate, w_up, w_down, biases=gate_up, **ffn)
    return y, None if biases is None else moe_ops.down_bias(routing, biases[2])


def _local_shares(x, weights, experts, w_gate, w_up, w_down, biases, *, split, n_experts, ffn):
    """One device, tokens not exchanged: x [n, D] -> [n, D], every token's sum over all experts."""
    w_gate, w_up, w_down, biases = _gathered(split, w_gate, w_up, w_down, biases)
    per_device = n_experts // split.n_shards
    ids = experts - jax.lax.axis_index(split.experts) * per_device
    here = (ids >= 0) & (ids < per_device)
    # A slot whose expert lives elsewhere names the empty expert e, which adds nothing.
    routing = moe_ops.Routing(weights=weights, experts=jnp.where(here, ids, per_device),
                              probs=None, logits=None)
    y, down = _experts(x, routing, w_gate, w_up, w_down, biases, ffn)
    if down is not None:  # one device of the F split adds its experts' down biases
        first = jax.lax.axis_index(split.mlp) == 0 if split.mlp else True
        y = y.astype(jnp.float32) + jnp.where(first, down, 0.0)
    return jax.lax.psum(y, split.experts + split.mlp).astype(x.dtype)


def _local(x, weights, experts, w_gate, w_up, w_down, biases, *, split, n_experts, ffn):
    """One device: x [n, D], weights/experts [n, k], its experts' matrices split on E (and D/F)
    -> [n, D], its tokens' outputs."""
    w_gate, w_up, w_down, biases = _gathered(split, w_gate, w_up, w_down, biases)
    x_shards = split.n_shards
    per_device = n_experts // x_shards
    n, k = experts.shape
    j = min(k, per_device)
    send = _pack(experts, weights, x_shards, per_device, j)
    # Region X of the buffers: the tokens for device X (n rows, the first send.count[X] filled).
    rows = x[send.order] * send.valid[..., None].astype(x.dtype)  # [X, n, D]
    exchange = functools.partial(jax.lax.all_to_all, axis_name=split.experts, split_axis=0,
                                 concat_axis=0)
    got_rows, got_ids, got_weights = exchange(rows), exchange(send.ids), exchange(send.weights)
    # Region X now: the rows device X sent here. One grouped product over all of them.
    routing = moe_ops.Routing(weights=got_weights.reshape(x_shards * n, j),
                              experts=got_ids.reshape(x_shards * n, j), probs=None, logits=None)
    y, down = _experts(got_rows.reshape(x_shards * n, -1), routing, w_gate, w_up, w_down,
                       biases, ffn)
    if split.mlp:
        y = jax.lax.psum(y, split.mlp)  # each device held F/tensor of every expert
    if down is not None:
        y = (y.astype(jnp.float32) + down).astype(y.dtype)
    back = exchange(y.reshape(x_shards, n, -1))  # region X: from device X, in send.order[X]
    back = back * send.valid[..., None].astype(back.dtype)
    # Token i's result from device X sits at the row of i in send.order[X].
    where = jnp.argsort(send.order, axis=1)  # [X, n], the inverse permutations
    return jnp.take_along_axis(back, where[..., None], axis=1).sum(0).astype(x.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _Send:
    """The packed send buffers (per device; X regions of n rows): ``order`` [X, n] the token
    of each row (those for X first), ``valid`` [X, n] whether it is filled, ``ids`` / ``weights``
    [X, n, j] its local expert indices on X and routing weights (0 in unfilled slots)."""

    order: jax.Array
    valid: jax.Array
    ids: jax.Array
    weights: jax.Array


def _pack(experts: jax.Array, weights: jax.Array, x_shards: int, per_device: int, j: int) -> _Send:
    n = experts.shape[0]
    device = experts // per_device  # [n, k], where each chosen expert lives
    to = device[:, :, None] == jnp.arange(x_shards)  # [n, k, X]
    # Slot j of token i on device X: its j-th expert there (distinct experts: at most j).
    rank = jnp.cumsum(to, axis=1) - 1
    slot = to[..., None] & (rank[..., None] == jnp.arange(j))  # [n, k, X, j]
    ids = jnp.einsum("nkxj,nk->nxj", slot.astype(jnp.int32), experts % per_device)
    w = jnp.einsum("nkxj,nk->nxj", slot.astype(weights.dtype), weights)
    goes = to.any(1)  # [n, X]
    order = jnp.argsort(~goes, axis=0, stable=True).T  # [X, n]
    valid = jnp.arange(n)[None] < goes.sum(0)[:, None]
    dest = jnp.arange(x_shards)[:, None]
    return _Send(order, valid, ids[order, dest], w[order, dest] * valid[..., None])
