"""The multi-token prediction draft (``speculative="mtp"``): the target's own module 1
(``model.mtp``) proposes the token after the next one, from the target's final hidden state.

At position j the module combines the target's hidden state h_j and the token t_{j+1} and
predicts t_{j+2}. It keeps a cache of its own block (one layer, ``draft_cache``), slot j
holding position j, as the target's cache does: after the target's forward over positions
``start .. start + W - 1`` (a prefill, a plain step or a verification) whose draws are the
tokens t_{j+1} of those positions, the module runs over the same W positions with those hidden
states and draws, and its logits at the last position the row kept (the accepted proposals'
count a) give the next proposal: the token after the one the target just added. Positions past
a hold stale entries, hidden by causality and overwritten by the next round (which restarts
at ``start + a + 1``), as the target's do. One proposal per round (k = 1). The caches may be
``generate``'s (``KVCache``) or the serving engine's pages (``serving.mtp``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from transformer_jax.decode import sampling
from transformer_jax.decode.loop import decode_model, whole_logits
from transformer_jax.decode.speculative import accepted_length
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


def prefill_with_hidden(config: ModelConfig, params: Params, tokens: jax.Array,
                        lengths: jax.Array, max_len: int, dtype: str | None
                        ) -> tuple[jax.Array, KVCache, jax.Array]:
    """``decode.loop.prefill`` that also returns every prompt position's final-normed hidden
    state [B, T, D] (the module's input over the prompt)."""
    b, t = tokens.shape
    cache = KVCache.init(config, b, max_len, dtype).constrain()
    if cache.ring is not None:
        cache = cache.replace(ring_end=lengths.astype(jnp.int32))
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    out = decode_model(config).apply({"params": params}, tokens, positions, cache=cache,
                                     logits_at=lengths.astype(jnp.int32) - 1, with_hidden=True)
    return (whole_logits(out.logits), out.cache.replace(lengths=lengths.astype(jnp.int32),
                                                        ring_end=None), out.hidden)


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
    plain step) with the module's next proposal from the target's hidden states and draws.

    ``draw`` may give [B, W, 1 + K] draws (the drawn token, then the top alternatives: the
    engine's ``top_logprobs``); column 0 is the draw.

    Returns:
      (the target's cache, the module's, [B] the next proposal, [B, W] (or [B, W, 1 + K]) the
      draws, their log-probabilities, [B] int32 the accepted proposals a).
    """
    positions = start[:, None] + jnp.arange(chunk.shape[1], dtype=jnp.int32)
    out = decode_model(config).apply({"params": params}, chunk, positions, cache=cache,
                                     with_hidden=True)
    drawn, logprobs = draw(out.logits)
    targets = drawn if drawn.ndim == 2 else drawn[..., 0]
    a = accepted_length(targets, chunk[:, 1:], num_drafts)
    proposal, draft_cache = propose(config, params, draft_cache, out.hidden, targets, start, a)
    return _pinned(out.cache), draft_cache, proposal, drawn, logprobs, a
