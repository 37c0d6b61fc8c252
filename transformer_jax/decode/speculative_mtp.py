"""The multi-token prediction draft (``speculative="mtp"``): the target's own module 1
(``model.mtp``) combines the target's hidden state h_j and token t_{j+1} to propose t_{j+2}.

It runs over the positions of each target forward with the target's draws, in a one-layer cache
of its own (slot j holds position j, as the target's); its greedy token at the row's last kept
position is the next proposal (k = 1). The caches may be ``KVCache``s or the engine's pages.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from transformer_jax.decode import sampling
from transformer_jax.decode.loop import decode_model, whole_logits
from transformer_jax.decode.speculative import accepted_length, forward_chunk
from transformer_jax.decode.weights import decode_config
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.kv_cache import KVCache
from transformer_jax.model.layers import Embed
from transformer_jax.model.mtp import MTPModule, module_key

Params = dict[str, Any]


def check_mtp(config: ModelConfig, k: int) -> None:
    """Refuses, in one line, a target that cannot draft with its own module, or a k it cannot
    propose."""
    if not config.mtp_depth:
        raise ValueError("speculative mtp drafts with the model's multi-token prediction "
                         "module, which this model lacks (mtp_depth=0; a DeepSeek-V3 "
                         "checkpoint loads it with num_nextn_predict_layers)")
    if k != 1:
        raise ValueError(f"speculative mtp proposes one token a round (mtp:k=1), got k={k}")


def cache_config(config: ModelConfig) -> ModelConfig:
    """The config of the module's cache: one layer of the module block's attention kind."""
    spec = config.mtp_spec()
    return config.replace(
        n_layers=1, mtp_depth=0, moe=None, nope_layers=(), scan_layers=False,
        layer_pattern=() if config.mla is not None else (spec.attention,))


def init_cache(config: ModelConfig, batch: int, size: int, dtype: str | None = None
               ) -> KVCache:
    """The module's empty cache of ``size`` slots (its block's one layer)."""
    return KVCache.init(cache_config(config), batch, size, dtype).constrain()


def propose(config: ModelConfig, params: Params, cache: KVCache, hidden: jax.Array,
            tokens: jax.Array, start: jax.Array, last: jax.Array
            ) -> tuple[jax.Array, KVCache]:
    """The module over W positions: the next proposal of each row.

    Args:
      config, params: the target's (its prepared weights: ``embed`` and ``mtp_0``).
      cache: the module's cache (``init_cache``).
      hidden: [B, W, D] the target's final-normed hidden states at positions ``start + w``.
      tokens: [B, W] int32 the tokens that follow those positions (t_{j+1}).
      start: [B] int32 the first position.
      last: [B] int32 the index w of the position whose prediction is the proposal.

    Returns:
      ([B] int32 the module's greedy token, the cache with the W positions written).
    """
    c = decode_config(config)
    positions = start[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)
    emb = Embed(c.vocab_size, c.d_model, dtype=c.jnp_dtype, param_dtype=c.jnp_param_dtype
                ).apply({"params": params["embed"]}, tokens)
    if c.scale_embeddings:
        emb = emb * jnp.asarray(c.d_model ** 0.5, emb.dtype)
    _, logits, cache = MTPModule(c).apply({"params": params[module_key(1)]}, hidden, emb,
                                          positions, cache=cache, logits_at=last)
    cache = _pinned(cache.replace(lengths=(positions[:, -1] + 1).astype(jnp.int32)))
    return sampling.argmax(whole_logits(logits)), cache


def _pinned(cache: Any) -> Any:
    """A ``KVCache`` with its sharding pinned (``constrain``); the engine's pages as they are
    (one device)."""
    return cache.constrain() if isinstance(cache, KVCache) else cache


def first_proposal(config: ModelConfig, params: Params, hidden: jax.Array, tokens: jax.Array,
                   first: jax.Array, lengths: jax.Array, cache_size: int,
                   cache_dtype: str | None) -> tuple[jax.Array, KVCache]:
    """The module over the prompts (a new cache): position j with hidden[:, j] and the next
    token, the prompt's or at ``lengths - 1`` the first draw ``first`` [B]; its proposal is
    the token after ``first``. Returns ([B] proposal, the module's cache)."""
    b = tokens.shape[0]
    following = jnp.concatenate([tokens[:, 1:], first[:, None]], axis=1).at[
        jnp.arange(b), lengths - 1].set(first)
    return propose(config, params, init_cache(config, b, cache_size, cache_dtype), hidden,
                   following, jnp.zeros((b,), jnp.int32), lengths.astype(jnp.int32) - 1)


def verify(config: ModelConfig, params: Params, cache: KVCache, draft_cache: KVCache,
           chunk: jax.Array, start: jax.Array, num_drafts: jax.Array,
           draw: Callable[[jax.Array], tuple[jax.Array, jax.Array]]) -> tuple[Any, ...]:
    """``speculative.verify`` of [B, W] tokens (the last token and W - 1 proposals; W = 1: a
    plain step) with the module's next proposal. ``draw`` may give [B, W, 1 + K] draws
    (column 0 the drawn token, then the engine's ``top_logprobs``).

    Returns:
      (the target's cache, the module's, [B] the next proposal, [B, W] (or [B, W, 1 + K]) the
      draws, their log-probabilities, [B] int32 the accepted proposals a).
    """
    out = forward_chunk(decode_model(config), params, cache, chunk, start, with_hidden=True)
    drawn, logprobs = draw(out.logits)
    targets = drawn if drawn.ndim == 2 else drawn[..., 0]
    a = accepted_length(targets, chunk[:, 1:], num_drafts)
    proposal, draft_cache = propose(config, params, draft_cache, out.hidden, targets, start, a)
    return _pinned(out.cache), draft_cache, proposal, drawn, logprobs, a
