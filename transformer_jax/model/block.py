"""One Transformer layer (``Block``): attention then FFN, dense or a mixture of experts, each in
a residual branch; the period of a scanned layer group (``Period``); and the config one shard of
a tensor split sees (``shard_config``)."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax

from transformer_jax.model.config import ModelConfig
from transformer_jax.model.layers import MLP, Attention, Carry, LayerKind, Norm
from transformer_jax.model.moe import RouterStats, SparseFFN
from transformer_jax.model.stack import LayerGroup, LayerSpec


class Block(nn.Module):
    """One Transformer layer: attention then FFN, each in a residual branch.

    ``norm_position``: ``"pre"`` (default) ``x + f(norm(x))``; ``"post"`` (original
    Transformer) ``norm(x + f(x))``; ``"sandwich"`` ``x + norm_out(f(norm(x)))`` (the four
    norms of some families); ``"post_branch"`` ``x + norm_out(f(x))``. What the layer is
    (its window and RoPE, dense or sparse FFN) is its ``spec``, a Python value: a layer scan
    scans runs of the same specs (``stack.LayerGroup``), so one block serves every kind.

    With ``tensor_axis`` the block runs inside ``shard_map`` on one shard of a Megatron split:
    its config counts this shard's heads, kv heads and FFN units (``shard_config``), and each
    branch's output (a partial sum over the shard's heads or units) is summed over the axis.
    With ``expert_axis`` too, a sparse layer holds one shard of the experts (``SparseFFN``).

    In a scan, ``group`` and ``position`` say where the block sits (position ``position`` of
    the group's period), so that the traced repeat index it is called with becomes the
    ``LayerRef`` its cache reads.
    """

    config: ModelConfig
    spec: LayerSpec = LayerSpec()
    tensor_axis: str | None = None
    expert_axis: str | None = None
    group: LayerGroup | None = None
    position: int = 0

    @nn.compact
    def __call__(self, carry: Carry, positions: jax.Array, layer: int | jax.Array = 0,
                 segment_ids: jax.Array | None = None
                 ) -> tuple[Carry, RouterStats | None]:
        """([B, T, D], cache) -> (([B, T, D], updated cache), router stats or None).

        ``layer`` is the layer's number (unrolled), or with ``group`` the repeat index of a
        scan (traced). The (carry, ...) -> (carry, y) form is ``nn.scan``'s (which stacks the
        sparse layers' ``RouterStats``). A dense layer returns None for its stats.
        """
        x, cache = carry
        # The residual stream's only sharding annotation: under a mesh's logical-axis rules it
        # keeps activations split over the batch axes (so FSDP gathers weights, not
        # activations); without rules in scope it is a no-op.
        x = nn.with_logical_constraint(x, ("batch", "length", "act_embed"))
        c = self.config
        dtypes = dict(dtype=c.jnp_dtype, param_dtype=c.jnp_param_dtype)
        # Residual-branch outputs start smaller so the stream's variance does not grow with
        # depth (GPT-2's scaled initialisation).
        out_std = c.init_std / (2 * c.n_layers) ** 0.5
        norm_kw = dict(kind=c.norm, eps=c.norm_eps, offset=c.norm_offset,
                       param_dtype=c.jnp_param_dtype)
        attn = Attention(
            n_heads=c.n_heads, n_kv_heads=c.n_kv_heads, head_dim=c.head_dim,
            qkv_bias=c.qkv_bias, qk_norm=c.qk_norm, norm_eps=c.norm_eps,
            norm_offset=c.norm_offset, scale=c.attn_scale, softcap=c.attn_softcap,
            rope_pairing=c.rope_pairing, impl=c.attention_impl, init_std=c.init_std,
            out_init_std=out_std, tensor_axis=self.tensor_axis, name="attn", **dtypes)
        if self.group is not None:
            layer = self.group.ref(self.position, layer)
        stats = None
        if self.spec.sparse:
            moe = SparseFFN(moe=c.moe, expert_axis=self.expert_axis, kind=c.ffn,
                            impl=c.moe_impl, init_std=c.init_std,
                            out_init_std=out_std, name="moe",
                            **dtypes)
            valid = None if segment_ids is None else segment_ids > 0

            def mlp(h: jax.Array) -> jax.Array:
                nonlocal stats
                y, stats = moe(h, valid)
                return y
        else:
            mlp = MLP(d_ff=c.d_ff, kind=c.ffn, init_std=c.init_std, out_init_std=out_std,
                      name="mlp", **dtypes)
        kind = LayerKind.of(c, self.spec)

        def total(y: jax.Array) -> jax.Array:
            return y if self.tensor_axis is None else jax.lax.psum(y, self.tensor_axis)

        def norm(name: str) -> Norm:
            return Norm(name=name, **norm_kw)

        if c.norm_position == "pre":  # x + f(norm(x))
            y, cache = attn(norm("attn_norm")(x), positions, kind, cache, layer, segment_ids)
            x = x + total(y)
            x = x + total(mlp(norm("mlp_norm")(x)))
        elif c.norm_position == "sandwich":  # x + norm_out(f(norm(x)))
            y, cache = attn(norm("attn_norm")(x), positions, kind, cache, layer, segment_ids)
            x = x + norm("attn_out_norm")(total(y))
            x = x + norm("mlp_out_norm")(total(mlp(norm("mlp_norm")(x))))
        elif c.norm_position == "post_branch":  # x + norm_out(f(x))
            y, cache = attn(x, positions, kind, cache, layer, segment_ids)
            x = x + norm("attn_out_norm")(total(y))
            x = x + norm("mlp_out_norm")(total(mlp(x)))
        else:  # "post": norm(x + f(x))
            y, cache = attn(x, positions, kind, cache, layer, segment_ids)
            x = norm("attn_norm")(x + total(y))
            x = norm("mlp_norm")(x + total(mlp(x)))
        return (x, cache), stats


class Period(nn.Module):
    """One repeat of a scanned group's period: its blocks (``layer_{j}``) in order.

    ``nn.scan`` scans it over the group's repeats (``Transformer``); each block keeps its own
    spec as a Python value, so a 5 local : 1 global period runs five window layers and one
    full one in the scan body, each reading only its own cache.
    """

    config: ModelConfig
    group: LayerGroup
    block: type[nn.Module] = Block
    tensor_axis: str | None = None
    expert_axis: str | None = None

    @nn.compact
    def __call__(self, carry: Carry, positions: jax.Array, r: jax.Array,
                 segment_ids: jax.Array | None = None
                 ) -> tuple[Carry, tuple[RouterStats, ...]]:
        """(carry, positions, repeat index) -> (carry, the sparse blocks' stats in order)."""
        stats = []
        for j, spec in enumerate(self.group.period):
            carry, s = self.block(self.config, spec, self.tensor_axis, self.expert_axis,
                                  self.group, j, name=f"layer_{j}")(
                carry, positions, r, segment_ids)
            if s is not None:
                stats.append(s)
        return carry, tuple(stats)


def shard_config(config: ModelConfig, shards: int, *, vocab: bool) -> ModelConfig:
    """The config one shard of a T-way tensor split sees: N/T heads, K/T kv heads, F/T FFN
    units (and V/T vocabulary rows with ``vocab``), the head size unchanged.

    Contiguous blocks of heads keep the grouping: query head r of shard i is global head
    i * N/T + r, whose kv head i * K/T + floor(r / G) is this shard's kv head floor(r / G).
    """
    c = config
    m = c.moe
    for name, value in (("n_heads", c.n_heads), ("n_kv_heads", c.n_kv_heads), ("d_ff", c.d_ff),
                        *((("vocab_size", c.vocab_size),) if vocab else ()),
                        *((("moe.d_ff", m.d_ff), ("moe.shared_d_ff", m.shared_d_ff)) if m else ())):
        if value % shards:
            raise ValueError(f"{name}={value} does not split over {shards} shards")
    moe = m and dataclasses.replace(m, d_ff=m.d_ff // shards,
                                    shared_d_ff=m.shared_d_ff // shards)
    return c.replace(n_heads=c.n_heads // shards, n_kv_heads=c.n_kv_heads // shards,
                     head_dim=c.head_dim, d_ff=c.d_ff // shards, moe=moe,
                     vocab_size=c.vocab_size // shards if vocab else c.vocab_size)
