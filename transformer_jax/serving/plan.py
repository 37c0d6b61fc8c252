"""What one engine step runs (``StepPlan``, built by ``scheduler.Scheduler.schedule``), the
buckets that keep its compiled shapes few (prompt chunk lengths, chunk rows: prompts prefilled
together, and page-table widths), and its rows' sampling settings (``row_sampling``)."""

from __future__ import annotations

import dataclasses

import numpy as np

from transformer_jax.serving.requests import MAX_TOP_LOGPROBS, Request
from transformer_jax.serving.step import RowSampling, Sampler


def chunk_buckets(max_chunk: int, smallest: int = 16) -> tuple[int, ...]:
    """The padded prefill chunk lengths: powers of two from ``smallest`` below ``max_chunk``,
    then ``max_chunk`` (a chunk of c tokens runs in the smallest bucket >= c); also the
    page-table widths, from a ``smallest`` width up to the whole table."""
    buckets, b = [], min(smallest, max_chunk)
    while b < max_chunk:
        buckets.append(b)
        b *= 2
    return (*buckets, max_chunk)


def row_bucket(n: int) -> int:
    """The padded number of chunk rows of a step of n chunks: the power of two >= n."""
    return 1 << (n - 1).bit_length()


@dataclasses.dataclass
class Chunk:
    """``length`` tokens of ``req``'s prompt from position ``start``; ``forks``: the waiting
    requests that draw their first token from its logits (with its last chunk)."""

    req: Request
    start: int
    length: int
    forks: list[Request] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class StepPlan:
    """What one step runs: decode rows for ``decodes`` (each in its slot) through a page table
    ``width`` wide, and the prompt ``chunks`` as ``rows`` rows (a power of two) of ``bucket``
    tokens through a table ``chunk_width`` wide. ``copies``: (source, destination) pages of the
    forks."""

    decodes: list[Request]
    chunks: list[Chunk] = dataclasses.field(default_factory=list)
    rows: int = 0
    bucket: int = 0
    width: int = 0
    chunk_width: int = 0
    copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    @property
    def forks(self) -> list[Request]:
        """Every chunk's forks."""
        return [f for c in self.chunks for f in c.forks]

    def drawing(self) -> tuple[list[Request], list[int]]:
        """The requests that draw a token from the chunks' logits, each chunk's then its
        forks', and the chunk row each draws from."""
        reqs, rows = [], []
        for i, c in enumerate(self.chunks):
            reqs += [c.req, *c.forks]
            rows += [i] * (1 + len(c.forks))
        return reqs, rows

    @property
    def sample_rows(self) -> int:
        """The chunks' sampling rows: one per chunk row, or with forks one per drawing
        request, padded to a power of two."""
        if not self.forks:
            return self.rows
        return row_bucket(len(self.drawing()[0]))


def row_sampling(reqs: list[Request | None], vocab_size: int) -> tuple[RowSampling, Sampler]:
    """Per-row sampling arrays (idle rows greedy) and the step's static switches."""
    r = len(reqs)
    key_data = np.zeros((r, 2), np.uint32)
    token_index = np.zeros(r, np.int32)
    temperature = np.zeros(r, np.float32)
    top_k = np.full(r, vocab_size, np.int32)
    top_p = np.ones(r, np.float32)
    min_p = np.zeros(r, np.float32)
    for i, req in enumerate(reqs):
        if req is None:
            continue
        p = req.params
        key_data[i], token_index[i], temperature[i] = req.key_data, req.num_new, p.temperature
        top_k[i] = vocab_size if p.top_k is None else p.top_k
        top_p[i] = 1 if p.top_p is None else p.top_p
        min_p[i] = 0 if p.min_p is None else p.min_p
    sampled = bool(np.any(temperature > 0))
    alternatives = any(req is not None and req.params.top_logprobs for req in reqs)
    sampler = Sampler(sampled=sampled, top_k=sampled and bool(np.any(top_k < vocab_size)),
                      top_p=sampled and bool(np.any(top_p < 1)),
                      min_p=sampled and bool(np.any(min_p > 0)),
                      top_logprobs=min(MAX_TOP_LOGPROBS, vocab_size) if alternatives else 0)
    return RowSampling(key_data, token_index, temperature, top_k, top_p, min_p), sampler
