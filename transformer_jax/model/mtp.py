"""Multi-token prediction (``Architecture.mtp_depth``): modules after the stack predicting the
tokens past the next one (a training loss, a speculative draft). Module k at position i:

    h'_i = eh_proj([emb_norm(emb(t_{i+k})); hidden_norm(h^{k-1}_i)])      [2D] -> [D]
    h^k = Block(h');  logits^k_i = lm_head(head_norm(h^k_i))           (token i + k + 1)

``h^0`` is the final-normed hidden state; each module ``mtp_{k-1}`` has its own LM head.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer_jax.model import ops
from transformer_jax.model.block import Block
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.layers import Norm, matrix
from transformer_jax.model.ops.dense import dense


def module_key(k: int) -> str:
    """The params key of module k (1-based): ``mtp_{k-1}``."""
    return f"mtp_{k - 1}"


def shifted(x: jax.Array, k: int) -> jax.Array:
    """x [B, T, ...] moved k positions left along T (entry i: x[:, i + k]; the last k zeros)."""
    k = min(k, x.shape[1])
    return jnp.concatenate([x[:, k:], jnp.zeros_like(x[:, :k])], axis=1)


class MTPModule(nn.Module):
    """One multi-token prediction module: (h^{k-1}, emb) -> (h^k, logits); ``layer`` indexes the
    cache it is given (the draft's own), without which it attends within ``segment_ids``."""

    config: ModelConfig

    @nn.compact
    def __call__(self, hidden: jax.Array, emb: jax.Array, positions: jax.Array,
                 cache: Any = None, layer: int = 0, segment_ids: jax.Array | None = None,
                 logits_at: jax.Array | None = None) -> tuple[jax.Array, jax.Array, Any]:
        """([B, T, D] previous hidden, [B, T, D] embeddings k tokens ahead, [B, T] positions) ->
        ([B, T, D] block output, [B, T, V] float32 logits ([B, V] at ``logits_at``), cache)."""
        c = self.config
        norm_kw = dict(kind=c.norm, eps=c.norm_eps, offset=c.norm_offset,
                       param_dtype=c.jnp_param_dtype)
        e = Norm(name="emb_norm", **norm_kw)(emb)
        h = Norm(name="hidden_norm", **norm_kw)(hidden)
        w = matrix(self, "eh_proj", (2 * c.d_model, c.d_model), ("mlp", "embed"),
                   nn.initializers.normal(c.init_std), param_dtype=c.jnp_param_dtype)
        x = dense(jnp.concatenate([e, h], axis=-1).astype(c.jnp_dtype),
                  w.astype(c.jnp_dtype), "BTI,ID->BTD")
        (x, cache), _ = Block(c, c.mtp_spec(), name="block")((x, cache), positions, layer,
                                                             segment_ids)
        y = x if logits_at is None else x[jnp.arange(x.shape[0]), logits_at][:, None]
        y = Norm(name="head_norm", **norm_kw)(y)
        head = matrix(self, "lm_head", (c.d_model, c.vocab_size), ("embed", "vocab"),
                      nn.initializers.normal(c.init_std), param_dtype=c.jnp_param_dtype)
        logits = dense(y, head.astype(c.jnp_dtype), "BTD,DV->BTV",
                       preferred_element_type=jnp.float32)
        if c.final_softcap is not None:
            logits = ops.softcap(logits, c.final_softcap)
        return x, logits if logits_at is None else logits[:, 0], cache


def mtp_logits(config: ModelConfig, hidden: jax.Array, emb: jax.Array, positions: jax.Array,
               segment_ids: jax.Array | None) -> jax.Array:
    """Every module's logits inside the ``Transformer``'s forward: [B, T, D] final-normed hidden
    and token embeddings -> [D_mtp, B, T, V] float32 (module k's entry i: token i + k + 1)."""
    out = []
    for k in range(1, config.mtp_depth + 1):
        hidden, logits, _ = MTPModule(config, name=module_key(k))(
            hidden, shifted(emb, k), positions, segment_ids=segment_ids)
        out.append(logits)
    return jnp.stack(out)


def mtp_targets(targets: jax.Array, mask: jax.Array | None, segment_ids: jax.Array | None,
                k: int) -> tuple[jax.Array, jax.Array]:
    """Module k's targets and weights [B, T] from the next-token ``targets`` and optional ``mask``:
    entry i is ``targets[i + k]``, weighted as that target is, 0 past the row's end or across a
    packed segment."""
    w = jnp.ones(targets.shape, jnp.float32) if mask is None else mask.astype(jnp.float32)
    w = shifted(w, k)
    if segment_ids is not None:
        w = w * (shifted(segment_ids, k) == segment_ids)
    return shifted(targets, k), w
