"""The engine's host-side scheduler: slots, pages, chunked prefill and preemption.

Each step it plans (``schedule``):

1. a decode row for every running request, oldest first; one that needs a new page and finds
   none (after evicting parked prefix pages) preempts the newest request holding pages, itself
   included: that request's pages are released and it is queued again, to be recomputed from
   its prompt and the tokens it already has (nothing fails, nothing is sent twice);
2. within the token budget, a chunk of the prompt in prefill: the one being prefilled, or the
   oldest waiting request when a slot is free and the pool has pages for its whole prompt
   (after the full pages the prefix cache already holds for it, which it shares);
3. with the last chunk of a prompt, the forks: waiting requests with the very same tokens (the
   ``n`` choices of one API request, or the same prompt sent again) take a free slot each, share
   the prompt's full pages, get a copy of its last, partial page, and draw their first token from
   the same logits with their own key, so the prompt is computed once for all of them.

Then ``commit_prefill`` and ``commit_decodes`` take the step's tokens: a prompt whose last chunk
ran gets its first, running requests get theirs, finished requests give back their pages and
slot, and full pages are named in the prefix cache. Everything here is plain Python and
numpy; ``step.py`` runs the device part.
"""

from __future__ import annotations

import bisect
import dataclasses

import numpy as np

from transformer_jax.serving.grammar import fill_mask
from transformer_jax.serving.page_pool import NULL_PAGE, PagePool, pages_for
from transformer_jax.serving.prefix_cache import PrefixCache, page_digests
from transformer_jax.serving.requests import MAX_TOP_LOGPROBS, Request, State, TokenEvent
from transformer_jax.serving.step import DecodeRows, PrefillChunk, RowSampling, Sampler


def chunk_buckets(max_chunk: int, smallest: int = 16) -> tuple[int, ...]:
    """The padded prefill chunk lengths: powers of two from ``smallest`` below ``max_chunk``,
    then ``max_chunk`` (a chunk of c tokens runs in the smallest bucket >= c)."""
    buckets, b = [], min(smallest, max_chunk)
    while b < max_chunk:
        buckets.append(b)
        b *= 2
    return (*buckets, max_chunk)


def width_buckets(pages_per_seq: int, smallest: int) -> tuple[int, ...]:
    """The page-table widths a step runs at: powers of two from ``smallest`` below
    ``pages_per_seq``, then ``pages_per_seq``."""
    return chunk_buckets(pages_per_seq, smallest)


#: The narrowest page table a step runs at by default, in positions (see ``Scheduler``).
MIN_CONTEXT = 128


@dataclasses.dataclass
class StepPlan:
    """What one step runs: decode rows for ``decodes`` (each in its slot), their pages through a
    table ``width`` pages wide, and optionally ``chunk`` tokens of ``prefill``'s prompt from
    position ``start``, padded to ``bucket``, its pages through a table ``chunk_width`` wide
    (the two run as separate programs, so a long prompt does not widen the decode rows')."""

    decodes: list[Request]
    prefill: Request | None = None
    start: int = 0
    chunk: int = 0
    bucket: int = 0
    width: int = 0
    chunk_width: int = 0
    forks: list[Request] = dataclasses.field(default_factory=list)
    copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)


class Scheduler:
    """Slots, the page pool and the queues of an engine (see the module docstring).

    Args:
      num_slots: B, sequences decoded at once.
      num_pages: P pages in the pool (page 0 is the null page).
      page_size: positions per page.
      max_len: the most positions of one sequence (the model's context).
      max_chunk: the most prefill tokens per step.
      prefix_caching: whether full pages are shared between requests.
      forks: whether requests waiting with the tokens of a prompt whose last chunk runs fork
        from it (see the module docstring; the engine turns it off for models whose local
        layers keep per-slot rings, which a fork would not copy).
      min_context: the narrowest page table a step runs at, in positions. A step attends over
        its rows' first W pages, W the smallest width bucket (powers of two from this) that
        holds its longest row, so short sequences do not read the whole context
        (decode_25m, batch 8, the gather view: 21-41 ms per decode step at 8 pages of 16
        positions, against 76-97 ms at all 64).
    """

    def __init__(self, num_slots: int, num_pages: int, page_size: int, max_len: int,
                 max_chunk: int, prefix_caching: bool = True,
                 min_context: int = MIN_CONTEXT, forks: bool = True) -> None:
        self.num_slots = num_slots
        self.forks = forks
        self.page_size = page_size
        self.pages_per_seq = pages_for(max_len, page_size)
        self.buckets = chunk_buckets(max_chunk)
        self.widths = width_buckets(self.pages_per_seq,
                                    pages_for(min(min_context, max_len), page_size))
        self.pool = PagePool(num_pages)
        self.prefix = PrefixCache(self.pool, enabled=prefix_caching)
        self.page_table = np.full((num_slots, self.pages_per_seq), NULL_PAGE, np.int32)
        self.slots: list[Request | None] = [None] * num_slots
        self.waiting: list[Request] = []  # by id (arrival order), preempted ones included
        self.running: list[Request] = []  # by id
        self.prefilling: Request | None = None
        self.preemptions = 0
        self.forked = 0  # requests that drew their first token from another's prefill

    # Queues ----------------------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.running or self.prefilling)

    def check_no_leaks(self) -> None:
        """Raises AssertionError unless every page is free or parked in the prefix cache and
        no slot is taken (an idle scheduler)."""
        held, free = self.pool.held(), self.prefix.num_available
        if held or free != self.pool.capacity or any(s is not None for s in self.slots):
            raise AssertionError(f"pages leaked: held {held}, {free} of "
                                 f"{self.pool.capacity} available, slots {self.slots}")

    def describe(self) -> str:
        """One line of the queues and the pool, for logs and errors."""
        return (f"{len(self.waiting)} waiting, {len(self.running)} running, prefilling "
                f"{self.prefilling.id if self.prefilling else None}, "
                f"{self.prefix.num_available} of {self.pool.capacity} pages available")

    def submit(self, req: Request) -> None:
        bisect.insort(self.waiting, req, key=lambda r: r.id)

    def cancel(self, req: Request) -> None:
        """Ends ``req`` wherever it is (its pages and slot given back)."""
        if req.state == State.WAITING:
            self.waiting.remove(req)
        else:
            self._release(req)
        req.state, req.finish_reason = State.FINISHED, "cancelled"

    # Planning --------------------------------------------------------------------------------

    def schedule(self) -> StepPlan | None:
        """The next step's plan, or None when there is nothing to run."""
        decodes = []
        for req in list(self.running):
            if req.state == State.RUNNING and self._grow(req, req.cached + 1, preempt=True):
                decodes.append(req)
        plan = StepPlan(decodes)
        req = self.prefilling or self._admit()
        if req is not None:
            chunk = min(req.prefill_target - req.cached, self.buckets[-1])
            # Pages for as much of the chunk as the pool allows (a prefill never preempts).
            have = len(req.pages) + self.prefix.num_available
            chunk = min(chunk, have * self.page_size - req.cached)
            if chunk > 0 and self._grow(req, req.cached + chunk, preempt=False):
                plan.prefill, plan.start, plan.chunk = req, req.cached, chunk
                plan.bucket = self.buckets[bisect.bisect_left(self.buckets, chunk)]
                if self.forks and req.cached + chunk == req.prefill_target:
                    self._fork(plan)
        if not plan.decodes and plan.prefill is None:
            return None
        if plan.decodes:
            plan.width = self._width(max(len(r.pages) for r in plan.decodes))
        if plan.prefill is not None:
            plan.chunk_width = self._width(len(plan.prefill.pages))
        return plan

    def _width(self, pages: int) -> int:
        """The narrowest page-table width bucket that holds ``pages``."""
        return self.widths[bisect.bisect_left(self.widths, pages)]

    def _admit(self) -> Request | None:
        """The oldest waiting request, given a free slot and its prefix pages, when the pool
        can hold its whole prompt; else None."""
        if not self.waiting or None not in self.slots:
            return None
        req = self.waiting[0]
        target = len(req.tokens)
        req.digests = page_digests(req.tokens, self.page_size, req.digests, req.digest_root)
        # The prompt's last token is always computed: its logits give the next token.
        shared = self.prefix.match(req.digests[:(target - 1) // self.page_size])
        if pages_for(target, self.page_size) - len(shared) > self.prefix.num_available:
            self.prefix.release(shared)
            return None
        self.waiting.pop(0)
        slot = self.slots.index(None)
        self.slots[slot] = req
        req.slot, req.state, req.prefill_target = slot, State.PREFILL, target
        req.pages, req.cached = list(shared), len(shared) * self.page_size
        req.named = len(shared)
        req.prefix_hit_tokens += req.cached
        self.page_table[slot, :len(shared)] = shared
        self.prefilling = req
        return req

    def _fork(self, plan: StepPlan) -> None:
        """Admits, as ``plan.forks``, the waiting requests whose tokens are the prefilling
        prompt's (same adapter): each takes a free slot, holds the prompt's full pages once
        more and gets a fresh page for its last, partial one (``plan.copies``: (source,
        destination) pages the engine copies after the chunk's forward), while slots and pages
        last. Their first tokens come from the chunk's logits (``commit_prefill``)."""
        leader = plan.prefill
        target = leader.prefill_target
        full = target // self.page_size
        tokens = leader.tokens[:target]
        for req in list(self.waiting):
            if None not in self.slots:
                return
            if (len(req.tokens) != target or req.adapter != leader.adapter
                    or req.tokens != tokens):
                continue
            fresh: list[int] = []
            if full < len(leader.pages):  # the partial page: a copy of its own
                fresh = self.prefix.allocate(1) or []
                if not fresh:
                    return
                plan.copies.append((leader.pages[full], fresh[0]))
            for page in leader.pages[:full]:
                self.pool.share(page)
            self.waiting.remove(req)
            slot = self.slots.index(None)
            self.slots[slot] = req
            req.slot, req.state, req.prefill_target = slot, State.PREFILL, target
            req.pages = leader.pages[:full] + fresh
            req.cached, req.named = 0, 0
            req.digests = list(leader.digests)
            self.page_table[slot, :len(req.pages)] = req.pages
            plan.forks.append(req)

    def _grow(self, req: Request, length: int, *, preempt: bool) -> bool:
        """Gives ``req`` pages for ``length`` positions; with ``preempt``, preempts the newest
        page holder while the pool is short. False when ``req`` itself went (or, without
        ``preempt``, when the pages are not there)."""
        need = pages_for(length, self.page_size) - len(req.pages)
        while need > 0:
            pages = self.prefix.allocate(need)
            if pages is not None:
                self.page_table[req.slot, len(req.pages):len(req.pages) + need] = pages
                req.pages += pages
                return True
            if not preempt:
                return False
            victim = max((r for r in (*self.running, self.prefilling) if r is not None
                          and r.pages), key=lambda r: r.id, default=req)
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        """Frees ``req``'s pages and queues it again, to be recomputed (prompt + its tokens)."""
        self._release(req)
        req.state = State.WAITING
        req.preemptions += 1
        self.preemptions += 1
        self.submit(req)

    def _release(self, req: Request) -> None:
        """Takes ``req`` off its slot and gives back its pages."""
        self.prefix.release(req.pages)
        req.pages, req.cached, req.named = [], 0, 0
        if req is self.prefilling:
            self.prefilling = None
        if req in self.running:
            self.running.remove(req)
        if req.slot is not None:
            self.page_table[req.slot] = NULL_PAGE
            self.slots[req.slot] = None
            req.slot = None

    # Step inputs and results -----------------------------------------------------------------

    def inputs(self, plan: StepPlan, vocab_size: int, slot: bool = False,
               adapters: bool = False
               ) -> tuple[DecodeRows, PrefillChunk | None, RowSampling, Sampler]:
        """The step's device inputs (numpy) for ``plan``: a decode row per slot (idle ones
        write into the null page), and the chunk when there is one (with its slot when
        ``slot``: the row of the local layers' rings; with ``adapters``, each row's LoRA
        adapter, 0 for idle rows)."""
        prefill = None
        tokens = np.zeros(self.num_slots, np.int32)
        positions = np.zeros(self.num_slots, np.int32)
        table = np.full((self.num_slots, plan.width), NULL_PAGE, np.int32)
        adapter = np.zeros(self.num_slots, np.int32) if adapters else None
        for req in plan.decodes:
            tokens[req.slot], positions[req.slot] = req.tokens[-1], req.cached
            table[req.slot] = self.page_table[req.slot, :plan.width]
            if adapter is not None:
                adapter[req.slot] = req.adapter
        decode = DecodeRows(tokens, positions, table, adapter)
        if plan.prefill is not None:
            req = plan.prefill
            tokens = np.zeros((1, plan.bucket), np.int32)
            tokens[0, :plan.chunk] = req.tokens[plan.start:plan.start + plan.chunk]
            prefill = PrefillChunk(tokens, np.asarray([plan.start], np.int32),
                                   self.page_table[req.slot, None, :plan.chunk_width].copy(),
                                   np.asarray([plan.chunk - 1], np.int32),
                                   np.asarray([req.slot], np.int32) if slot else None,
                                   np.asarray([req.adapter], np.int32) if adapters else None)
        rows, sampler = _row_sampling(self._row_requests(plan), vocab_size)
        return decode, prefill, rows, sampler

    def grammar_masks(self, plan: StepPlan, vocab_size: int) -> np.ndarray | None:
        """The [R, ceil(V/32)] int32 bitmasks of the tokens the step's rows may draw (B decode
        rows, then the chunk's): each grammar row's from its matcher, every token for the
        others; None when no row has a grammar (``inputs``' sampling leaves them out, so the
        engine can compute them while the device runs the step's forward)."""
        reqs = self._row_requests(plan)
        grammars = [i for i, req in enumerate(reqs) if req is not None and req.matcher is not None]
        if not grammars:
            return None
        allowed = np.full((len(reqs), -(-vocab_size // 32)), -1, np.int32)
        for i in grammars:
            fill_mask(reqs[i].matcher, allowed, i)
        return allowed

    def has_grammar(self, plan: StepPlan) -> bool:
        """Whether any of the step's rows draws under a grammar (structured outputs)."""
        return any(req is not None and req.matcher is not None
                   for req in self._row_requests(plan))

    def _row_requests(self, plan: StepPlan) -> list[Request | None]:
        """The request of each of the step's rows: B decode rows (None for a slot not
        decoding), then the chunk's when there is one."""
        reqs: list[Request | None] = [None] * self.num_slots
        for req in plan.decodes:
            reqs[req.slot] = req
        return reqs if plan.prefill is None else reqs + [plan.prefill, *plan.forks]

    def commit_prefill(self, plan: StepPlan, tokens: np.ndarray, logprobs: np.ndarray
                       ) -> list[tuple[Request, TokenEvent]]:
        """Applies the step's prefill chunk (the sampled tokens and log-probabilities of its
        rows, the chunk's then its forks', [1 + forks] or [1 + forks, 1 + K] with the top
        alternatives, ``step.sample_rows``): a prompt whose last chunk ran starts running with
        its first token, and so does each fork; the events to deliver."""
        req = plan.prefill
        if req is None:
            return []
        req.cached += plan.chunk
        if req.cached != req.prefill_target:
            self._name_pages(req)
            return []
        self.prefilling = None
        events = []
        for i, r in enumerate((req, *plan.forks)):
            if r is not req:
                r.cached, r.named = r.prefill_target, r.prefill_target // self.page_size
                r.prefix_hit_tokens += r.prefill_target
                self.forked += 1
            r.state = State.RUNNING
            bisect.insort(self.running, r, key=lambda x: x.id)
            events.append(self._emit(r, tokens[i], logprobs[i]))
        return events

    def commit_decodes(self, plan: StepPlan, tokens: np.ndarray, logprobs: np.ndarray
                       ) -> list[tuple[Request, TokenEvent]]:
        """Applies the step's decode rows ([B] tokens and log-probabilities by slot, or
        [B, 1 + K] with the top alternatives); the events to deliver."""
        events = []
        for req in plan.decodes:
            req.cached += 1
            events.append(self._emit(req, tokens[req.slot], logprobs[req.slot]))
        return events

    def _emit(self, req: Request, token: np.ndarray, logprob: np.ndarray
              ) -> tuple[Request, TokenEvent]:
        p = req.params
        top = None
        if np.ndim(token):  # [1 + K]: the drawn token, then the step's top alternatives
            if p.top_logprobs:
                top = tuple(zip(np.asarray(token[1:1 + p.top_logprobs]).tolist(),
                                np.asarray(logprob[1:1 + p.top_logprobs]).tolist(),
                                strict=True))
            token, logprob = token[0], logprob[0]
        token, logprob = int(token), float(logprob)
        index = req.num_new
        req.tokens.append(token)
        req.logprobs.append(logprob)
        if top is not None:
            req.top_logprobs.append(top)
        if req.matcher is not None:  # structured outputs: the grammar takes the token
            req.matcher.consume_token(token)
        if token in p.stop_token_ids:
            req.finish_reason = "stop"
        elif req.matcher is not None and req.matcher.is_stopped():  # the grammar is complete
            req.finish_reason = "stop"
        elif req.num_new >= p.max_tokens:
            req.finish_reason = "length"
        self._name_pages(req)
        if req.finish_reason is not None:
            self._release(req)
            req.state = State.FINISHED
        return req, TokenEvent(req.id, token, index, logprob if p.logprobs else None,
                               req.finish_reason, top_logprobs=top)

    def _name_pages(self, req: Request) -> None:
        """Names ``req``'s newly full pages in the prefix cache."""
        full = req.cached // self.page_size
        if full <= req.named or not self.prefix.enabled:
            return
        req.digests = page_digests(req.tokens[:full * self.page_size], self.page_size,
                                   req.digests, req.digest_root)
        for j in range(req.named, full):
            self.prefix.insert(req.digests[j], req.pages[j])
        req.named = full


def _row_sampling(reqs: list[Request | None], vocab_size: int) -> tuple[RowSampling, Sampler]:
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
        if p.top_k is not None:
            top_k[i] = p.top_k
        if p.top_p is not None:
            top_p[i] = p.top_p
        if p.min_p is not None:
            min_p[i] = p.min_p
    sampled = bool(np.any(temperature > 0))
    alternatives = any(req is not None and req.params.top_logprobs for req in reqs)
    sampler = Sampler(sampled=sampled, top_k=sampled and bool(np.any(top_k < vocab_size)),
                      top_p=sampled and bool(np.any(top_p < 1)),
                      min_p=sampled and bool(np.any(min_p > 0)),
                      top_logprobs=min(MAX_TOP_LOGPROBS, vocab_size) if alternatives else 0)
    return RowSampling(key_data, token_index, temperature, top_k, top_p, min_p), sampler
