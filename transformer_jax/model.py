"""The decoder-only Transformer: embed -> L blocks (unrolled or scanned) -> final norm -> logits.

``Transformer(config).apply({"params": params}, tokens)`` returns [B, T, V] float32 logits.
Passing a ``KVCache`` returns ``(logits, cache)`` with the chunk's keys/values written in, which
is all prefill and decode need: ``decode.py`` runs this same forward.
"""

from __future__ import annotations

from typing import Any

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax import ops
from transformer_jax.config import ModelConfig
from transformer_jax.kv_cache import KVCache
from transformer_jax.layers import Block, Embed, Norm
from transformer_jax.ops.dense import dense

Params = dict[str, Any]

_REMAT_POLICIES = {
    "full": None,  # save nothing inside a block: recompute it all in the backward pass
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class Transformer(nn.Module):
    """Decoder-only language model (LLaMA family; Mistral and Qwen2 by config).

    The one forward of the library: training calls it on whole sequences, prefill on padded
    prompts with an empty cache, and every decode step on one token per sequence with the cache
    (``decode.py``). The blocks are unrolled, or scanned with ``config.scan_layers`` (then the
    program, and its compile time, do not grow with depth, decode included).

    Tensor parallelism runs this same forward one of two ways. Under ``jit`` with a mesh and
    the logical-axis rules in context (training), XLA partitions it from the parameters'
    shardings. Inside ``shard_map`` (decode), each device runs it on its own block of every
    matrix: ``config`` is then the shard's view (``layers.shard_config``), ``tensor_axis``
    names the mesh axis the blocks' branch outputs are summed over, and with ``vocab_split``
    the embedding rows and head columns are split too (the logits are gathered whole).
    """

    config: ModelConfig
    tensor_axis: str | None = None
    vocab_split: bool = False

    @nn.compact
    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
                 cache: KVCache | None = None, segment_ids: jax.Array | None = None,
                 logits_at: jax.Array | None = None, hidden_only: bool = False
                 ) -> jax.Array | tuple[jax.Array, KVCache]:
        """Next-token logits for every position, or for one position per sequence.

        Args:
          tokens: [B, T] int token ids.
          positions: [B, T] int positions; default ``arange(T)``, or with a cache
            ``cache.lengths[:, None] + arange(T)`` (continue each sequence where it stopped).
          cache: optional ``KVCache`` with S_max slots; the chunk's keys/values are written at
            slots ``positions[:, 0] ..`` (which must stay below S_max), and queries attend to
            every slot up to their position.
          segment_ids: optional [B, T] ids of packed sequences (0 = padding), without a cache.
          logits_at: optional [B] int index in [0, T) per sequence: the final norm and the LM
            head run for that token only (a prompt's last real token in prefill), and the
            logits are [B, V].
          hidden_only: return the final-normed [B, T, D] hidden states instead of logits, for
            a loss that applies the LM head itself in chunks (``ops.lm_loss``).

        Returns:
          [B, T, V] float32 logits ([B, V] with ``logits_at``), or ``(logits, updated cache)``
          when a cache is given; the updated cache's lengths are ``positions[:, -1] + 1``.
        """
        c = self.config
        chex.assert_rank(tokens, 2)
        b, t = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
            if cache is not None:
                positions = positions + cache.lengths[:, None]
        chex.assert_shape(positions, (b, t))

        vocab_axis = self.tensor_axis if self.vocab_split else None
        embed = Embed(c.vocab_size, c.d_model, init_std=c.init_std, dtype=c.jnp_dtype,
                      param_dtype=c.jnp_param_dtype, vocab_axis=vocab_axis, name="embed")
        x = embed(tokens)
        if c.position == "sinusoidal":
            x = x + ops.sinusoidal_positions(positions, c.d_model).astype(x.dtype)

        block_cls = Block
        if c.remat != "none":
            block_cls = nn.remat(block_cls, policy=_REMAT_POLICIES[c.remat],
                                 prevent_cse=not c.scan_layers)
        carry = (x, cache)
        if c.scan_layers:
            # The cache rides in the carry and each layer indexes it with its (traced) number,
            # so XLA updates it in place rather than slicing and restacking it per layer.
            blocks = nn.scan(
                block_cls, variable_axes={"params": 0}, split_rngs={"params": True},
                in_axes=(nn.broadcast, 0, nn.broadcast), length=c.n_layers,
                metadata_params={nn.PARTITION_NAME: "layers"})(
                    c, self.tensor_axis, name="blocks")
            carry, _ = blocks(carry, positions, jnp.arange(c.n_layers), segment_ids)
        else:
            for i in range(c.n_layers):
                carry, _ = block_cls(c, self.tensor_axis, name=f"blocks_{i}")(
                    carry, positions, i, segment_ids)
        x, cache = carry

        if logits_at is not None:
            x = x[jnp.arange(b), logits_at][:, None]  # [B, 1, D]
        x = Norm(kind=c.norm, eps=c.norm_eps, param_dtype=c.jnp_param_dtype,
                 name="final_norm")(x)
        if hidden_only:
            if self.is_initializing() and not c.tie_embeddings:
                self.lm_head_kernel()
            return x if cache is None else (x, cache)
        if c.tie_embeddings and not c.weights_out_first:
            logits = embed.attend(x)
        else:
            # The [V, D] table is the head stored out-first.
            head = embed.embedding if c.tie_embeddings else self.lm_head_kernel()
            logits = dense(x, head.astype(c.jnp_dtype), "BTD,DV->BTV",
                           out_first=c.weights_out_first, preferred_element_type=jnp.float32)
        if vocab_axis is not None:  # this shard's [.., V/T] block -> the whole [.., V]
            logits = jax.lax.all_gather(logits, vocab_axis, axis=2, tiled=True)
        if logits_at is not None:
            logits = logits[:, 0]
        if cache is None:
            return logits
        return logits, cache.replace(lengths=(positions[:, -1] + 1).astype(jnp.int32))

    def lm_head_kernel(self) -> jax.Array:
        """The untied LM head [D, V] (declared here so both output paths share it)."""
        c = self.config
        shape, axes = (c.d_model, c.vocab_size), ("embed", "vocab")
        if c.weights_out_first:
            shape, axes = shape[::-1], axes[::-1]
        return self.param("lm_head", nn.with_logical_partitioning(
            nn.initializers.normal(c.init_std), axes), shape, c.jnp_param_dtype)


def _dummy_tokens(config: ModelConfig) -> jax.Array:
    return jnp.zeros((1, min(8, config.max_seq_len)), jnp.int32)


def init_model(config: ModelConfig) -> Transformer:
    """The module whose ``init`` creates ``config``'s parameters: attention on the reference.

    Parameters do not depend on the attention implementation, and the init's dummy forward (a
    few tokens) should neither pick one (``"auto"`` would log its choice for the dummy's
    shapes, not the run's) nor need a kernel the backend lacks (the real step reports that).
    """
    return Transformer(config.replace(attention_impl="xla"))


def init_params(config: ModelConfig, rng: jax.Array | int = 0) -> Params:
    """Randomly initialised parameters (plain arrays, no partitioning boxes)."""
    if isinstance(rng, int):
        rng = jax.random.key(rng)
    variables = init_model(config).init(rng, _dummy_tokens(config))
    return nn.meta.unbox(variables["params"])


def abstract_params(config: ModelConfig) -> Params:
    """Parameter shapes and dtypes as ``jax.ShapeDtypeStruct``s, without allocating them."""
    boxed = jax.eval_shape(lambda: init_model(config).init(jax.random.key(0),
                                                            _dummy_tokens(config)))
    return nn.meta.unbox(boxed["params"])


def logical_axes(config: ModelConfig) -> Params:
    """The logical axis names of every parameter, as a tree of ``PartitionSpec``s."""
    boxed = jax.eval_shape(lambda: init_model(config).init(jax.random.key(0),
                                                            _dummy_tokens(config)))
    return nn.get_partition_spec(boxed["params"])


def param_count(config: ModelConfig) -> int:
    """Number of parameters, computed from shapes alone (``jax.eval_shape``)."""
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract_params(config)))


def stack_blocks(params: Params, n_layers: int) -> Params:
    """Unrolled layout (``blocks_0`` ..) -> scanned layout (``blocks`` with a leading L axis)."""
    params = dict(params)
    layers = [params.pop(f"blocks_{i}") for i in range(n_layers)]
    params["blocks"] = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
    return params


def unstack_blocks(params: Params) -> Params:
    """Scanned layout (``blocks``, [L, ...]) -> unrolled layout (``blocks_0`` ..)."""
    params = dict(params)
    stacked = params.pop("blocks")
    n_layers = jax.tree.leaves(stacked)[0].shape[0]
    for i in range(n_layers):
        params[f"blocks_{i}"] = jax.tree.map(lambda x, i=i: x[i], stacked)
    return params
