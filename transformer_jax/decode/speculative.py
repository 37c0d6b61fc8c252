"""Speculative decoding: proposers, and the rule that keeps the target's distribution.

A proposer guesses the next k tokens of a sequence cheaply; the target model then scores the
sequence's last token and the k guesses in ONE forward (a chunk of k + 1 positions, the way
prefill writes several), and keeps the longest prefix of guesses its own sampler agrees with,
plus one token of its own (the correction at the first disagreement, or a bonus after k
agreements). A step therefore gives between 1 and k + 1 tokens for about the cost of one when
decode is bound by reading the weights and the cache (small batches).

Exactness. Both proposers here propose deterministically (a point mass q = one-hot(d)): the
n-gram proposer copies what followed an earlier occurrence of the last n tokens, the draft
model proposes its argmax. For a point mass the standard rule (accept d with
``min(1, p(d) / q(d)) = p(d)``, else draw from ``max(0, p - q)`` normalised = p without d) is
realised exactly by drawing x ~ p with the key the non-speculative decode would use for that
token (``fold_in(key, token index)``) and accepting iff x == d: x is then the output either way.
So a speculative decode gives *the same tokens* as the plain one for the same seed, greedy or
sampled, whatever else is in the batch, not merely the same distribution. ``rejection_sample``
is the general rule for a proposer with a non-degenerate q (a sampled draft, EAGLE-style heads),
kept here with its statistical test.

Spec strings (``parse_spec``): ``"ngram"``, ``"ngram:k=4"``, ``"ngram:k=4:n=3"``,
``"draft:PATH"``, ``"draft:PATH:k=4"``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

#: The most tokens one verification may propose per row.
MAX_K = 16


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """How a request (or ``generate``) speculates.

    Attributes:
      method: ``"ngram"`` (prompt lookup) or ``"draft"`` (a small model).
      k: tokens proposed per verification, in [1, ``MAX_K``].
      n: (n-gram) the longest suffix matched; shorter ones down to ``min_n`` are tried next.
      min_n: (n-gram) the shortest suffix matched.
      draft: (draft) the draft checkpoint's path.
    """

    method: str = "ngram"
    k: int = 4
    n: int = 3
    min_n: int = 1
    draft: str | None = None

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "draft"):
            raise ValueError(f"speculative method must be 'ngram' or 'draft', got "
                             f"{self.method!r}")
        for name in ("k", "n", "min_n"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative {name} must be a positive int, got {value!r}")
        if self.k > MAX_K:
            raise ValueError(f"speculative k must be at most {MAX_K}, got {self.k}")
        if self.min_n > self.n:
            raise ValueError(f"speculative min_n ({self.min_n}) exceeds n ({self.n})")
        if self.method == "draft" and not self.draft:
            raise ValueError("speculative method 'draft' needs a checkpoint path "
                             "(draft:PATH:k=4)")

    def __str__(self) -> str:
        if self.method == "draft":
            return f"draft:{self.draft}:k={self.k}"
        return f"ngram:k={self.k}:n={self.n}"


def parse_spec(spec: str | SpeculativeConfig | None) -> SpeculativeConfig | None:
    """A ``SpeculativeConfig`` from a spec string (``"ngram:k=4"``, ``"draft:PATH:k=4"``);
    None and configs pass through.

    Raises:
      ValueError: one line naming what is wrong.
    """
    if spec is None or isinstance(spec, SpeculativeConfig):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"speculative spec must be 'ngram[:k=K][:n=N]' or 'draft:PATH[:k=K]', "
                         f"got {spec!r}")
    method, *rest = spec.strip().split(":")
    fields: dict[str, object] = {"method": method}
    if method == "draft":
        if not rest or not rest[0] or "=" in rest[0]:
            raise ValueError(f"speculative spec {spec!r}: 'draft' needs a path, as "
                             "draft:PATH:k=4")
        fields["draft"], rest = rest[0], rest[1:]
    elif method != "ngram":
        raise ValueError(f"speculative spec {spec!r}: unknown method {method!r} (expected "
                         "'ngram' or 'draft')")
    allowed = ("k",) if method == "draft" else ("k", "n")
    for item in rest:
        name, eq, value = item.partition("=")
        if not eq or name not in allowed:
            raise ValueError(f"speculative spec {spec!r}: bad option {item!r} (options: "
                             f"{', '.join(a + '=INT' for a in allowed)})")
        try:
            fields[name] = int(value)
        except ValueError:
            raise ValueError(f"speculative spec {spec!r}: {name} must be an int, got "
                             f"{value!r}") from None
    return SpeculativeConfig(**fields)  # type: ignore[arg-type]


# Proposers ---------------------------------------------------------------------------------------

class Proposer(Protocol):
    """Proposes up to k next tokens for each of B sequences (host side).

    ``propose(contexts, ks)`` gets each row's whole sequence so far (prompt and output) and the
    most it may propose (0: none), and returns B lists of at most ``ks[b]`` ids. A proposer
    with a model keeps its own cache keyed by row; ``reset(row)`` forgets one row.
    """

    def propose(self, contexts: Sequence[Sequence[int]], ks: Sequence[int]) -> list[list[int]]:
        ...

    def reset(self, row: int) -> None:
        ...


def ngram_lookup(context: Sequence[int] | np.ndarray, k: int, n: int = 3,
                 min_n: int = 1) -> list[int]:
    """Prompt lookup: the k tokens that followed the latest earlier occurrence of the
    context's last n tokens (n from ``n`` down to ``min_n``, the longest match first).

    Args:
      context: the sequence so far (prompt + output), L ids.
      k: the most tokens to propose.
      n: the longest suffix to match.
      min_n: the shortest suffix to match.

    Returns:
      k ids (a match near the end continues its own period, as a repeating pattern would);
      none without a match.
    """
    seq = np.asarray(context, np.int64)
    length = len(seq)
    if k <= 0:
        return []
    for m in range(min(n, length - 1), min_n - 1, -1):
        suffix = seq[length - m:]
        # windows ending before the suffix itself: starts 0 .. L - m - 1
        windows = np.lib.stride_tricks.sliding_window_view(seq[:length - 1], m)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + m
            out = seq[start:start + k].tolist()
            # a match overlapping the suffix (a repeating pattern) goes on copying what it
            # proposes, as LZ77 copies: position L + j repeats position start + len + j
            while len(out) < k:
                out.append(out[len(out) - (length - start)])
            return out
    return []


def ngram_propose(seq: jax.Array, length: jax.Array, k: int, n: int = 3, min_n: int = 1
                  ) -> tuple[jax.Array, jax.Array]:
    """``ngram_lookup`` for B rows at once, in ``jnp`` with fixed shapes (inside the device
    loop): the k tokens that followed the latest earlier occurrence of each row's last m
    tokens, m from ``n`` down to ``min_n``.

    Args:
      seq: [B, S] int32 each row's sequence so far (prompt + output) in its first ``length``
        entries (anything after).
      length: [B] int32 the rows' lengths L, each in [1, S].
      k, n, min_n: static, as ``ngram_lookup``'s.

    Returns:
      ([B, k] int32 proposals, [B] bool whether the row found a match; without one its
      proposals are meaningless).
    """
    b, s = seq.shape
    j = jnp.arange(s, dtype=jnp.int32)
    length = length.astype(jnp.int32)
    found = jnp.zeros((b,), bool)
    start = jnp.zeros((b,), jnp.int32)  # where the proposals begin in seq
    for m in range(n, min_n - 1, -1):  # the longest suffix first
        eq = jnp.ones((b, s), bool)
        for i in range(m):  # window j matches at offset i: seq[j + i] == seq[L - m + i]
            shifted = jnp.pad(seq[:, i:], ((0, 0), (0, i)), constant_values=-1)
            want = jnp.take_along_axis(seq, jnp.maximum(length - m + i, 0)[:, None], axis=1)
            eq &= shifted == want
        # windows ending before the suffix itself (starts 0 .. L - m - 1), when m <= L - 1
        valid = (j[None] <= (length - 1 - m)[:, None]) & (m <= length - 1)[:, None]
        last = jnp.max(jnp.where(eq & valid, j[None], -1), axis=1)
        take = ~found & (last >= 0)
        start = jnp.where(take, last + m, start)
        found |= take
    # a match near the end continues its own period p = L - start (LZ77's overlapping copy)
    period = jnp.maximum(length - start, 1)
    index = start[:, None] + jnp.arange(k, dtype=jnp.int32)[None] % period[:, None]
    return jnp.take_along_axis(seq, jnp.minimum(index, s - 1), axis=1), found


@dataclasses.dataclass
class NgramProposer:
    """The n-gram prompt-lookup proposer (no model): ``ngram_lookup`` per row."""

    n: int = 3
    min_n: int = 1

    def propose(self, contexts: Sequence[Sequence[int]], ks: Sequence[int]) -> list[list[int]]:
        return [ngram_lookup(c, k, self.n, self.min_n) if k > 0 else []
                for c, k in zip(contexts, ks, strict=True)]

    def reset(self, row: int) -> None:
        del row


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


def rejection_sample(p: jax.Array, q: jax.Array, drafts: jax.Array, key: jax.Array
                     ) -> tuple[jax.Array, jax.Array]:
    """The standard speculative rule for proposals drawn from a distribution q.

    Proposal i is accepted with probability ``min(1, p_i(d_i) / q_i(d_i))``; at the first
    rejection the output token is drawn from ``max(0, p_i - q_i)`` normalised; after k
    acceptances a bonus token is drawn from ``p_k``. The output is then distributed as the
    target's own sampling, whatever q is.

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


# Back-off ----------------------------------------------------------------------------------------

@dataclasses.dataclass
class Acceptance:
    """One row's acceptance record, for its metrics and its back-off.

    A row whose recent acceptance (an exponential average of accepted / proposed) falls below
    ``floor`` stops proposing for ``cooldown`` verifications' worth of steps, then probes again
    with its average reset halfway to 1 (so a passage that becomes repetitive is found again).
    """

    proposed: int = 0
    accepted: int = 0
    verifications: int = 0
    rate: float = 1.0
    paused: int = 0
    floor: float = 0.3
    cooldown: int = 8
    decay: float = 0.7

    def record(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        self.proposed += proposed
        self.accepted += accepted
        self.verifications += 1
        self.rate = self.decay * self.rate + (1 - self.decay) * accepted / proposed
        if self.rate < self.floor:
            self.paused = self.cooldown

    def budget(self, k: int) -> int:
        """How many tokens the row may propose now (0 while paused); counts a paused step."""
        if self.paused > 0:
            self.paused -= 1
            if self.paused == 0:
                self.rate = 0.5 * (self.rate + 1.0)
            return 0
        return k

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed over the row's life (0 before any proposal)."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted(self) -> float:
        """Mean tokens kept per verification, the target's own token included."""
        return (self.accepted + self.verifications) / self.verifications \
            if self.verifications else 0.0


def backoff_budget(rate: jax.Array, paused: jax.Array, active: jax.Array
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``Acceptance.budget`` for B rows at once, in ``jnp`` (the device loop's back-off).

    Args:
      rate: [B] float32 each row's recent acceptance; paused: [B] int32 steps left paused.
      active: [B] bool rows that ask for a budget this step (others are left as they are).

    Returns:
      ([B] bool may the row propose now, the new rate, the new paused).
    """
    was_paused = active & (paused > 0)
    paused = jnp.where(was_paused, paused - 1, paused)
    rate = jnp.where(was_paused & (paused == 0), 0.5 * (rate + 1.0), rate)
    return active & ~was_paused, rate, paused


def backoff_record(rate: jax.Array, paused: jax.Array, proposed: jax.Array,
                   accepted: jax.Array, acceptance: Acceptance | None = None
                   ) -> tuple[jax.Array, jax.Array]:
    """``Acceptance.record`` for B rows at once, in ``jnp``: [B] rate and paused after a
    verification of [B] ``proposed`` tokens of which [B] ``accepted`` were kept (rows with
    nothing proposed are left as they are); floor, cooldown and decay from ``acceptance``."""
    a = Acceptance() if acceptance is None else acceptance
    has = proposed > 0
    new = a.decay * rate + (1 - a.decay) * accepted / jnp.maximum(proposed, 1)
    rate = jnp.where(has, new, rate)
    paused = jnp.where(has & (rate < a.floor), a.cooldown, paused)
    return rate, paused


def expected_tokens(rate: float, k: int) -> float:
    """Tokens a verification of k proposals gives on average when each is accepted with
    probability ``rate`` independently: 1 + r + ... + r^k."""
    return float(sum(rate ** i for i in range(k + 1)))
