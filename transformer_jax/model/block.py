"""One Transformer layer (``Block``) and the period of a scanned layer group (``Period``)."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax

from transformer_jax.model.config import ModelConfig
from transformer_jax.model.latent import LatentAttention
from transformer_jax.model.layers import MLP, Attention, Carry, LayerKind, Norm
from transformer_jax.model.moe import RouterStats, SparseFFN
from transformer_jax.model.stack import LayerGroup, LayerSpec


class Block(nn.Module):
    """One Transformer layer: attention then FFN, each in a residual branch (``norm_position``:
    ``"pre"`` ``x + f(norm(x))``, ``"post"`` ``norm(x + f(x))``, ``"sandwich"``
    ``x + norm_out(f(norm(x)))``, ``"post_branch"`` ``x + norm_out(f(x))``). In a scan, ``group``
    and ``position`` turn the traced repeat index into the ``LayerRef`` its cache reads."""

    config: ModelConfig
    spec: LayerSpec = LayerSpec()
    group: LayerGroup | None = None
    position: int = 0

    @nn.compact
    def __call__(self, carry: Carry, positions: jax.Array, layer: int | jax.Array = 0,
                 segment_ids: jax.Array | None = None
                 ) -> tuple[Carry, RouterStats | None]:
        """([B, T, D], cache) -> (([B, T, D], cache), router stats or None); ``layer``: the layer's
        number, or with ``group`` the scan's (traced) repeat index."""
        x, cache = carry
        # The residual stream's only sharding annotation (a no-op without rules in scope).
        x = nn.with_logical_constraint(x, ("batch", "length", "act_embed"))
        c = self.config
        dtypes = dict(dtype=c.jnp_dtype, param_dtype=c.jnp_param_dtype)
        # GPT-2's scaled initialisation of the residual branches' outputs.
        out_std = c.init_std / (2 * c.n_layers) ** 0.5
        norm = functools.partial(Norm, kind=c.norm, eps=c.norm_eps, offset=c.norm_offset,
                                 param_dtype=c.jnp_param_dtype)
        if self.spec.attention == "latent":
            scale = c.attn_scale if c.attn_scale is not None else c.mla.scale(c.rope_scaling)
            attn = LatentAttention(
                n_heads=c.n_heads, mla=c.mla, scale=scale, rope_pairing=c.rope_pairing,
                impl=c.attention_impl, init_std=c.init_std, out_init_std=out_std, name="attn",
                **dtypes)
        else:
            attn = Attention(
                n_heads=c.n_heads, n_kv_heads=c.n_kv_heads, head_dim=c.head_dim,
                qkv_bias=c.qkv_bias, o_bias=c.o_bias, sinks=c.attn_sinks,
                qk_norm=c.qk_norm if self.spec.rope else None, norm_eps=c.norm_eps,
                norm_offset=c.norm_offset, scale=c.attn_scale, softcap=c.attn_softcap,
                rope_pairing=c.rope_pairing, impl=c.attention_impl, init_std=c.init_std,
                out_init_std=out_std, name="attn", **dtypes)
        if self.group is not None:
            layer = self.group.ref(self.position, layer)
        stats = None
        if self.spec.sparse:
            moe = SparseFFN(moe=c.moe, kind=c.ffn, swiglu=c.swiglu, impl=c.moe_impl,
                            init_std=c.init_std, out_init_std=out_std, name="moe", **dtypes)
            valid = None if segment_ids is None else segment_ids > 0

            def mlp(h: jax.Array) -> jax.Array:
                nonlocal stats
                y, stats = moe(h, valid)
                return y
        else:
            mlp = MLP(d_ff=c.d_ff, kind=c.ffn, swiglu=c.swiglu, init_std=c.init_std,
                      out_init_std=out_std, name="mlp", **dtypes)
        kind = LayerKind.of(c, self.spec)
        if c.norm_position == "pre":  # x + f(norm(x))
            y, cache = attn(norm(name="attn_norm")(x), positions, kind, cache, layer, segment_ids)
            x = x + y
            x = x + mlp(norm(name="mlp_norm")(x))
        elif c.norm_position == "sandwich":  # x + norm_out(f(norm(x)))
            y, cache = attn(norm(name="attn_norm")(x), positions, kind, cache, layer, segment_ids)
            x = x + norm(name="attn_out_norm")(y)
            x = x + norm(name="mlp_out_norm")(mlp(norm(name="mlp_norm")(x)))
        elif c.norm_position == "post_branch":  # x + norm_out(f(x))
            y, cache = attn(x, positions, kind, cache, layer, segment_ids)
            x = x + norm(name="attn_out_norm")(y)
            x = x + norm(name="mlp_out_norm")(mlp(x))
        else:  # "post": norm(x + f(x))
            y, cache = attn(x, positions, kind, cache, layer, segment_ids)
            x = norm(name="attn_norm")(x + y)
            x = norm(name="mlp_norm")(x + mlp(x))
        return (x, cache), stats


class Period(nn.Module):
    """One repeat of a scanned group's period: its blocks (``layer_{j}``), each of its own spec."""

    config: ModelConfig
    group: LayerGroup
    block: type[nn.Module] = Block

    @nn.compact
    def __call__(self, carry: Carry, positions: jax.Array, r: jax.Array,
                 segment_ids: jax.Array | None = None
                 ) -> tuple[Carry, tuple[RouterStats, ...]]:
        """(carry, positions, repeat index) -> (carry, the sparse blocks' stats in order)."""
        stats = []
        for j, spec in enumerate(self.group.period):
            carry, s = self.block(self.config, spec, self.group, j, name=f"layer_{j}")(
                carry, positions, r, segment_ids)
            if s is not None:
                stats.append(s)
        return carry, tuple(stats)

