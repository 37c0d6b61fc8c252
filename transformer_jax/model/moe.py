"""The mixture-of-experts FFN module (``SparseFFN``): a router [D, E] and experts' stacks
``gate``, ``up`` [E, D, F], ``down`` [E, F, D] (logical axes experts, expert_embed,
expert_mlp), run by ``ops.moe``, or ``ops.moe_dispatch`` when the rules split E."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from transformer_jax.model import remat
from transformer_jax.model.fields import MoE
from transformer_jax.model.layers import MLP, matrix, swiglu_glu_of, typed_matrix, zeros_param
from transformer_jax.model.ops import moe as moe_ops
from transformer_jax.model.ops import moe_dispatch
from transformer_jax.model.ops.dense import dense
from transformer_jax.model.ops.ffn import GATE_ACTIVATIONS
from transformer_jax.model.stack import block_paths, stacked_layers, tree_get, tree_set

#: The parameter name of a router's correction bias (``MoE.correction_bias``).
CORRECTION_BIAS = "correction_bias"

#: What a sparse layer reports (float32): its ``balance`` and ``z`` losses, ``load`` [E] per expert.
RouterStats = dict[str, jax.Array]


class SparseFFN(nn.Module):
    """A mixture of ``moe.n_experts`` gated FFNs with top-k routing (``MoE`` says which).

    The router and the shared expert may be prepared out-first; the experts' [E, ...] stacks
    are in-first in every layout, or an ``ops.moe.ExpertList`` in prepared decode weights.
    """

    moe: MoE
    kind: str = "swiglu"
    swiglu: tuple[float | None, float, float] | None = None
    impl: str = "auto"
    init_std: float = 0.02
    out_init_std: float = 0.02
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    def _experts(self, name: str, shape: tuple[int, ...], axes: tuple[str, ...],
                 std: float) -> jax.Array:
        return matrix(self, name, shape, axes, nn.initializers.normal(std),
                      param_dtype=self.param_dtype)

    @nn.compact
    def __call__(self, x: jax.Array, valid: jax.Array | None = None
                 ) -> tuple[jax.Array, RouterStats]:
        """[B, T, D] -> ([B, T, D], this layer's ``RouterStats``).

        ``valid`` [B, T] bool marks the tokens the statistics count (None: all)."""
        m = self.moe
        b, t, d = x.shape
        e, f = m.n_experts, m.d_ff
        router = typed_matrix(self, "router", (d, e), ("embed", "router"), self.init_std)
        in_axes = ("experts", "expert_embed", "expert_mlp")
        gate = self._experts("gate", (e, d, f), in_axes, self.init_std)
        up = self._experts("up", (e, d, f), in_axes, self.init_std)
        down = self._experts("down", (e, f, d), ("experts", "expert_mlp", "expert_embed"),
                             self.out_init_std)

        tokens = x.reshape(b * t, d)
        logits = dense(tokens, router, "ND,DE->NE", preferred_element_type=jnp.float32)
        if m.router_bias:
            logits += zeros_param(self, "router_bias", (e,), ("router",)).astype(jnp.float32)
        choice_bias = None
        if m.correction_bias:  # float32 as stored (decode.prepare keeps its dtype)
            choice_bias = self.param(
                CORRECTION_BIAS, nn.with_logical_partitioning(nn.initializers.zeros, ("router",)),
                (e,), self.param_dtype).astype(jnp.float32)
        routing = moe_ops.route(logits, m.top_k, m.renormalize, m.score,
                                choice_bias=choice_bias, n_groups=m.n_groups,
                                top_groups=m.top_groups, scale=m.routed_scale)
        routed, inputs = routing, tokens
        if m.scale_input:  # one expert per token: its weight scales what goes in, not out
            inputs = tokens * routing.weights.astype(tokens.dtype)
            routed = routing.replace(weights=jnp.ones_like(routing.weights))
        ffn = dict(activation=GATE_ACTIVATIONS[self.kind], impl=self.impl)
        if self.swiglu is not None:
            ffn["glu"] = swiglu_glu_of(self.swiglu)
        biases = None
        if m.expert_bias:
            biases = (zeros_param(self, "gate_bias", (e, f), ("experts", "expert_mlp")),
                      zeros_param(self, "up_bias", (e, f), ("experts", "expert_mlp")),
                      zeros_param(self, "down_bias", (e, d), ("experts", "expert_embed")))
        split = expert_split()
        if split is None:
            y = moe_ops.experts_ffn(inputs, routed, gate, up, down, biases=biases, **ffn)
        else:
            y = moe_dispatch.dispatch_experts_ffn(inputs, routed, gate, up, down, split,
                                                  biases=biases, **ffn)
        y = checkpoint_name(y.reshape(b, t, d), remat.MOE_OUT)
        if m.shared_d_ff:
            shared = MLP(d_ff=m.shared_d_ff, kind=self.kind, swiglu=self.swiglu,
                         init_std=self.init_std, out_init_std=self.out_init_std,
                         dtype=self.dtype, param_dtype=self.param_dtype, name="shared")(x)
            if m.shared_gate:
                w = typed_matrix(self, "shared_gate", (d, 1), ("embed", "router"), self.init_std)
                shared = shared * jax.nn.sigmoid(dense(x, w, "BTD,DO->BTO"))
            y = y + shared

        mask = jnp.ones((b * t,), bool) if valid is None else valid.reshape(b * t)
        stats = {"balance": moe_ops.balance_loss(routing, mask),
                 "z": moe_ops.router_z_loss(routing, mask),
                 "load": moe_ops.expert_load(routing.experts, mask, e)}
        return y.astype(self.dtype), stats


def expert_split() -> moe_dispatch.ExpertSplit | None:
    """``moe_dispatch.expert_split`` of the mesh and rules in context (None: E not split)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    (batch,) = nn.logical_to_mesh_axes(("batch",))
    experts, embed, mlp = nn.logical_to_mesh_axes(("experts", "expert_embed", "expert_mlp"))
    return moe_dispatch.expert_split(mesh, batch, experts, embed, mlp)


def balance_correction_bias(params: dict, load: jax.Array, rate: float,
                            sparse_layers: tuple[int, ...]) -> dict:
    """The auxiliary-loss-free balancing update (DeepSeek-V3) of every sparse layer's
    ``correction_bias``: ``bias += rate * sign(mean(load) - load)``.

    Args:
      params: the model's params (any layer layout).
      load: [L_sparse, E] each sparse layer's expert load (``Output.moe["load"]``, summed).
      rate, sparse_layers: the update's step; the sparse layers' numbers, in ``load``'s order.

    Returns:
      ``params`` with each ``correction_bias`` updated (in float32, stored in its dtype).
    """
    step = rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)  # [L_sparse, E]
    row = {layer: j for j, layer in enumerate(sparse_layers)}
    stacked = stacked_layers(params)
    out = dict(params)
    for path, is_stacked in block_paths(params):
        moe = tree_get(params, path).get("moe", {})
        if CORRECTION_BIAS not in moe:
            continue
        layers = stacked[path] if is_stacked else [int(path[0].removeprefix("blocks_"))]
        delta = step[jnp.asarray([row[i] for i in layers])]
        bias = moe[CORRECTION_BIAS]
        new = (bias.astype(jnp.float32) + (delta if is_stacked else delta[0])).astype(bias.dtype)
        out = tree_set(out, (*path, "moe", CORRECTION_BIAS), new)
    return out
