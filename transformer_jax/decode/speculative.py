"""Speculative decoding: proposers, and the rule that keeps the target's distribution.

The target scores a row's last token and k proposals in one forward and keeps the longest
prefix its own sampler agrees with, plus its own token. Both proposers here propose a point mass
d, for which drawing x ~ p with the plain decode's key and accepting iff x == d is the standard
rule exactly: the tokens equal the plain decode's (``rejection_sample``: the general rule). A
row proposes only while that pays (``expected_tokens``, ``pays``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.decode import sampling

Params = dict[str, Any]

#: The most tokens one verification may propose per row.
MAX_K = 16
#: The longest n-gram suffix matched (the device loop unrolls n (n + 1) / 2 comparisons).
MAX_N = 16


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """How a request (or ``generate``) speculates.

    Attributes:
      method: ``"ngram"`` (prompt lookup), ``"draft"`` (a small model) or ``"mtp"`` (k = 1).
      k: tokens proposed per verification, in [1, ``MAX_K``].
      n: (n-gram) the longest suffix matched, in [1, ``MAX_N``].
      min_n: (n-gram) the shortest suffix matched.
      draft: (draft) the draft checkpoint's path.
    """

    method: str = "ngram"
    k: int = 4
    n: int = 3
    min_n: int = 1
    draft: str | None = None

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "draft", "mtp"):
            raise ValueError(f"speculative method must be 'ngram', 'draft' or 'mtp', got "
                             f"{self.method!r}")
        for name, most in (("k", MAX_K), ("n", MAX_N), ("min_n", None)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative {name} must be a positive int, got {value!r}")
            if most is not None and value > most:
                raise ValueError(f"speculative {name} must be at most {most}, got {value}")
        if self.min_n > self.n:
            raise ValueError(f"speculative min_n ({self.min_n}) exceeds n ({self.n})")
        if self.method == "mtp" and self.k != 1:
            raise ValueError(f"speculative mtp proposes one token a round (mtp:k=1), got "
                             f"k={self.k}")
        if self.method == "draft" and not self.draft:
            raise ValueError("speculative method 'draft' needs a checkpoint path "
                             "(draft:PATH:k=4)")

    def __str__(self) -> str:
        if self.method == "draft":
            return f"draft:{self.draft}:k={self.k}"
        if self.method == "mtp":
            return f"mtp:k={self.k}"
        return f"ngram:k={self.k}:n={self.n}"


def parse_spec(spec: str | SpeculativeConfig | None) -> SpeculativeConfig | None:
    """A ``SpeculativeConfig`` from a spec string: ``"ngram[:k=K][:n=N]"``, ``"draft:PATH[:k=K]"``
    or ``"mtp[:k=1]"``; None and configs pass through.

    Raises:
      ValueError: one line naming what is wrong.
    """
    if spec is None or isinstance(spec, SpeculativeConfig):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError("speculative spec must be 'ngram[:k=K][:n=N]', 'draft:PATH[:k=K]' or "
                         f"'mtp[:k=1]', got {spec!r}")
    method, *rest = spec.strip().split(":")
    fields: dict[str, object] = {"method": method}
    if method == "draft":
        if not rest or not rest[0] or "=" in rest[0]:
            raise ValueError(f"speculative spec {spec!r}: 'draft' needs a path, as "
                             "draft:PATH:k=4")
        fields["draft"], rest = rest[0], rest[1:]
    elif method not in ("ngram", "mtp"):
        raise ValueError(f"speculative spec {spec!r}: unknown method {method!r} (expected "
                         "'ngram', 'draft' or 'mtp')")
    allowed = ("k",) if method in ("draft", "mtp") else ("k", "n")
    for item in rest:
        name, eq, value = item.partition("=")
        if not eq or name not in allowed:
            raise ValueError(f"speculative spec {spec!r}: bad option {item!r} (options: "
                             f"{', '.join(a + '=INT' for a in allowed)})")
        if name in fields:
            raise ValueError(f"speculative spec {spec!r}: {name} is given twice")
        try:
            fields[name] = int(value)
        except ValueError:
            raise ValueError(f"speculative spec {spec!r}: {name} must be an int, got "
                             f"{value!r}") from None
    if method == "mtp":
        fields.setdefault("k", 1)
    return SpeculativeConfig(**fields)  # type: ignore[arg-type]


# Proposers ---------------------------------------------------------------------------------------

def ngram_proposals(contexts: Sequence[Sequence[int]], ks: Sequence[int], n: int = 3,
                    min_n: int = 1) -> list[list[int]]:
    """Prompt lookup on the host for R sequences (the engine's): ``ngram_propose``'s rule, each
    row's latest match found by a byte search (``bytes.rfind``, faster than numpy here).

    Args:
      contexts: R sequences so far (prompt + output), ids.
      ks: the most tokens each may propose; n, min_n: the longest and shortest suffix matched.

    Returns:
      R lists: ``ks[r]`` ids, or none without a match (or with ``ks[r] <= 0``).
    """
    out = []
    for context, k in zip(contexts, ks, strict=True):
        length, proposals = len(context), []
        buf = np.asarray(context, np.int32).tobytes() if k > 0 and length > 1 else b""
        for m in range(min(n, length - 1), min_n - 1, -1) if buf else ():
            suffix = buf[4 * (length - m):]
            at = buf.rfind(suffix, 0, 4 * (length - 1))  # windows before the last token
            while at > 0 and at % 4:  # a match across token boundaries: look further back
                at = buf.rfind(suffix, 0, at + len(suffix) - 1)
            if at >= 0:  # go on from it, with its own period past the context's end
                start = at // 4 + m
                proposals = [int(context[start + i % (length - start)]) for i in range(k)]
                break
        out.append(proposals)
    return out


def ngram_propose(seq: jax.Array, length: jax.Array, k: int, n: int = 3, min_n: int = 1
                  ) -> tuple[jax.Array, jax.Array]:
    """Prompt lookup for B rows in fixed shapes (the device loop's): the k tokens that followed
    the latest earlier occurrence of each row's last m tokens, m from ``n`` down to ``min_n``.

    Args:
      seq: [B, S] int each row's sequence so far in its first ``length`` entries.
      length: [B] int the rows' lengths L, each in [1, S].
      k, n, min_n: static: the most tokens proposed, the longest and shortest suffix matched.

    Returns:
      ([B, k] proposals (a match near the end continues its own period), [B] bool whether the
      row found a match; without one its proposals are meaningless).
    """
    b, s = seq.shape
    j = jnp.arange(s, dtype=jnp.int32)
    length = length.astype(jnp.int32)
    found = jnp.zeros((b,), bool)
    start = jnp.zeros((b,), jnp.int32)  # where the proposals begin in seq
    for m in range(min(n, s - 1), min_n - 1, -1):  # the longest suffix first
        w = s - m + 1  # windows of m tokens, starting at j < w
        at = jnp.maximum(length[:, None] - m + jnp.arange(m, dtype=jnp.int32)[None], 0)
        suffix = jnp.take_along_axis(seq, at, axis=1)  # [B, m] each row's last m tokens
        eq = seq[:, :w] == suffix[:, :1]
        for i in range(1, m):  # window j matches at offset i: seq[j + i] == seq[L - m + i]
            eq &= seq[:, i:i + w] == suffix[:, i:i + 1]
        # windows ending before the suffix itself: starts 0 .. L - m - 1 (none when m >= L)
        valid = j[None, :w] <= (length - 1 - m)[:, None]
        last = jnp.max(jnp.where(eq & valid, j[None, :w], -1), axis=1)
        take = ~found & (last >= 0)
        start = jnp.where(take, last + m, start)
        found |= take
    # a match near the end continues its own period p = L - start (LZ77's overlapping copy)
    period = jnp.maximum(length - start, 1)
    index = start[:, None] + jnp.arange(k, dtype=jnp.int32)[None] % period[:, None]
    return jnp.take_along_axis(seq, jnp.minimum(index, s - 1), axis=1), found


# Verification ------------------------------------------------------------------------------------

def accepted_length(targets: jax.Array, drafts: jax.Array, num_drafts: jax.Array) -> jax.Array:
    """How many leading proposals each row keeps.

    Args:
      targets: [B, T] int32 the target's own draw at each of the T = k + 1 verified positions.
      drafts: [B, k] int32 the proposed tokens (anything past ``num_drafts``).
      num_drafts: [B] int32 proposals per row, each in [0, k].

    Returns:
      [B] int32 a in [0, num_drafts]: ``drafts[:, :a] == targets[:, :a]``; the row's output
      is ``targets[:, :a + 1]``.
    """
    k = drafts.shape[1]
    match = (targets[:, :k] == drafts) & (jnp.arange(k) < num_drafts[:, None])
    return jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def forward_chunk(model: Any, params: Params, cache: Any, tokens: jax.Array, start: jax.Array,
                  **kwargs: Any) -> Any:
    """[B, T] tokens at positions ``start[b] + t`` in one forward of ``model`` (a
    ``decode_model``) over its cache (contiguous or paged): the model's output, the cache
    with the T positions written."""
    positions = start[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)
    return model.apply({"params": params}, tokens, positions, cache=cache, **kwargs)


def verify(model: Any, params: Params, cache: Any, tokens: jax.Array, start: jax.Array,
           num_drafts: jax.Array, draw: Callable[[jax.Array], tuple[jax.Array, jax.Array]]
           ) -> tuple[Any, jax.Array, jax.Array, jax.Array]:
    """One verification of every row's last token and proposals (``generate``'s and the engine's).

    Args:
      model, params: the target (a ``decode_model``) and its weights.
      cache: its cache (slots before each row's ``start`` valid).
      tokens: [B, T] int32: the row's last token, then its proposals (T = k + 1).
      start: [B] int32 the position of ``tokens[:, 0]``.
      num_drafts: [B] int32 proposals per row, in [0, k].
      draw: [B, T, V] logits -> the target's draws ([B, T], or [B, T, 1 + K] with top
        alternatives after the drawn token) and their log-probabilities.

    Returns:
      (the cache with all T positions written, the draws, their log-probabilities, [B] int32
      accepted proposals a: the row's new tokens are the draws at ``[:a + 1]``).
    """
    out = forward_chunk(model, params, cache, tokens, start)
    drawn, logprobs = draw(out.logits)
    targets = drawn if drawn.ndim == 2 else drawn[..., 0]
    return out.cache, drawn, logprobs, accepted_length(targets, tokens[:, 1:], num_drafts)


def greedy_proposals(step: Callable[[Any, jax.Array, jax.Array], tuple[jax.Array, Any]],
                     cache: Any, first: jax.Array, start: jax.Array, steps: int
                     ) -> tuple[Any, jax.Array]:
    """A draft model's greedy proposals after its first: ``steps`` more one-token steps.

    Args:
      step: (cache, [B] tokens, [B] positions) -> ([B, V] logits, cache): the draft's step.
      cache: the draft's cache; first: [B] int32 its first proposal, fed at ``start`` [B].
      steps: static, the further proposals.

    Returns:
      (the cache, [B, 1 + steps] int32 the proposals, ``first`` included).
    """
    def one(carry: tuple[Any, jax.Array], i: jax.Array) -> tuple[tuple[Any, jax.Array],
                                                                 jax.Array]:
        cache, token = carry
        logits, cache = step(cache, token, start + i)
        nxt = sampling.argmax(logits)
        return (cache, nxt), nxt

    (cache, _), rest = jax.lax.scan(one, (cache, first), jnp.arange(steps, dtype=jnp.int32))
    return cache, jnp.concatenate([first[:, None], rest.T], axis=1)


def rejection_sample(p: jax.Array, q: jax.Array, drafts: jax.Array, key: jax.Array
                     ) -> tuple[jax.Array, jax.Array]:
    """The standard speculative rule for proposals drawn from a distribution q.

    Proposal i is accepted with probability ``min(1, p_i(d_i) / q_i(d_i))``; the first rejection
    draws from ``max(0, p_i - q_i)`` normalised, k acceptances a bonus token from ``p_k``.

    Args:
      p: [B, k + 1, V] the target's sampling probabilities at each verified position.
      q: [B, k, V] the proposer's probabilities the drafts were drawn from.
      drafts: [B, k] int32 the proposed tokens.
      key: a PRNG key for the row's draws (split per position inside).

    Returns:
      ([B] int32 accepted count a, [B, k + 1] int32 tokens: the drafts up to a, then the
      corrected or bonus token at a; positions past a are meaningless).
    """
    b, k = drafts.shape
    u_key, r_key = jax.random.split(key)
    u = jax.random.uniform(u_key, (b, k))
    p_d = jnp.take_along_axis(p[:, :k], drafts[..., None], -1)[..., 0]
    q_d = jnp.take_along_axis(q, drafts[..., None], -1)[..., 0]
    accept = u * q_d < p_d  # u < min(1, p/q) without dividing by zero
    a = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    residual = jnp.maximum(p[:, :k] - q, 0.0)
    residual = jnp.concatenate([residual, p[:, k:]], axis=1)  # [B, k + 1, V]
    # a rejection leaves some residual mass (p(d) < q(d)); guard all-zero rows anyway
    residual = jnp.where(residual.sum(-1, keepdims=True) > 0, residual, p)
    at = jnp.take_along_axis(residual, a[:, None, None], 1)[:, 0]  # [B, V]
    fix = jax.random.categorical(r_key, jnp.log(at / at.sum(-1, keepdims=True)))
    tokens = jnp.concatenate([drafts, jnp.zeros((b, 1), drafts.dtype)], axis=1)
    tokens = jnp.where(jnp.arange(k + 1) == a[:, None], fix[:, None].astype(drafts.dtype),
                       tokens)
    return a, tokens


# Cost model ------------------------------------------------------------------------------------

#: Per round, the weight the acceptance evidence keeps (older rounds fade).
DECAY = 0.8
#: The evidence before any: an acceptance of 1/2 worth 2 tries.
PRIOR_HITS, PRIOR_TRIES = 1.0, 2.0
#: A row that stopped proposing starts again only when its proposals are expected to give this
#: much more than the round costs (hysteresis against flipping on noise).
RESTART_MARGIN = 0.15


def expected_tokens(rate: Any, k: Any) -> Any:
    """Tokens a verify round of k proposals gives on average at acceptance ``rate`` (the
    target's own token included): 1 + r + ... + r^k, for [B] arrays or Python numbers."""
    r = rate * (1 - 1e-4)
    return (1 - r ** (k + 1)) / (1 - r)


def pays(expected: Any, cost: Any, proposing: Any) -> Any:
    """Whether a row proposes (the cost rule, for [B] arrays or one row's Python numbers).

    Args:
      expected: tokens a verify round is expected to give the row (``expected_tokens``).
      cost: what a verify round costs, in plain steps, measured on the model at hand.
      proposing: whether the row proposed last time: it goes on while ``expected > cost``;
        a row that stopped starts again above ``cost * (1 + RESTART_MARGIN)``.
    """
    return expected > cost * (1 + RESTART_MARGIN * (1 - proposing))


def evidence(hits: Any, tries: Any, new_hits: Any, new_tries: Any) -> tuple[Any, Any]:
    """Acceptance evidence after a verification: decayed hits and tries plus its own (n
    proposals of which a were kept tried ``a + (a < n)`` positions and hit a). A watched
    proposal, checked by plain steps, counts as its verification would have."""
    return DECAY * hits + new_hits, DECAY * tries + new_tries


@dataclasses.dataclass
class Acceptance:
    """One row's speculation record: counters, acceptance evidence (``evidence``) and the cost
    rule's state (``pays``); the engine keeps one per request.

    Attributes:
      proposed, accepted, verifications: proposals verified, proposals kept, verify rounds.
      hits, tries: decayed acceptance evidence; ``rate`` = hits / tries.
      proposing: the cost rule's last answer.
      declined: rounds in which the row had proposals that the cost rule did not verify.
      watched, matched: a proposal not verified that plain steps check (``evidence``), and
        its tokens matched so far.
    """

    proposed: int = 0
    accepted: int = 0
    verifications: int = 0
    hits: float = PRIOR_HITS
    tries: float = PRIOR_TRIES
    proposing: bool = True
    declined: int = 0
    watched: list[int | None] = dataclasses.field(default_factory=list)
    matched: int = 0

    @property
    def rate(self) -> float:
        """The recent acceptance of one proposal (decayed hits / tries)."""
        return self.hits / self.tries

    def record(self, proposed: int, accepted: int) -> None:
        """A verification of ``proposed`` proposals of which ``accepted`` were kept."""
        if proposed <= 0:
            return
        self.proposed += proposed
        self.accepted += accepted
        self.verifications += 1
        self.hits, self.tries = evidence(self.hits, self.tries, accepted,
                                         accepted + (accepted < proposed))
        self.watched = []

    def watch(self, proposals: Sequence[int | None]) -> None:
        """Watches proposals the cost rule did not verify (unless it watches some already);
        None for a draft's, whose next proposal each step gives (``observe``'s ``expect``)."""
        if not self.watched:
            self.watched, self.matched = list(proposals), 0

    def observe(self, token: int, expect: int | None = None) -> None:
        """A plain step's token against the watched proposal's next one (or ``expect``)."""
        if not self.watched:
            return
        hit = token == (self.watched[self.matched] if expect is None else expect)
        self.matched += hit
        if not hit or self.matched == len(self.watched):
            self.hits, self.tries = evidence(self.hits, self.tries, self.matched,
                                             self.matched + (not hit))
            self.watched = []

    def decide(self, k: int, cost: float) -> bool:
        """Whether the row should verify k proposals in a round costing ``cost`` plain steps
        (``pays``, with its hysteresis); a no counts as declined."""
        self.proposing = bool(pays(expected_tokens(self.rate, k), cost, self.proposing))
        self.declined += not self.proposing
        return self.proposing

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed over the row's life (0 before any proposal)."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted(self) -> float:
        """Mean tokens kept per verification, the target's own token included."""
        return (self.accepted + self.verifications) / self.verifications \
            if self.verifications else 0.0


def measure_round_cost(run: Callable[[bool, int], tuple[float, Sequence[int]]], rounds: int,
                       repeats: int = 3) -> float | None:
    """What a verify round costs in plain rounds, timed on a decode program itself.

    Args:
      run: ``(verify, max_rounds) -> (seconds, (plain rounds, verify rounds) run)``: the
        program with every round verifying (where rows can propose) or every round plain.
      rounds: the rounds of each timed run; repeats: the timed triples.

    Returns:
      The verify rounds' time per round over the plain rounds', each less a run of no round
      (the prefill), each the fastest of ``repeats``; None when nothing was measured.
    """
    if rounds <= 0:
        return None
    run(False, 0)  # compiles, untimed
    times: dict[tuple[bool, int], float] = {}
    counts = {}
    for _ in range(repeats):  # back to back, so that the load falls on all three alike
        for verify, r in ((False, 0), (False, rounds), (True, rounds)):
            seconds, counts[verify, r] = run(verify, r)
            times[verify, r] = min(times.get((verify, r), np.inf), seconds)
    (plain_n, _), (mixed_n, verify_n) = counts[False, rounds], counts[True, rounds]
    plain = (times[False, rounds] - times[False, 0]) / max(int(plain_n), 1)
    verify = (times[True, rounds] - times[False, 0] - int(mixed_n) * plain) / max(int(verify_n), 1)
    return verify / plain if plain_n and verify_n and plain > 0 and verify > 0 else None


def stop_message(where: str, cost: float, t: int, rate: float, expected: float) -> str:
    """The one log line of a speculation that stopped proposing because it would not pay."""
    return (f"{where}: speculation stopped: a verify round of {t} positions costs {cost:.2f} "
            f"plain steps on this model (measured) and gives {expected:.2f} tokens at the recent "
            f"acceptance {rate:.2f}; plain steps until the acceptance rises")
