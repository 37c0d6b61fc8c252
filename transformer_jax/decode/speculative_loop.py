"""Speculative ``generate`` on the device: one jitted ``lax.while_loop`` per call.

The carry (``SpeculativeState``) holds the target's cache, every row's sequence so far (prompt
and output), its outputs, keys, acceptance counters and back-off, and with a draft model the
draft's own contiguous cache. Each round of the loop, every row

1. proposes up to k tokens: the n-gram match of its last n tokens against its own sequence
   (``speculative.ngram_propose``, fixed shapes in ``jnp``), or the draft model's catch-up on
   the tokens the target kept (1 or 2) and its k greedy steps (``draft_propose``, whose
   steps are ``speculative.greedy_proposals``, the engine draft's too);
2. feeds its last token and the proposals ([B, k + 1] at its own positions, one forward:
   ``speculative.verify``, the engine's verification too); the target draws its own token at
   each of the k + 1 positions with the plain decode's key for that token (``fold_in(key,
   token index)``), and the row keeps the proposals up to its first disagreement plus the
   target's token there. A round in which no row proposes anything (all paused by the
   back-off, or no n-gram match) runs the one-token decode instead (``lax.cond``);
3. appends what it kept, up to a stop token or N, and streams every token index all rows
   have reached (``streaming.emit``, as the plain loop does).

Rejected positions need no undo: slot s holds position s, so their stale keys sit past the
row's length, hidden by causality, and the next round overwrites them.

The draft proposes greedily, so its q is a point mass and the target's draw decides (the module
docstring of ``speculative``). After a round it holds the row's tokens up to its length minus 1
or 2: it cached its own first k - 1 proposals, of which the target kept a, and the target added
one token (two uncached tokens only after a = k). So its catch-up is a chunk of 2 positions.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.decode import sampling, streaming
from transformer_jax.decode.loop import (
    DecodeWeights,
    Params,
    SamplingSettings,
    decode_model,
    decode_step,
    draw,
    prefill,
)
from transformer_jax.decode.speculative import (
    Acceptance,
    SpeculativeConfig,
    backoff_budget,
    backoff_record,
    forward_chunk,
    greedy_proposals,
    ngram_propose,
    verify,
)
from transformer_jax.decode.streaming import StreamFn
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.kv_cache import KVCache
from transformer_jax.model.kv_ring import RingLayout

logger = logging.getLogger(__name__)


def draft_propose(config: ModelConfig, params: Params, cache: KVCache, tokens: jax.Array,
                  start: jax.Array, counts: jax.Array, *, k: int
                  ) -> tuple[KVCache, jax.Array]:
    """The draft's catch-up chunk, then its k greedy proposals (``speculative.greedy_proposals``).

    Args:
      config, params: the draft's.
      cache: the draft's ``KVCache``.
      tokens: [B, C] int32 the tokens the draft has not cached yet (right-padded).
      start: [B] int32 the position of ``tokens[:, 0]``.
      counts: [B] int32 real tokens in each row's chunk, in [1, C].
      k: static, proposals per row.

    Returns:
      (the cache, [B, k] int32 proposals).
    """
    out = forward_chunk(decode_model(config), params, cache, tokens, start,
                        logits_at=counts - 1)

    def step(cache: KVCache, token: jax.Array, pos: jax.Array) -> tuple[jax.Array, KVCache]:
        return decode_step(config, params, cache, token, pos)

    return greedy_proposals(step, out.cache, sampling.argmax(out.logits), start + counts, k - 1)


@flax.struct.dataclass
class SpeculativeState:
    """The carry of the speculative loop.

    Attributes:
      seq: [B, S] int32 each row's prompt and output so far, in its first ``length`` entries.
      length: [B] int32 tokens in ``seq``; the row's last token sits at ``length - 1``.
      tokens: [B, N] int32 generated ids (``pad_id`` past ``num_tokens``).
      logprobs: [B, N] float32 their log-probabilities (0 past ``num_tokens``).
      num_tokens: [B] int32 tokens generated so far (stop token included).
      done: [B] bool rows that emitted a stop token or N tokens.
      keys: [B, 2] uint32 raw PRNG key per row; token i draws with ``fold_in(key, i)``.
      cache: the target's ``KVCache``.
      draft_cache: the draft model's ``KVCache`` (None for the n-gram proposer).
      draft_length: [B] int32 positions the draft's cache holds.
      proposed, accepted, verifications: [B] int32 the rows' acceptance counters.
      rate: [B] float32 and paused: [B] int32, the back-off (``Acceptance``).
      streamed: [] int32 token indices streamed so far.
    """

    seq: jax.Array
    length: jax.Array
    tokens: jax.Array
    logprobs: jax.Array
    num_tokens: jax.Array
    done: jax.Array
    keys: jax.Array
    cache: KVCache
    draft_cache: KVCache | None
    draft_length: jax.Array
    proposed: jax.Array
    accepted: jax.Array
    verifications: jax.Array
    rate: jax.Array
    paused: jax.Array
    streamed: jax.Array


def append(state: SpeculativeState, new: jax.Array, new_logprobs: jax.Array,
           count: jax.Array, settings: SamplingSettings) -> SpeculativeState:
    """Appends each row's first ``count`` of [B, W] new tokens, up to a stop token or N.

    Args:
      state: the loop's state; done rows take nothing.
      new: [B, W] int32 tokens; new_logprobs: [B, W] float32 theirs.
      count: [B] int32 how many of each row's W are its tokens.
      settings: static (the stop tokens).

    Returns:
      The state with ``seq``, ``length``, ``tokens``, ``logprobs``, ``num_tokens`` and
      ``done`` advanced.
    """
    b, w = new.shape
    n, s = state.tokens.shape[1], state.seq.shape[1]
    j = jnp.arange(w, dtype=jnp.int32)[None]
    num = state.num_tokens
    take = (j < count[:, None]) & (j < (n - num)[:, None]) & ~state.done[:, None]
    stopped = jnp.zeros((b,), bool)
    if settings.stop_tokens:
        is_stop = take & jnp.isin(new, jnp.asarray(settings.stop_tokens, jnp.int32))
        first = jnp.where(is_stop.any(1), jnp.argmax(is_stop, axis=1), w)
        take &= j <= first[:, None]
        stopped = is_stop.any(1)
    rows = jnp.arange(b)[:, None]
    out = jnp.where(take, num[:, None] + j, n)  # index n is out of range: dropped
    at = jnp.where(take, state.length[:, None] + j, s)
    cut = take.sum(1).astype(jnp.int32)
    return state.replace(
        seq=state.seq.at[rows, at].set(new, mode="drop"),
        length=state.length + cut,
        tokens=state.tokens.at[rows, out].set(new, mode="drop"),
        logprobs=state.logprobs.at[rows, out].set(new_logprobs, mode="drop"),
        num_tokens=num + cut,
        done=state.done | stopped | (num + cut >= n))


def stream_ready(state: SpeculativeState, stream_id: jax.Array, pad_id: int
                 ) -> SpeculativeState:
    """Streams token indices every row has reached (or stopped before), in order, as the
    plain loop does: index i with ``active = num_tokens > i``."""
    num = state.num_tokens
    ready = jnp.where(state.done.all(), num.max(),
                      jnp.min(jnp.where(state.done, jnp.iinfo(jnp.int32).max, num)))

    def emit(i: jax.Array) -> jax.Array:
        active = num > i
        tok = jnp.where(active, jax.lax.dynamic_index_in_dim(state.tokens, i, 1, False),
                        pad_id)
        streaming.emit(stream_id, i, tok, active)
        return i + 1

    streamed = jax.lax.while_loop(lambda i: i < ready, emit, state.streamed)
    return state.replace(streamed=streamed)


def run_one_of(pred: jax.Array, if_true: Any, if_false: Any, cache: KVCache
               ) -> tuple[KVCache, jax.Array, jax.Array, jax.Array]:
    """``lax.cond(pred, if_true, if_false, cache)`` as two while loops of 0 or 1 iterations.

    XLA copies a conditional's operands into each branch (the whole cache, every round, on
    CPU), but updates a while loop's carry in place; each function maps the cache to (cache,
    [B, k + 1] tokens, [B, k + 1] log-probabilities, [B] accepted).
    """
    out = jax.eval_shape(if_true, cache)
    blank = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), out[1:])

    def once(fn: Any, run: jax.Array, carry: tuple[Any, ...]) -> tuple[Any, ...]:
        def body(c: tuple[Any, ...]) -> tuple[Any, ...]:
            return (jnp.zeros((), bool), *fn(c[1]))
        return jax.lax.while_loop(lambda c: c[0], body, (run, *carry))[1:]

    carry = once(if_true, pred, (cache, *blank))
    carry = once(if_false, ~pred, carry)
    return carry  # type: ignore[return-value]


def speculative_generate_padded(
        config: ModelConfig, params: Params, tokens: jax.Array, lengths: jax.Array,
        key_data: jax.Array, stream_id: jax.Array | None = None,
        draft_params: Params | None = None, *, draft_config: ModelConfig | None,
        spec: SpeculativeConfig, max_new_tokens: int, settings: SamplingSettings,
        cache_size: int, cache_dtype: str | None) -> tuple[jax.Array, ...]:
    """Prefill, then the speculative ``while_loop``: the traced body of
    ``generate_speculative``.

    Args:
      config, params: the target's config (static) and prepared weights.
      tokens: [B, T] int32 right-padded prompts; lengths: [B] their true lengths.
      key_data: [B, 2] uint32 raw key per row.
      stream_id: optional [] int32 id of a ``streaming.registered`` callback.
      draft_params: the draft's prepared weights (None: the n-gram proposer).
      draft_config: static, the draft's config (None with the n-gram proposer).
      spec: static, the speculation (k; the n-gram's n and min_n).
      max_new_tokens: N; settings: static sampling settings.
      cache_size: S >= every length + N + k (proposals are written past the end).
      cache_dtype: the target cache's storage dtype name.

    Returns:
      tokens [B, N], logprobs [B, N], num_tokens [B], and the rows' [B] proposed, accepted,
      verifications, rate and paused (``Acceptance``).
    """
    b, t = tokens.shape
    n, k = max_new_tokens, spec.k
    lengths = lengths.astype(jnp.int32)
    key_data = key_data.astype(jnp.uint32)
    logits, cache = prefill(config, params, tokens, lengths, cache_size, cache_dtype)
    draft_cache = None
    if draft_params is not None:
        _, draft_cache = prefill(draft_config, draft_params, tokens, lengths, cache_size + 1)
    zeros = jnp.zeros((b,), jnp.int32)
    state = SpeculativeState(
        seq=jnp.zeros((b, cache_size), jnp.int32).at[:, :t].set(tokens),
        length=lengths, tokens=jnp.full((b, n), settings.pad_id, jnp.int32),
        logprobs=jnp.zeros((b, n), jnp.float32), num_tokens=zeros,
        done=jnp.zeros((b,), bool), keys=key_data, cache=cache, draft_cache=draft_cache,
        draft_length=lengths, proposed=zeros, accepted=zeros, verifications=zeros,
        rate=jnp.ones((b,), jnp.float32), paused=zeros, streamed=jnp.zeros((), jnp.int32))
    first, first_lp = draw(logits[:, None], key_data, zeros, settings)
    state = append(state, first, first_lp, jnp.ones((b,), jnp.int32), settings)
    if stream_id is not None:
        state = stream_ready(state, stream_id, settings.pad_id)

    def propose(s: SpeculativeState) -> tuple[SpeculativeState, jax.Array, jax.Array]:
        """[B, k] proposals and [B] whether each row has any; the draft's cache advanced."""
        if draft_params is None:
            drafts, found = ngram_propose(s.seq, s.length, k, spec.n, spec.min_n)
            return s, drafts, found
        # the draft's catch-up: the 1 or 2 tokens it lacks (at least the last token)
        start = jnp.minimum(s.draft_length, s.length - 1)
        counts = jnp.clip(s.length - s.draft_length, 1, 2).astype(jnp.int32)
        index = jnp.minimum(start[:, None] + jnp.arange(2, dtype=jnp.int32), s.seq.shape[1] - 1)
        chunk = jnp.take_along_axis(s.seq, index, axis=1)
        draft_cache, drafts = draft_propose(draft_config, draft_params, s.draft_cache, chunk,
                                            start, counts, k=k)
        s = s.replace(draft_cache=draft_cache, draft_length=start + counts)
        return s, drafts, jnp.ones((b,), bool)

    def body(s: SpeculativeState) -> SpeculativeState:
        budget, rate, paused = backoff_budget(s.rate, s.paused, ~s.done, k, n - s.num_tokens)
        s, drafts, found = propose(s.replace(rate=rate, paused=paused))
        num_drafts = jnp.where(found, budget, 0).astype(jnp.int32)
        start = s.length - 1
        last = jnp.take_along_axis(s.seq, start[:, None], axis=1)
        index = s.num_tokens

        def round_of(tokens: jax.Array, num: jax.Array) -> Any:
            """The verification of [B, T] tokens (T = 1: a plain decode step), padded to k + 1."""
            def run(cache: KVCache) -> tuple[KVCache, jax.Array, jax.Array, jax.Array]:
                cache, targets, logprobs, a = verify(
                    decode_model(config), params, cache, tokens, start,
                    num, lambda logits: draw(logits, s.keys, index, settings))
                pad = ((0, 0), (0, k + 1 - tokens.shape[1]))
                return cache, jnp.pad(targets, pad), jnp.pad(logprobs, pad), a
            return run

        cache, targets, logprobs, a = run_one_of(
            (num_drafts > 0).any(), round_of(jnp.concatenate([last, drafts], axis=1), num_drafts),
            round_of(last, zeros), s.cache)
        rate, paused = backoff_record(s.rate, s.paused, num_drafts, a)
        proposing = num_drafts > 0
        s = s.replace(
            cache=cache, rate=rate, paused=paused, proposed=s.proposed + num_drafts,
            accepted=s.accepted + a, verifications=s.verifications + proposing,
            # the draft cached its first k - 1 proposals: those the target kept stay valid
            draft_length=s.draft_length + jnp.minimum(a, k - 1))
        s = append(s, targets, logprobs, a + 1, settings)
        if stream_id is not None:
            s = stream_ready(s, stream_id, settings.pad_id)
        return s

    state = jax.lax.while_loop(lambda s: ~s.done.all(), body, state)
    return (state.tokens, state.logprobs, state.num_tokens, state.proposed, state.accepted,
            state.verifications, state.rate, state.paused)


def jit_programs(**jit_options: Any) -> dict[str, Any]:
    """The jitted speculative generate (``speculative_generate_padded``)."""
    return dict(generate=jax.jit(
        speculative_generate_padded,
        static_argnames=("config", "draft_config", "spec", "max_new_tokens", "settings",
                         "cache_size", "cache_dtype"),
        **jit_options))


PROGRAMS = jit_programs()


@dataclasses.dataclass
class DraftModel:
    """A draft model for speculation: its config and prepared weights (one device).

    Raises (``check_against``): ValueError when its vocabulary differs from the target's.
    """

    config: ModelConfig
    weights: DecodeWeights
    tokenizer_id: str | None = None

    def check_against(self, target: ModelConfig, tokenizer_id: str | None = None) -> None:
        """Refuses a draft that cannot propose for ``target`` (one line, naming why)."""
        if self.config.vocab_size != target.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({self.config.vocab_size}) differs "
                             f"from the target's ({target.vocab_size}): a draft must share the "
                             "target's tokenizer")
        if tokenizer_id and self.tokenizer_id and tokenizer_id != self.tokenizer_id:
            raise ValueError(f"the draft model's tokenizer ({self.tokenizer_id}) differs from "
                             f"the target's ({tokenizer_id})")
        if self.weights.mesh is not None and self.weights.mesh.size > 1:
            raise ValueError("the draft model must be on one device (no mesh)")
        check_no_rings(self.config, "the draft model")


def check_no_rings(config: ModelConfig, what: str) -> None:
    """Speculation overwrites positions it may reject; a sliding-window ring would lose the
    window's oldest entries to them. Raises ValueError for such a model."""
    if RingLayout.of(config, config.max_seq_len) is not None:
        raise ValueError(f"speculative decoding does not support {what}'s sliding-window "
                         "(ring) layers yet")


def generate_speculative(config: ModelConfig, weights: DecodeWeights, tokens: np.ndarray,
                         lengths: np.ndarray, key_data: np.ndarray, *, max_new_tokens: int,
                         settings: SamplingSettings, cache_size: int, cache_dtype: str | None,
                         spec: SpeculativeConfig, draft: DraftModel | None = None,
                         stream: StreamFn | None = None
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[Acceptance]]:
    """Speculative decoding in one device program: ``generate_padded``'s outputs, the same
    tokens.

    Args:
      config, weights: the target's config and prepared weights (one device).
      tokens: [B, T] int32 right-padded prompts; lengths: [B] their true lengths.
      key_data: [B, 2] uint32 raw key per row.
      max_new_tokens: N; settings: validated sampling settings.
      cache_size: S_max >= every length + N + k (the proposals are written past the end).
      cache_dtype: the target cache's storage dtype name.
      spec: the speculation; draft: the draft model when ``spec.method == "draft"``.
      stream: optional ``fn(step, tokens [B], active [B])``, called once per new token index.

    Returns:
      (tokens [B, N], logprobs [B, N], num_tokens [B], per-row ``Acceptance``).
    """
    if spec.method == "draft" and draft is None:
        raise ValueError("speculative method 'draft' needs a DraftModel")
    use_draft = draft if spec.method == "draft" else None
    with streaming.registered(stream) as stream_id:
        out = PROGRAMS["generate"](
            config, weights.params, jnp.asarray(tokens), jnp.asarray(lengths),
            jnp.asarray(key_data, jnp.uint32), stream_id,
            None if use_draft is None else use_draft.weights.params,
            draft_config=None if use_draft is None else use_draft.config, spec=spec,
            max_new_tokens=max_new_tokens, settings=settings, cache_size=cache_size,
            cache_dtype=cache_dtype)
        out = jax.device_get(out)
    out_tokens, out_logprobs, num, proposed, accepted, verifications, rate, paused = out
    stats = [Acceptance(proposed=int(proposed[r]), accepted=int(accepted[r]),
                        verifications=int(verifications[r]), rate=float(rate[r]),
                        paused=int(paused[r])) for r in range(len(num))]
    logger.debug("speculative generate: B=%d, %s", len(num),
                 [f"{s.acceptance_rate:.2f}" for s in stats])
    return out_tokens, out_logprobs, num, stats
