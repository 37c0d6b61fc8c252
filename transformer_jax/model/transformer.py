"""The decoder-only Transformer: embed -> L blocks (unrolled or scanned) -> final norm -> logits.

``Transformer(config).apply({"params": params}, tokens).logits`` are [B, T, V] float32 logits;
with a ``KVCache`` the forward also returns it updated (``Output.cache``): prefill and decode.
"""

from __future__ import annotations

from typing import Any

import chex
import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.model import ops, remat
from transformer_jax.model.block import Block, Period
from transformer_jax.model.config import Architecture, ModelConfig
from transformer_jax.model.kv_cache import Cache
from transformer_jax.model.layers import EMBEDDING_PARAM, Carry, Embed, Norm, matrix
from transformer_jax.model.mtp import mtp_logits
from transformer_jax.model.ops import target
from transformer_jax.model.ops.dense import dense
from transformer_jax.model.ops.layouts import OutFirst
from transformer_jax.model.stack import group_key, group_layers, is_scanned_key, restack

Params = dict[str, Any]

@flax.struct.dataclass
class Output:
    """What the forward returns (None where not asked for).

    Attributes:
      logits: [B, T, V] float32 next-token logits ([B, V] with ``logits_at``).
      cache: the updated cache when one was given (lengths ``positions[:, -1] + 1``).
      hidden: the final-normed [B, T, D] hidden states (``hidden_only``, ``with_hidden``).
      mtp: with ``mtp=True``, the prediction modules' [D_mtp, B, T, V] float32 logits.
      moe: the sparse layers' ``moe.RouterStats`` stacked (``balance``, ``z`` [L_sparse],
        ``load`` [L_sparse, E]).
    """

    logits: jax.Array | None = None
    cache: Any = None
    hidden: jax.Array | None = None
    moe: dict[str, jax.Array] | None = None
    mtp: jax.Array | None = None


class Transformer(nn.Module):
    """Decoder-only language model: every family it runs is a set of ``Architecture`` fields.

    The one forward for training, prefill and decode; blocks unrolled or scanned
    (``config.scan_layers``); weights float or prepared (``decode.prepare``), as they are.
    """

    config: ModelConfig

    @nn.compact
    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
                 cache: Cache | None = None, segment_ids: jax.Array | None = None,
                 logits_at: jax.Array | None = None, hidden_only: bool = False,
                 mtp: bool = False, with_hidden: bool = False) -> Output:
        """Next-token logits for every position, or for one position per sequence.

        Args:
          tokens: [B, T] int token ids.
          positions: [B, T] int positions; default ``arange(T)`` (after ``cache.lengths``).
          cache: optional ``Cache`` (``KVCache`` with S_max slots, or ``serving.PagedKVCache``);
            the chunk is written at slots ``positions[:, 0] ..`` (below S_max).
          segment_ids: optional [B, T] ids of packed sequences (0 = padding), without a cache.
          logits_at: optional [B] int index in [0, T) per sequence: the final norm and the LM
            head run for that token only, and the logits are [B, V].
          hidden_only, with_hidden: return the final-normed [B, T, D] hidden states instead of
            the logits (for ``ops.lm_loss``), or beside them (for a draft).
          mtp: also run the multi-token prediction modules over the whole sequences
            (``Output.mtp``); not with ``logits_at`` or a cache.

        Returns:
          An ``Output``: the logits (or hidden states) and the updated cache.
        """
        c = self.config
        chex.assert_rank(tokens, 2)
        b, t = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
            if cache is not None:
                positions = positions + cache.lengths[:, None]
        chex.assert_shape(positions, (b, t))

        embed = Embed(c.vocab_size, c.d_model, init_std=c.init_std, dtype=c.jnp_dtype,
                      param_dtype=c.jnp_param_dtype, name="embed")
        x = embed(tokens)
        if c.scale_embeddings:  # sqrt(D), rounded to the compute dtype as the product is
            x = x * jnp.asarray(c.d_model ** 0.5, x.dtype)
        token_embeddings = x
        if c.position == "sinusoidal":
            x = x + ops.sinusoidal_positions(positions, c.d_model).astype(x.dtype)

        carry, moe_stats = self._blocks((x, cache), positions, segment_ids)
        x, cache = carry
        if cache is not None:
            cache = cache.replace(lengths=(positions[:, -1] + 1).astype(jnp.int32))

        final_norm = Norm(kind=c.norm, eps=c.norm_eps, offset=c.norm_offset,
                          param_dtype=c.jnp_param_dtype, name="final_norm")
        hidden = None
        if with_hidden:  # every position's; the norm is per token, so slicing after it is exact
            x = hidden = final_norm(x)
        if logits_at is not None:
            x = x[jnp.arange(b), logits_at][:, None]  # [B, 1, D]
        if hidden is None:
            x = final_norm(x)
        head = embed.embedding if c.tie_embeddings else matrix(
            self, "lm_head", (c.d_model, c.vocab_size), ("embed", "vocab"),
            nn.initializers.normal(c.init_std), param_dtype=c.jnp_param_dtype)
        mtp_out = None
        if c.mtp_depth and (mtp or self.is_initializing()):
            if logits_at is not None or cache is not None:
                raise ValueError("mtp=True runs over whole sequences: not with logits_at or a "
                                 "cache")
            mtp_out = mtp_logits(c, x, token_embeddings, positions, segment_ids)
        if hidden_only:
            return Output(cache=cache, hidden=x, moe=moe_stats, mtp=mtp_out)
        if c.tie_embeddings and not isinstance(head, OutFirst):  # the table, trained as stored
            logits = ops.tied_logits(x, head.astype(c.jnp_dtype))
        else:  # [D, V], or prepared: a tied table as an out-first head (``ops.layouts``)
            logits = dense(x, head.astype(c.jnp_dtype), "BTD,DV->BTV",
                           preferred_element_type=jnp.float32)
        if c.final_softcap is not None:
            logits = ops.softcap(logits, c.final_softcap)
        if logits_at is not None:
            logits = logits[:, 0]
        return Output(logits=logits, cache=cache, moe=moe_stats, mtp=mtp_out, hidden=hidden)

    def _blocks(self, carry: Carry, positions: jax.Array, segment_ids: jax.Array | None
                ) -> tuple[Carry, dict[str, jax.Array] | None]:
        """The L blocks over (x, cache): (the carry, the sparse layers' router stats, or None)."""
        c = self.config
        block_cls = Block
        if c.remat != "none":
            # The policy follows the target's platform (an offload needs device memory).
            block_cls = nn.remat(block_cls, policy=remat.policy(c.remat, target.platform()),
                                 prevent_cse=not c.scan_layers)
        stats = []
        if not c.scan_layers:
            for i, spec in enumerate(c.layer_specs()):
                carry, s = block_cls(c, spec, name=f"blocks_{i}")(carry, positions, i, segment_ids)
                stats.append(s)
        groups = c.layer_groups() if c.scan_layers else ()
        for g, group in enumerate(groups):
            # The cache rides in the carry (each block indexes it): XLA updates it in place.
            if len(group.period) == 1:
                body, args = block_cls, dict(spec=group.period[0], group=group)
            else:
                body, args = Period, dict(group=group, block=block_cls)
            scan = nn.scan(body, variable_axes={"params": 0}, split_rngs={"params": True},
                           in_axes=(nn.broadcast, 0, nn.broadcast), length=group.repeats,
                           metadata_params={nn.PARTITION_NAME: "layers"})
            carry, s = scan(c, **args, name=group_key(groups, g))(
                carry, positions, jnp.arange(group.repeats), segment_ids)
            if isinstance(s, tuple):  # a period's sparse blocks: [R] each -> [R * n] in order
                s = jax.tree.map(lambda *xs: jnp.stack(xs, 1).reshape(-1, *xs[0].shape[1:]),
                                 *s) if s else None
            stats.append(s)
        sparse = [s for s in stats if s is not None]
        return carry, jax.tree.map(lambda *xs: jnp.concatenate(
            [x if c.scan_layers else x[None] for x in xs]), *sparse) if sparse else None

    def lm_head(self, params: Params) -> jax.Array | OutFirst:
        """The LM head of ``params`` as [D, V]: ``lm_head``, or the tied table as ``OutFirst``."""
        if not self.config.tie_embeddings:
            return params["lm_head"]
        table = params[EMBED][EMBEDDING_PARAM]
        return table if isinstance(table, OutFirst) else OutFirst(table)


EMBED = "embed"


def _boxed_init(config: ModelConfig, rng: jax.Array) -> Params:
    """The model's boxed parameters, from an init on a dummy batch with the reference attention."""
    tokens = jnp.zeros((1, min(8, config.max_seq_len)), jnp.int32)
    model = Transformer(config.replace(attention_impl="xla"))
    return model.init(rng, tokens)["params"]


def init_params(config: ModelConfig, rng: jax.Array | int = 0) -> Params:
    """Randomly initialised parameters (plain arrays, no partitioning boxes)."""
    if isinstance(rng, int):
        rng = jax.random.key(rng)
    return nn.meta.unbox(_boxed_init(config, rng))


def abstract_params(config: ModelConfig) -> Params:
    """Parameter shapes and dtypes as ``jax.ShapeDtypeStruct``s, without allocating them."""
    return nn.meta.unbox(jax.eval_shape(lambda: _boxed_init(config, jax.random.key(0))))


def logical_axes(config: ModelConfig) -> Params:
    """The logical axis names of every parameter, as a tree of ``PartitionSpec``s."""
    return nn.get_partition_spec(jax.eval_shape(lambda: _boxed_init(config, jax.random.key(0))))


def param_count(config: ModelConfig) -> int:
    """Number of parameters, computed from shapes alone (``jax.eval_shape``)."""
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract_params(config)))


def stack_blocks(params: Params, config: Architecture) -> Params:
    """Unrolled layout (``blocks_0`` ..) -> scanned: each layer group stacked under its key."""
    return restack(params, group_layers(config.layer_groups()))


def unstack_blocks(params: Params) -> Params:
    """Scanned layout (``stack_blocks``'s, read off the tree) -> unrolled (``blocks_0`` ..)."""
    return restack(params, {})


def is_scanned(params: Params) -> bool:
    """Whether ``params`` hold their layers in the scanned layout (``stack_blocks``)."""
    return any(is_scanned_key(k) for k in params)


def scanned_places(config: Architecture) -> dict[str, tuple[tuple[str, ...], int]]:
    """Unrolled ``blocks_{i}`` -> (the scanned params path stacking it, its index along it)."""
    return {f"blocks_{i}": (path, r) for path, layers in
            group_layers(config.layer_groups()).items() for r, i in enumerate(layers)}
