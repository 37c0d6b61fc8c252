"""The engine's host-side scheduler: slots, pages, chunked prefill and preemption.

Each step it plans (``schedule``):

1. a decode row for every running request, oldest first; one that finds no page preempts the
   newest request holding pages (itself included), which is queued again and recomputed later;
2. within the token budget, prompt chunks: the next chunk of each prompt in prefill, then of the
   oldest waiting requests while a slot is free and the pool has pages for the whole prompt
   (after the prefix cache's shared pages). The chunks run as one [R, C] batch, R padded to a
   power of two and C to the longest chunk's bucket, while R C stays within the budget;
3. with the last chunk of a prompt, the forks: waiting requests with the very same tokens share
   its full pages, get a copy of its last, partial page, and draw their first token from the
   same logits with their own key.

Then ``commit_prefill`` and ``commit_decodes`` take the step's tokens, release finished requests
and name full pages in the prefix cache. Everything here is host-side Python and numpy.
"""

from __future__ import annotations

import bisect
import functools
import logging

import numpy as np

from transformer_jax.decode.constrained import fill_masks
from transformer_jax.serving.page_pool import NULL_PAGE, PagePool, pages_for
from transformer_jax.serving.plan import (
    Chunk,
    StepPlan,
    chunk_buckets,
    row_bucket,
    row_sampling,
)
from transformer_jax.serving.prefix_cache import PrefixCache, page_digests
from transformer_jax.serving.requests import Request, State, TokenEvent
from transformer_jax.serving.step import DecodeRows, PrefillChunk, RowSampling, Sampler

logger = logging.getLogger(__name__)

#: The narrowest page table a step runs at by default, in positions (see ``Scheduler``).
MIN_CONTEXT = 128


class Scheduler:
    """Slots, the page pool and the queues of an engine (see the module docstring).

    Args:
      num_slots, num_pages, page_size: as ``Engine``'s.
      max_len: the most positions of one sequence (the model's context).
      max_chunk: the most prefill tokens per step.
      prefix_caching: whether full pages are shared between requests.
      forks: whether waiting requests with a prompt's very tokens fork from it (off for
        models whose local layers keep per-slot rings).
      max_prefill_rows: the most prompt chunks one step runs (None: as many as the budget
        holds).
      min_context: the narrowest page table a step runs at, in positions (W: the smallest
        power-of-two width from this that holds the step's longest row).
    """

    def __init__(self, num_slots: int, num_pages: int, page_size: int, max_len: int,
                 max_chunk: int, prefix_caching: bool = True,
                 min_context: int = MIN_CONTEXT, forks: bool = True,
                 max_prefill_rows: int | None = None) -> None:
        self.num_slots = num_slots
        self.forks = forks
        self.max_prefill_rows = max_prefill_rows
        self.page_size = page_size
        self.pages_per_seq = pages_for(max_len, page_size)
        self.buckets = chunk_buckets(max_chunk)
        self.widths = chunk_buckets(self.pages_per_seq,  # page-table widths
                                    pages_for(min(min_context, max_len), page_size))
        self.pool = PagePool(num_pages)
        self.prefix = PrefixCache(self.pool, enabled=prefix_caching)
        self.page_table = np.full((num_slots, self.pages_per_seq), NULL_PAGE, np.int32)
        self.slots: list[Request | None] = [None] * num_slots
        self.waiting: list[Request] = []  # by id (arrival order), preempted ones included
        self.running: list[Request] = []  # by id
        self.prefilling: list[Request] = []  # in admission order
        self.preemptions = 0
        self.forked = 0  # requests that drew their first token from another's prefill
        self._twins: dict[tuple, list[Request]] | None = None  # ``_fork``'s index of a step

    # Queues ----------------------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.running or self.prefilling)

    def check_no_leaks(self) -> None:
        """Raises AssertionError unless every page is free or parked and no slot is taken."""
        held, free = self.pool.held(), self.prefix.num_available
        if held or free != self.pool.capacity or any(s is not None for s in self.slots):
            raise AssertionError(f"pages leaked: held {held}, {free} of "
                                 f"{self.pool.capacity} available, slots {self.slots}")

    def describe(self) -> str:
        """One line of the queues and the pool, for logs and errors."""
        return (f"{len(self.waiting)} waiting, {len(self.running)} running, prefilling "
                f"{[r.id for r in self.prefilling]}, "
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
        plan, self._twins = StepPlan(decodes), None
        for req in list(self.prefilling):
            self._add_chunk(plan, req)
        while self._fits(plan, self.buckets[-1] if not self.waiting else
                         min(len(self.waiting[0].tokens), self.buckets[-1])):
            req = self._admit()
            if req is None or not self._add_chunk(plan, req):
                break
        if not plan.decodes and not plan.chunks:
            return None
        if plan.decodes:
            plan.width = self._width(max(len(r.pages) for r in plan.decodes))
        if plan.chunks:
            plan.rows = row_bucket(len(plan.chunks))
            plan.bucket = self._bucket(max(c.length for c in plan.chunks))
            plan.chunk_width = self._width(max(len(c.req.pages) for c in plan.chunks))
        return plan

    def _bucket(self, length: int) -> int:
        """The smallest chunk bucket that holds ``length`` tokens."""
        return self.buckets[bisect.bisect_left(self.buckets, length)]

    def _fits(self, plan: StepPlan, length: int) -> bool:
        """Whether a chunk of ``length`` tokens joins ``plan``'s within the budget."""
        n = len(plan.chunks) + 1
        if self.max_prefill_rows is not None and n > self.max_prefill_rows:
            return False
        longest = max([length, *(c.length for c in plan.chunks)])
        return row_bucket(n) * self._bucket(longest) <= self.buckets[-1]

    def _owed(self, before: Request | None = None) -> int:
        """Pages the prompts in prefill (admitted before ``before``, when given) still need."""
        n = len(self.prefilling) if before is None else self.prefilling.index(before)
        return sum(max(0, pages_for(r.prefill_target, self.page_size) - len(r.pages))
                   for r in self.prefilling[:n])

    def _add_chunk(self, plan: StepPlan, req: Request) -> bool:
        """Adds the next chunk of ``req`` to ``plan`` (with its last chunk, its forks) when it
        fits the budget and pages not owed to older prompts; whether it was added."""
        chunk = min(req.prefill_target - req.cached, self.buckets[-1])
        have = len(req.pages) + self.prefix.num_available - self._owed(before=req)
        chunk = min(chunk, have * self.page_size - req.cached)
        if chunk <= 0 or not self._fits(plan, chunk):
            return False
        if not self._grow(req, req.cached + chunk, preempt=False):
            return False
        plan.chunks.append(Chunk(req, req.cached, chunk))
        if self.forks and req.cached + chunk == req.prefill_target:
            self._fork(plan, plan.chunks[-1])
        return True

    def _width(self, pages: int) -> int:
        """The narrowest page-table width bucket that holds ``pages``."""
        return self.widths[bisect.bisect_left(self.widths, pages)]

    def _admit(self) -> Request | None:
        """The oldest waiting request, given a free slot and its prefix pages, when the pool
        can hold its whole prompt; else None (also when it will fork from a prompt in prefill)."""
        if not self.waiting or None not in self.slots:
            return None
        req = self.waiting[0]
        target = len(req.tokens)
        if self.forks and any(r.prefill_target == target and r.adapter == req.adapter
                              and r.tokens[:target] == req.tokens for r in self.prefilling):
            return None
        req.digests = page_digests(req.tokens, self.page_size, req.digests, req.digest_root)
        # The prompt's last token is always computed: its logits give the next token.
        shared = self.prefix.match(req.digests[:(target - 1) // self.page_size])
        if (pages_for(target, self.page_size) - len(shared)
                > self.prefix.num_available - self._owed()):
            self.prefix.release(shared)
            return None
        self.waiting.pop(0)
        self._seat(req, target, list(shared))
        req.cached, req.named = len(shared) * self.page_size, len(shared)
        req.prefix_hit_tokens += req.cached
        self.prefilling.append(req)
        return req

    def _seat(self, req: Request, target: int, pages: list[int]) -> None:
        """Puts ``req`` on a free slot with ``pages``, to prefill ``target`` tokens."""
        slot = self.slots.index(None)
        self.slots[slot] = req
        req.slot, req.state, req.prefill_target, req.pages = slot, State.PREFILL, target, pages
        self.page_table[slot, :len(pages)] = pages

    def _fork(self, plan: StepPlan, chunk: Chunk) -> None:
        """Admits, as ``chunk.forks``, the waiting requests whose tokens (and adapter) are the
        chunk's prompt's, while slots and pages last: each shares its full pages and gets a
        fresh page for its last, partial one (copied per ``plan.copies``)."""
        leader = chunk.req
        target = leader.prefill_target
        full = target // self.page_size
        owed, taken = self._owed(), set()
        if self._twins is None:  # the waiting requests by (adapter, tokens), once a step
            self._twins = {}
            for req in self.waiting:
                self._twins.setdefault((req.adapter, tuple(req.tokens)), []).append(req)
        for req in self._twins.get((leader.adapter, tuple(leader.tokens[:target])), []):
            if None not in self.slots:
                break
            if req.state != State.WAITING:  # admitted or forked since
                continue
            fresh: list[int] = []
            if full < len(leader.pages):  # the partial page: a copy of its own
                fresh = ((self.prefix.allocate(1) or []) if self.prefix.num_available > owed
                         else [])
                if not fresh:
                    break
                plan.copies.append((leader.pages[full], fresh[0]))
            for page in leader.pages[:full]:
                self.pool.share(page)
            taken.add(req.id)
            self._seat(req, target, leader.pages[:full] + fresh)
            req.cached, req.named, req.digests = 0, 0, list(leader.digests)
            chunk.forks.append(req)
        if taken:
            self.waiting = [r for r in self.waiting if r.id not in taken]

    def _grow(self, req: Request, length: int, *, preempt: bool) -> bool:
        """Gives ``req`` pages for ``length`` positions (with ``preempt``, preempting the newest
        page holder while short); False when ``req`` itself went or the pages are not there."""
        need = pages_for(length, self.page_size) - len(req.pages)
        while need > 0:
            pages = self.prefix.allocate(need)
            if pages is not None:
                self.page_table[req.slot, len(req.pages):len(req.pages) + need] = pages
                req.pages += pages
                return True
            if not preempt:
                return False
            victim = max((r for r in (*self.running, *self.prefilling) if r.pages),
                         key=lambda r: r.id, default=req)
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
        if req in self.prefilling:
            self.prefilling.remove(req)
        if req in self.running:
            self.running.remove(req)
        if req.slot is not None:
            self.page_table[req.slot] = NULL_PAGE
            self.slots[req.slot] = None
            req.slot = None

    # Step inputs and results -----------------------------------------------------------------

    def inputs(self, plan: StepPlan, vocab_size: int, slot: bool = False, adapters: bool = False
               ) -> tuple[DecodeRows, PrefillChunk | None, RowSampling, Sampler]:
        """The step's numpy inputs for ``plan``: a decode row per slot, and the chunks' [R, C]
        rows when there are any (with ``slot``, each row's ring row; with ``adapters``, each
        row's LoRA adapter, 0 for idle rows)."""
        prefill = None
        decode = self.decode_rows(plan.decodes, plan.width, adapters)
        if plan.chunks:
            r = plan.rows
            tokens = np.zeros((r, plan.bucket), np.int32)
            start, last, slots, ids = (np.zeros(r, np.int32) for _ in range(4))
            table = np.full((r, plan.chunk_width), NULL_PAGE, np.int32)
            for i, c in enumerate(plan.chunks):
                tokens[i, :c.length] = c.req.tokens[c.start:c.start + c.length]
                start[i], last[i], slots[i], ids[i] = c.start, c.length - 1, c.req.slot, \
                    c.req.adapter
                table[i] = self.page_table[c.req.slot, :plan.chunk_width]
            prefill = PrefillChunk(tokens, start, table, last, slots if slot else None,
                                   ids if adapters else None)
        rows, sampler = row_sampling(self._row_requests(plan), vocab_size)
        return decode, prefill, rows, sampler

    def decode_rows(self, reqs: list[Request], width: int, adapters: bool = False,
                    ahead: int = 0) -> DecodeRows:
        """The decode rows of ``reqs`` (each at its slot, fed its last token at its cached length
        plus ``ahead``) through a page table ``width`` wide; idle slots write into the null
        page. With ``adapters``, each row's LoRA adapter (0 for idle rows)."""
        b = self.num_slots
        tokens, positions = np.zeros(b, np.int32), np.zeros(b, np.int32)
        table = np.full((b, width), NULL_PAGE, np.int32)
        adapter = np.zeros(b, np.int32) if adapters else None
        for req in reqs:
            tokens[req.slot], positions[req.slot] = req.tokens[-1], req.cached + ahead
            table[req.slot] = self.page_table[req.slot, :width]
            if adapter is not None:
                adapter[req.slot] = req.adapter
        return DecodeRows(tokens, positions, table, adapter)

    def sources(self, plan: StepPlan) -> np.ndarray:
        """[``plan.sample_rows``] int32: the chunk row each sampling row draws from (row 0
        past the drawing requests)."""
        rows = plan.drawing()[1]
        return np.asarray(rows + [0] * (plan.sample_rows - len(rows)), np.int32)

    def chunk_shapes(self) -> list[tuple[int, int]]:
        """The (rows, bucket) shapes a step's chunks can take (``_fits``)."""
        most = row_bucket(self.max_prefill_rows or self.buckets[-1])
        return [(1 << j, c) for c in self.buckets for j in range(most.bit_length())
                if (1 << j) * c <= self.buckets[-1]]

    def idle_inputs(self, slot: bool, adapters: bool
                    ) -> list[tuple[DecodeRows | None, PrefillChunk | None]]:
        """Inputs of every step shape on idle rows (decode rows and ``chunk_shapes``) at every
        page-table width (``slot`` and ``adapters`` as ``inputs``')."""
        b = self.num_slots
        zeros = functools.partial(np.zeros, dtype=np.int32)
        out: list[tuple[DecodeRows | None, PrefillChunk | None]] = []
        for w in self.widths:
            out.append((DecodeRows(zeros(b), zeros(b), zeros((b, w)),
                                   zeros(b) if adapters else None), None))
            out += [(None, PrefillChunk(zeros((r, c)), zeros(r), zeros((r, w)), zeros(r),
                                        zeros(r) if slot else None, zeros(r) if adapters else None))
                    for r, c in self.chunk_shapes()]
        return out

    def grammar_masks(self, plan: StepPlan, vocab_size: int) -> np.ndarray | None:
        """The [R, ceil(V/32)] int32 bitmasks of the tokens the step's rows may draw (every
        token for a row without a grammar); None when no row has a grammar."""
        matchers = [None if req is None else req.matcher for req in self._row_requests(plan)]
        if all(m is None for m in matchers):
            return None
        return fill_masks(matchers, vocab_size)

    def has_grammar(self, plan: StepPlan) -> bool:
        """Whether any of the step's rows draws under a grammar (structured outputs)."""
        return any(req is not None and req.matcher is not None
                   for req in self._row_requests(plan))

    def _row_requests(self, plan: StepPlan) -> list[Request | None]:
        """The request of each sampling row: B decode rows, then ``plan.sample_rows`` chunk
        rows (``StepPlan.drawing``); None for an idle row."""
        reqs: list[Request | None] = [None] * self.num_slots
        for req in plan.decodes:
            reqs[req.slot] = req
        if not plan.chunks:
            return reqs
        drawing = plan.drawing()[0]
        return reqs + drawing + [None] * (plan.sample_rows - len(drawing))

    def commit_prefill(self, plan: StepPlan, tokens: np.ndarray, logprobs: np.ndarray
                       ) -> list[tuple[Request, TokenEvent]]:
        """Applies the step's prompt chunks (tokens and log-probabilities in
        ``StepPlan.drawing``'s order, [n] or [n, 1 + K]): a prompt whose last chunk ran starts
        running with its first token, and so does each fork; the events to deliver."""
        events = []
        i = 0
        for c in plan.chunks:
            req = c.req
            req.cached += c.length
            if req.cached != req.prefill_target:
                self._name_pages(req)
                i += 1
                continue
            self.prefilling.remove(req)
            for r in (req, *c.forks):
                if r is not req:
                    r.cached, r.named = r.prefill_target, r.prefill_target // self.page_size
                    r.prefix_hit_tokens += r.prefill_target
                    self.forked += 1
                r.state = State.RUNNING
                bisect.insort(self.running, r, key=lambda x: x.id)
                events.append(self._emit(r, tokens[i], logprobs[i]))
                i += 1
        return events

    def commit_decodes(self, reqs: list[Request], tokens: np.ndarray, logprobs: np.ndarray
                       ) -> list[tuple[Request, TokenEvent]]:
        """Applies a decode step's rows of ``reqs`` ([B] tokens and log-probabilities by slot,
        or [B, 1 + K] with the top alternatives); the events to deliver."""
        events = []
        for req in reqs:
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
        if req.matcher is not None and not req.matcher.consume_token(token):
            # a token drawn from the grammar's own mask that it refuses is the engine's fault
            logger.error("request %d: its grammar refused token %d, drawn from its own mask "
                         "(%s); the request ends with an error", req.id, token,
                         req.matcher.get_error().splitlines()[0] if req.matcher.is_error()
                         else "no error given")
            req.finish_reason = "error"
        elif token in p.stop_token_ids or (req.matcher is not None and req.matcher.is_stopped()):
            req.finish_reason = "stop"  # a stop token, or the grammar is complete
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

