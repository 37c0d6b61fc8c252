"""Speculative ``generate`` on the device: one jitted program per call.

The carry (``SpeculativeState``) holds the caches, every row's sequence, outputs, keys,
counters and next proposals. Rounds run in two ``while_loop`` phases in turn: verify rounds
while the cost rule says so (``speculative.verify``), then plain rounds (one ``decode_step``).
Rejected positions need no undo: their cache slots lie past the row's length.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.decode import sampling, speculative_mtp, streaming
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
    PRIOR_HITS,
    PRIOR_TRIES,
    Acceptance,
    SpeculativeConfig,
    evidence,
    expected_tokens,
    forward_chunk,
    greedy_proposals,
    measure_round_cost,
    ngram_propose,
    pays,
    stop_message,
    verify,
)
from transformer_jax.decode.streaming import StreamFn
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.kv_cache import KVCache
from transformer_jax.model.kv_ring import RingLayout

logger = logging.getLogger(__name__)


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
      cache, draft_cache: the target's and the draft's ``KVCache`` (None for the n-gram).
      draft_length: [B] int32 positions the draft's cache holds.
      drafts: [B, k] int32 the next round's proposals (a draft model's first only).
      watched, watch_n, matched: [B, k] a proposal plain rounds check, [B] its length (0:
        none), [B] matched so far.
      want: [B] bool rows verifying in the next round; verify: [] bool whether it verifies.
      proposed, accepted, verifications, declined, hits, tries, proposing: [B] the rows'
        ``Acceptance``; rounds: [2] int32 plain and verify rounds; streamed: [] int32.
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
    drafts: jax.Array
    watched: jax.Array
    watch_n: jax.Array
    matched: jax.Array
    want: jax.Array
    verify: jax.Array
    proposed: jax.Array
    accepted: jax.Array
    verifications: jax.Array
    declined: jax.Array
    hits: jax.Array
    tries: jax.Array
    proposing: jax.Array
    rounds: jax.Array
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
      The state with its sequences, outputs, counts and ``done`` advanced.
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
    """Streams, in order, the token indices every row has reached (or stopped before), as the
    plain loop does."""
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


#: ``force``: the cost rule decides; every round plain; every round verifies (for timing).
AUTO, PLAIN, VERIFY = 0, 1, 2


def speculative_generate_padded(
        config: ModelConfig, params: Params, tokens: jax.Array, lengths: jax.Array,
        key_data: jax.Array, cost: jax.Array, force: jax.Array, max_rounds: jax.Array,
        stream_id: jax.Array | None = None, draft_params: Params | None = None, *,
        draft_config: ModelConfig | None, spec: SpeculativeConfig, max_new_tokens: int,
        settings: SamplingSettings, cache_size: int, cache_dtype: str | None
        ) -> tuple[jax.Array, ...]:
    """Prefill, then the verify and plain rounds: the traced body of ``generate_speculative``.

    Args:
      config, params, tokens, lengths, key_data: as ``generate_speculative``'s (config static).
      cost: [] float32 what a verify round costs in plain rounds (the cost rule's).
      force: [] int32 ``AUTO``, or every round ``PLAIN`` or ``VERIFY`` (as far as rows can
        propose); max_rounds: [] int32 the most rounds run.
      stream_id: optional [] int32 id of a ``streaming.registered`` callback.
      draft_params: the draft's prepared weights (None: the n-gram proposer).
      draft_config, spec, max_new_tokens (N), settings, cache_dtype: static, as
        ``generate_speculative``'s; cache_size: S >= every length + N + k.

    Returns:
      tokens [B, N], logprobs [B, N], num_tokens [B]; the rows' [B] proposed, accepted,
      verifications, declined, hits, tries and proposing (``Acceptance``); [2] plain and verify
      rounds run.
    """
    b, t = tokens.shape
    n, k = max_new_tokens, spec.k
    lengths = lengths.astype(jnp.int32)
    key_data = key_data.astype(jnp.uint32)
    cost = jnp.asarray(cost, jnp.float32)
    mtp = spec.method == "mtp"  # the target's own module drafts (``speculative_mtp``)
    logits, cache, *hidden = prefill(config, params, tokens, lengths, cache_size, cache_dtype,
                                     with_hidden=mtp)  # the module's input over the prompt
    draft_cache = None
    if draft_params is not None:
        _, draft_cache = prefill(draft_config, draft_params, tokens, lengths, cache_size + 1)
    zeros, no = jnp.zeros((b,), jnp.int32), jnp.zeros((b,), bool)
    state = SpeculativeState(
        seq=jnp.zeros((b, cache_size), jnp.int32).at[:, :t].set(tokens),
        length=lengths, tokens=jnp.full((b, n), settings.pad_id, jnp.int32),
        logprobs=jnp.zeros((b, n), jnp.float32), num_tokens=zeros, done=no, keys=key_data,
        cache=cache, draft_cache=draft_cache, draft_length=lengths,
        drafts=jnp.zeros((b, k), jnp.int32), watched=jnp.zeros((b, k), jnp.int32),
        watch_n=zeros, matched=zeros, want=no, verify=jnp.zeros((), bool),
        proposed=zeros, accepted=zeros, verifications=zeros, declined=zeros,
        hits=jnp.full((b,), PRIOR_HITS, jnp.float32),
        tries=jnp.full((b,), PRIOR_TRIES, jnp.float32), proposing=~no,
        rounds=jnp.zeros((2,), jnp.int32), streamed=jnp.zeros((), jnp.int32))
    first, first_lp = draw(logits[:, None], key_data, zeros, settings)
    state = append(state, first, first_lp, jnp.ones((b,), jnp.int32), settings)
    if mtp:
        proposal, draft_cache = speculative_mtp.first_proposal(
            config, params, hidden[0], tokens, first[:, 0], lengths, cache_size, cache_dtype)
        state = state.replace(draft_cache=draft_cache, drafts=state.drafts.at[:, 0].set(proposal))
    if stream_id is not None:
        state = stream_ready(state, stream_id, settings.pad_id)
    model = decode_model(config)

    def budget_of(s: SpeculativeState) -> jax.Array:
        """[B] the most proposals a row may verify: at most k, and one fewer than it can keep."""
        return jnp.where(s.done, 0, jnp.clip(n - s.num_tokens - 1, 0, k)).astype(jnp.int32)

    def decide(s: SpeculativeState) -> SpeculativeState:
        """The next round's proposals (the draft's cache caught up), and the cost rule's
        choice: which rows verify, and whether the round does."""
        if mtp:  # proposed by the round that drew the last token
            drafts, found = s.drafts, ~no
        elif draft_params is None:
            drafts, found = ngram_propose(s.seq, s.length, k, spec.n, spec.min_n)
        else:  # the draft's catch-up: the 1 or 2 tokens it lacks (at least the last token)
            start = jnp.minimum(s.draft_length, s.length - 1)
            counts = jnp.clip(s.length - s.draft_length, 1, 2).astype(jnp.int32)
            index = jnp.minimum(start[:, None] + jnp.arange(2, dtype=jnp.int32),
                                s.seq.shape[1] - 1)
            out = forward_chunk(decode_model(draft_config), draft_params, s.draft_cache,
                                jnp.take_along_axis(s.seq, index, axis=1), start,
                                logits_at=counts - 1)
            s = s.replace(draft_cache=out.cache, draft_length=start + counts)
            first = sampling.argmax(out.logits)  # the draft's greedy next token
            drafts, found = jnp.zeros((b, k), jnp.int32).at[:, 0].set(first), ~no
        active, budget = ~s.done, budget_of(s)
        can = active & found & (budget > 0)
        expected = expected_tokens(s.hits / s.tries, budget)
        proposing = jnp.where(can, pays(expected, cost, s.proposing), s.proposing)
        want = can & proposing
        # one forward serves the batch: the rows' tokens per round against cost plain rounds
        gain = jnp.sum(jnp.where(want, expected, 1.0) * active)
        verify_now = want.any() & (gain > cost * jnp.sum(active))
        want = jnp.where(force == VERIFY, active & (budget > 0), want)
        verify_now = jnp.where(force == AUTO, verify_now, (force == VERIFY) & want.any())
        want &= verify_now
        # a proposal not verified is watched instead (a draft's: from its first proposal on)
        watch = can & ~want & (s.watch_n == 0)
        return s.replace(drafts=drafts, want=want, verify=verify_now,
                         watched=jnp.where(watch[:, None], drafts, s.watched),
                         watch_n=jnp.where(watch, budget, s.watch_n),
                         matched=jnp.where(watch, 0, s.matched),
                         proposing=proposing, declined=s.declined + (can & ~want))

    def after(s: SpeculativeState, targets: jax.Array, logprobs: jax.Array, a: jax.Array,
              num_drafts: jax.Array, kind: int) -> SpeculativeState:
        """A round's [B, T] draws (a row keeps ``a + 1``): evidence, counters, the kept tokens
        appended and streamed, and the next round's choice."""
        verified = num_drafts > 0
        watching = (s.watch_n > 0) & ~verified & ~s.done  # it takes one token of the target's
        expect = s.drafts[:, 0] if draft_params is not None or mtp else jnp.take_along_axis(
            s.watched, jnp.minimum(s.matched, k - 1)[:, None], axis=1)[:, 0]
        hit = watching & (targets[:, 0] == expect)
        matched = s.matched + hit
        ends = watching & (~hit | (matched >= s.watch_n))
        hits, tries = evidence(s.hits, s.tries, jnp.where(verified, a, matched),
                               jnp.where(verified, a + (a < num_drafts), matched + ~hit))
        touched = verified | ends
        s = s.replace(hits=jnp.where(touched, hits, s.hits),
                      tries=jnp.where(touched, tries, s.tries), matched=matched,
                      watch_n=jnp.where(touched | s.done, 0, s.watch_n),
                      proposed=s.proposed + num_drafts, accepted=s.accepted + a,
                      verifications=s.verifications + (num_drafts > 0),
                      rounds=s.rounds.at[kind].add(1))
        s = append(s, targets, logprobs, a + 1, settings)
        if stream_id is not None:
            s = stream_ready(s, stream_id, settings.pad_id)
        return decide(s)

    def last_token(s: SpeculativeState) -> tuple[jax.Array, jax.Array]:
        return s.length - 1, jnp.take_along_axis(s.seq, s.length[:, None] - 1, axis=1)

    def verify_round(s: SpeculativeState) -> SpeculativeState:
        num_drafts = jnp.where(s.want, budget_of(s), 0)
        if draft_params is not None:  # the draft's further proposals after its first
            draft_cache, drafts = greedy_proposals(
                functools.partial(decode_step, draft_config, draft_params), s.draft_cache,
                s.drafts[:, 0], s.draft_length, k - 1)
            s = s.replace(draft_cache=draft_cache, drafts=drafts)
        start, last = last_token(s)
        if mtp:
            return mtp_round(s, jnp.concatenate([last, s.drafts], axis=1), start, num_drafts)
        cache, targets, logprobs, a = verify(
            model, params, s.cache, jnp.concatenate([last, s.drafts], axis=1), start,
            num_drafts, lambda logits: draw(logits, s.keys, s.num_tokens, settings))
        # the draft cached its first k - 1 proposals: those the target kept stay valid
        s = s.replace(cache=cache, draft_length=s.draft_length + jnp.minimum(a, k - 1))
        return after(s, targets, logprobs, a, num_drafts, 1)

    def mtp_round(s: SpeculativeState, chunk: jax.Array, start: jax.Array,
                  num_drafts: jax.Array) -> SpeculativeState:  # a verification, or plain
        cache, draft_cache, proposal, targets, logprobs, a = speculative_mtp.verify(
            config, params, s.cache, s.draft_cache, chunk, start, num_drafts,
            lambda logits: draw(logits, s.keys, s.num_tokens, settings))
        s = s.replace(cache=cache, draft_cache=draft_cache,
                      drafts=s.drafts.at[:, 0].set(proposal))
        return after(s, targets, logprobs, a, num_drafts, int(chunk.shape[1] > 1))

    def plain_round(s: SpeculativeState) -> SpeculativeState:
        start, last = last_token(s)
        if mtp:
            return mtp_round(s, last, start, zeros)
        logits, cache = decode_step(config, params, s.cache, last[:, 0], start)
        return after(s.replace(cache=cache), *draw(logits[:, None], s.keys, s.num_tokens,
                                                   settings), zeros, zeros, 0)

    def going(s: SpeculativeState) -> jax.Array:
        return ~s.done.all() & (s.rounds.sum() < max_rounds)

    def phases(s: SpeculativeState) -> SpeculativeState:  # verify rounds, then plain ones
        s = jax.lax.while_loop(lambda s: going(s) & s.verify, verify_round, s)
        return jax.lax.while_loop(lambda s: going(s) & ~s.verify, plain_round, s)

    state = jax.lax.while_loop(going, phases, decide(state))
    return (state.tokens, state.logprobs, state.num_tokens, state.proposed, state.accepted,
            state.verifications, state.declined, state.hits, state.tries, state.proposing,
            state.rounds)


def jit_programs(**jit_options: Any) -> dict[str, Any]:
    """The jitted speculative generate (``speculative_generate_padded``)."""
    return dict(generate=jax.jit(
        speculative_generate_padded,
        static_argnames=("config", "draft_config", "spec", "max_new_tokens", "settings",
                         "cache_size", "cache_dtype"),
        **jit_options))


PROGRAMS = jit_programs()

#: What a verify round costs in plain rounds, per compiled shape (``round_cost``).
ROUND_COSTS: dict[Any, float] = {}
#: Rounds of each timed run of ``measure_round_cost`` (at most N - 1): many, to outweigh prefill.
CALIBRATION_ROUNDS = 64
_STOP_LOGGED: set[Any] = set()


def round_cost(key: Any, run: Callable[[bool, int], tuple[float, np.ndarray]], k: int,
               max_new_tokens: int) -> float:
    """The verify-round cost of the program ``key`` names, measured (``measure_round_cost``)
    on its first call and kept; k + 1 (nothing pays) when it cannot be measured."""
    cost = ROUND_COSTS.get(key)
    if cost is None:
        measured = measure_round_cost(run, min(CALIBRATION_ROUNDS, max_new_tokens - 1))
        ROUND_COSTS[key] = cost = float(k + 1) if measured is None else measured
        logger.info("speculative generate: a verify round of %d positions costs %.2f plain "
                    "rounds on this model (%s)", k + 1, cost,
                    "measured" if measured is not None else "not measurable: assumed")
    return cost


@dataclasses.dataclass
class DraftModel:
    """A draft model for speculation: its config and prepared weights (one device)."""

    config: ModelConfig
    weights: DecodeWeights
    tokenizer_id: str | None = None

    def check_against(self, target: ModelConfig, tokenizer_id: str | None = None) -> None:
        """Refuses a draft that cannot propose for ``target``.

        Raises:
          ValueError: one line naming why (vocabulary, tokenizer, mesh, ring layers).
        """
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
    tokens. A row proposes only where that pays (``round_cost``, ``speculative.pays``).

    Args:
      config, weights: the target's config and prepared weights (one device).
      tokens: [B, T] int32 right-padded prompts; lengths: [B] their true lengths.
      key_data: [B, 2] uint32 raw key per row; max_new_tokens: N; settings: validated.
      cache_size: S_max >= every length + N + k (the proposals are written past the end);
      cache_dtype: the target cache's storage dtype name.
      spec: the speculation; draft: the draft model when ``spec.method == "draft"``.
      stream: optional ``fn(step, tokens [B], active [B])``, called once per new token index.

    Returns:
      (tokens [B, N], logprobs [B, N], num_tokens [B], per-row ``Acceptance``).
    """
    if spec.method == "draft" and draft is None:
        raise ValueError("speculative method 'draft' needs a DraftModel")
    use_draft = draft if spec.method == "draft" else None
    statics = dict(
        draft_config=use_draft and use_draft.config, spec=spec, max_new_tokens=max_new_tokens,
        settings=settings, cache_size=cache_size, cache_dtype=cache_dtype)
    inputs = (config, weights.params, jnp.asarray(tokens), jnp.asarray(lengths),
              jnp.asarray(key_data, jnp.uint32))
    draft_params = use_draft and use_draft.weights.params

    def call(stream_id: Any, cost: float, force: int, max_rounds: int) -> Any:
        return PROGRAMS["generate"](*inputs, np.float32(cost), np.int32(force),
                                    np.int32(max_rounds), stream_id, draft_params, **statics)

    def timed(verify: bool, max_rounds: int) -> tuple[float, np.ndarray]:
        # the same program (a stream id that no callback has, when the call streams)
        start = time.perf_counter()
        out = jax.block_until_ready(call(None if stream is None else np.int32(0), 1.0,
                                         VERIFY if verify else PLAIN, max_rounds))
        return time.perf_counter() - start, np.asarray(out[-1])

    key = (config, np.shape(tokens), stream is None, *statics.values())
    cost = round_cost(key, timed, spec.k, max_new_tokens)
    with streaming.registered(stream) as stream_id:
        out = jax.device_get(call(stream_id, cost, AUTO, np.iinfo(np.int32).max))
    (out_tokens, out_logprobs, num, proposed, accepted, verifications, declined, hits, tries,
     proposing, rounds) = out
    stats = [Acceptance(int(proposed[r]), int(accepted[r]), int(verifications[r]), float(hits[r]),
                        float(tries[r]), bool(proposing[r]), int(declined[r]))
             for r in range(len(num))]
    if declined.any() and key not in _STOP_LOGGED:
        _STOP_LOGGED.add(key)
        row = stats[int(np.argmax(declined))]
        logger.info(stop_message("speculative generate", cost, spec.k + 1, row.rate,
                                 expected_tokens(row.rate, spec.k)))
    logger.debug("speculative generate: B=%d, %d plain and %d verify rounds, acceptance %s",
                 len(num), rounds[0], rounds[1], [f"{s.acceptance_rate:.2f}" for s in stats])
    return out_tokens, out_logprobs, num, stats
