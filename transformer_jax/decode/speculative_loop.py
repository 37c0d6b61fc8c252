"""Speculative ``generate``: a host loop over a few jitted programs on the contiguous cache.

Each round, every row feeds its last token and up to k proposals ([B, k + 1] at its own
positions, one forward: ``verify``), the target draws its own token at each of the k + 1
positions with the plain decode's key for that token (``fold_in(key, token index)``), and the
row keeps the proposals up to its first disagreement plus the target's token there
(``speculative.accepted_length``). Rejected positions need no undo: slot s holds position s,
so their stale keys sit past the row's length, hidden by causality, and the next round
overwrites them. A round in which no row proposes anything runs the one-token decode instead.

Programs (each compiled once per shape): the prefill, ``verify`` at [B, k + 1], the one-token
decode, and with a draft model its prefill and ``draft_propose``.

A draft model (``DraftModel``) keeps its own contiguous cache. It proposes greedily, so its q is
a point mass and the target's draw decides (the module docstring of ``speculative``): each
round it first catches up on the tokens the target kept since its last call (a chunk of up to
k + 1 positions; at most 2 after a round that ran it), then takes k - 1 more greedy steps.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.decode import sampling
from transformer_jax.decode.loop import (
    DecodeWeights,
    Params,
    SamplingSettings,
    decode_model,
    decode_step,
    prefill,
)
from transformer_jax.decode.speculative import (
    Acceptance,
    NgramProposer,
    SpeculativeConfig,
    accepted_length,
)
from transformer_jax.decode.streaming import StreamFn
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.kv_cache import KVCache
from transformer_jax.model.kv_ring import RingLayout

logger = logging.getLogger(__name__)


def draw(logits: jax.Array, key_data: jax.Array, index: jax.Array,
         settings: SamplingSettings) -> tuple[jax.Array, jax.Array]:
    """The plain decode's draw at T positions per row.

    Args:
      logits: [B, T, V] float32.
      key_data: [B, 2] uint32 each row's raw key.
      index: [B] int32 the new-token index of position 0 (position t draws with
        ``fold_in(key, index + t)``).
      settings: static sampling settings.

    Returns:
      ([B, T] int32 tokens, [B, T] float32 their raw-softmax log-probabilities).
    """
    b, t, v = logits.shape
    flat = logits.reshape(b * t, v)
    if settings.temperature == 0:
        tokens = sampling.argmax(flat)
    else:
        keys = jax.random.wrap_key_data(jnp.repeat(key_data, t, axis=0))
        steps = (index[:, None] + jnp.arange(t, dtype=jnp.int32)).reshape(-1)
        keys = jax.vmap(jax.random.fold_in)(keys, steps)
        tokens = sampling.sample(flat, keys, temperature=settings.temperature,
                                 top_k=settings.top_k, top_p=settings.top_p,
                                 min_p=settings.min_p)
    return (tokens.reshape(b, t).astype(jnp.int32),
            sampling.token_logprobs(flat, tokens).reshape(b, t))


def verify(config: ModelConfig, params: Params, cache: KVCache, tokens: jax.Array,
           start: jax.Array, num_drafts: jax.Array, key_data: jax.Array, index: jax.Array, *,
           settings: SamplingSettings, weights_out_first: bool
           ) -> tuple[KVCache, jax.Array, jax.Array, jax.Array]:
    """One verification forward of every row's last token and proposals.

    Args:
      config: the target's config; params: its prepared weights.
      cache: the target's ``KVCache`` (slots up to each row's ``start`` valid).
      tokens: [B, k + 1] int32: the row's last token, then its proposals (padding past
        ``num_drafts``).
      start: [B] int32 the position of ``tokens[:, 0]``.
      num_drafts: [B] int32 proposals per row, in [0, k].
      key_data, index: the draw's keys (``draw``).
      settings: static sampling settings; weights_out_first: static layout of ``params``.

    Returns:
      (the cache with all k + 1 positions written, [B, k + 1] the target's tokens,
      [B, k + 1] their log-probabilities, [B] accepted proposals a: the row's new tokens are
      ``targets[:, :a + 1]``).
    """
    logits, cache = verify_forward(config, params, cache, tokens, start,
                                   weights_out_first=weights_out_first)
    targets, logprobs = draw(logits, key_data, index, settings)
    return cache, targets, logprobs, accepted_length(targets, tokens[:, 1:], num_drafts)


def verify_forward(config: ModelConfig, params: Params, cache: KVCache, tokens: jax.Array,
                   start: jax.Array, *, weights_out_first: bool) -> tuple[jax.Array, KVCache]:
    """[B, T] tokens at positions ``start[b] ..`` in one forward -> ([B, T, V] float32 logits,
    the cache with the T positions written): what T decode steps give, in one."""
    positions = start[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)
    out = decode_model(config, None, weights_out_first).apply(
        {"params": params}, tokens, positions, cache=cache)
    return out.logits, out.cache


def _prefill(config: ModelConfig, params: Params, tokens: jax.Array, lengths: jax.Array, *,
             cache_size: int, cache_dtype: str | None, weights_out_first: bool
             ) -> tuple[jax.Array, KVCache]:
    return prefill(config, params, tokens, lengths, cache_size, cache_dtype,
                   weights_out_first=weights_out_first)


def _decode(config: ModelConfig, params: Params, cache: KVCache, tokens: jax.Array,
            positions: jax.Array, key_data: jax.Array, index: jax.Array, *,
            settings: SamplingSettings, weights_out_first: bool
            ) -> tuple[KVCache, jax.Array, jax.Array]:
    logits, cache = decode_step(config, params, cache, tokens, positions,
                                weights_out_first=weights_out_first)
    targets, logprobs = draw(logits[:, None], key_data, index, settings)
    return cache, targets, logprobs


def draft_propose(config: ModelConfig, params: Params, cache: KVCache, tokens: jax.Array,
                  start: jax.Array, counts: jax.Array, *, k: int, weights_out_first: bool
                  ) -> tuple[KVCache, jax.Array]:
    """The draft's catch-up chunk, then its k greedy proposals.

    Args:
      config, params: the draft's.
      cache: the draft's ``KVCache``.
      tokens: [B, C] int32 the tokens the draft has not cached yet (right-padded).
      start: [B] int32 the position of ``tokens[:, 0]``.
      counts: [B] int32 real tokens in each row's chunk, in [1, C].
      k: static, proposals per row.
      weights_out_first: static layout.

    Returns:
      (the cache, [B, k] int32 proposals).
    """
    model = decode_model(config, None, weights_out_first)
    c = tokens.shape[1]
    positions = start[:, None] + jnp.arange(c, dtype=jnp.int32)
    out = model.apply({"params": params}, tokens, positions, cache=cache,
                      logits_at=counts - 1)
    first = sampling.argmax(out.logits)
    pos = start + counts  # where the first proposal goes

    def body(i: int, carry: tuple[KVCache, jax.Array, jax.Array]
             ) -> tuple[KVCache, jax.Array, jax.Array]:
        cache, last, drafts = carry
        logits, cache = decode_step(config, params, cache, last, pos + i - 1,
                                    weights_out_first=weights_out_first)
        nxt = sampling.argmax(logits)
        return cache, nxt, drafts.at[:, i].set(nxt)

    drafts = jnp.zeros((tokens.shape[0], k), jnp.int32).at[:, 0].set(first)
    cache, _, drafts = jax.lax.fori_loop(1, k, body, (out.cache, first, drafts))
    return cache, drafts


def jit_programs(**jit_options: Any) -> dict[str, Any]:
    """The loop's jitted programs (caches donated)."""
    layout = ("config", "weights_out_first")
    return dict(
        prefill=jax.jit(_prefill, static_argnames=(*layout, "cache_size", "cache_dtype"),
                        **jit_options),
        decode=jax.jit(_decode, static_argnames=(*layout, "settings"),
                       donate_argnames=("cache",), **jit_options),
        verify=jax.jit(verify, static_argnames=(*layout, "settings"),
                       donate_argnames=("cache",), **jit_options),
        draft=jax.jit(draft_propose, static_argnames=(*layout, "k"),
                      donate_argnames=("cache",), **jit_options))


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


class _DraftState:
    """A draft model's cache and what it holds, for one generate call."""

    def __init__(self, draft: DraftModel, tokens: np.ndarray, lengths: np.ndarray,
                 cache_size: int, k: int) -> None:
        self.draft, self.k = draft, k
        w = draft.weights
        _, self.cache = PROGRAMS["prefill"](
            draft.config, w.params, jnp.asarray(tokens), jnp.asarray(lengths),
            cache_size=cache_size, cache_dtype=None, weights_out_first=w.weights_out_first)
        self.cached = np.asarray(lengths, np.int64).copy()  # positions the draft holds

    def propose(self, seqs: Sequence[list[int]], ks: Sequence[int]) -> list[list[int]]:
        b, c = len(seqs), self.k + 1
        w = self.draft.weights
        while True:
            gap = np.asarray([len(s) for s in seqs]) - self.cached
            chunk = np.zeros((b, c), np.int32)
            counts = np.clip(gap, 1, c).astype(np.int32)
            start = np.minimum(self.cached, [len(s) - 1 for s in seqs]).astype(np.int32)
            for row, s in enumerate(seqs):
                chunk[row, :counts[row]] = s[start[row]:start[row] + counts[row]]
            self.cache, drafts = PROGRAMS["draft"](
                self.draft.config, w.params, self.cache, chunk, start, counts, k=self.k,
                weights_out_first=w.weights_out_first)
            self.cached = start + counts
            if (gap <= c).all():
                break
        drafts = np.asarray(drafts)
        # the draft also cached its first k - 1 proposals: those the target keeps stay valid
        # (``kept``)
        return [drafts[row, :ks[row]].tolist() for row in range(b)]

    def kept(self, row: int, accepted: int) -> None:
        """The target kept ``accepted`` of the row's proposals: the draft's cache holds them."""
        self.cached[row] += min(accepted, self.k - 1)


def generate_speculative(config: ModelConfig, weights: DecodeWeights, tokens: np.ndarray,
                         lengths: np.ndarray, key_data: np.ndarray, *, max_new_tokens: int,
                         settings: SamplingSettings, cache_size: int, cache_dtype: str | None,
                         spec: SpeculativeConfig, draft: DraftModel | None = None,
                         stream: StreamFn | None = None
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[Acceptance]]:
    """The speculative host loop: ``generate_padded``'s outputs, the same tokens.

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
    b, n, k = tokens.shape[0], max_new_tokens, spec.k
    p, out_first = weights.params, weights.weights_out_first
    out_tokens = np.full((b, n), settings.pad_id, np.int32)
    out_logprobs = np.zeros((b, n), np.float32)
    num = np.zeros(b, np.int32)
    done = np.zeros(b, bool)
    stop = set(settings.stop_tokens)
    keys = jnp.asarray(key_data, jnp.uint32)
    seqs = [tokens[row, :lengths[row]].tolist() for row in range(b)]
    stats = [Acceptance() for _ in range(b)]
    proposer = (NgramProposer(spec.n, spec.min_n) if draft is None
                else _DraftState(draft, tokens, lengths, cache_size + k + 2, k))
    logits, cache = PROGRAMS["prefill"](config, p, jnp.asarray(tokens), jnp.asarray(lengths),
                                        cache_size=cache_size, cache_dtype=cache_dtype,
                                        weights_out_first=out_first)
    first, first_lp = draw(logits[:, None], keys, jnp.zeros(b, jnp.int32), settings)
    new = [[int(t)] for t in np.asarray(first)[:, 0]]
    new_lp = [[float(x)] for x in np.asarray(first_lp)[:, 0]]
    step = 0
    while True:
        for row in range(b):  # append this round's tokens up to a stop or N
            if done[row]:
                continue
            for tok, lp in zip(new[row], new_lp[row], strict=True):
                out_tokens[row, num[row]], out_logprobs[row, num[row]] = tok, lp
                num[row] += 1
                seqs[row].append(tok)
                if tok in stop or num[row] >= n:
                    done[row] = True
                    break
        if stream is not None:
            step = _stream(stream, step, out_tokens, num, settings.pad_id)
        if done.all():
            break
        # each row proposes at most what it could still keep (the target adds one more)
        budgets = [0 if done[r] else min(stats[r].budget(k), n - num[r] - 1) for r in range(b)]
        proposals = proposer.propose(seqs, budgets) if any(budgets) else [[]] * b
        num_drafts = np.asarray([len(x) for x in proposals], np.int32)
        start = np.asarray([len(s) - 1 for s in seqs], np.int32)
        index = num.astype(np.int32)
        if not num_drafts.any():
            cache, targets, logprobs = PROGRAMS["decode"](
                config, p, cache, np.asarray([s[-1] for s in seqs], np.int32), start, keys,
                index, settings=settings, weights_out_first=out_first)
            accepted = np.zeros(b, np.int32)
        else:
            chunk = np.zeros((b, k + 1), np.int32)
            for row, s in enumerate(seqs):
                chunk[row, 0] = s[-1]
                chunk[row, 1:1 + num_drafts[row]] = proposals[row]
            cache, targets, logprobs, accepted = PROGRAMS["verify"](
                config, p, cache, chunk, start, num_drafts, keys, index, settings=settings,
                weights_out_first=out_first)
        targets, logprobs, accepted = jax.device_get((targets, logprobs, accepted))
        for row in range(b):
            a = int(accepted[row])
            stats[row].record(int(num_drafts[row]), a)
            if isinstance(proposer, _DraftState) and num_drafts.any():
                proposer.kept(row, a)
            new[row] = targets[row, :a + 1].tolist()
            new_lp[row] = logprobs[row, :a + 1].tolist()
    logger.debug("speculative generate: B=%d, %s", b,
                 [f"{s.acceptance_rate:.2f}" for s in stats])
    return out_tokens, out_logprobs, num, stats


def _stream(stream: StreamFn, step: int, out_tokens: np.ndarray, num: np.ndarray,
            pad_id: int) -> int:
    """Calls ``stream`` once per token index every row has reached since ``step``."""
    while step < num.max():
        active = num > step
        stream(step, np.where(active, out_tokens[:, step], pad_id).astype(np.int32), active)
        step += 1
    return step
