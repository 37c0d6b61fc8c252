"""Speculative decoding in the serving engine: a decode step whose rows carry proposals.

A step in which some running request speculates (``SamplingParams.speculative``) runs *verify
rows* instead of one-token decode rows: every slot feeds its last token and up to k proposals
([B, T], T = 1 + a power of two >= k); the target draws its own token at each position with the
request's key for that token index and keeps the proposals up to the first disagreement plus its
own token there (exact, greedy and sampled: ``decode.speculative``). Accepted tokens go out one
at a time, so a request ends where it would without speculation. A row is verified only while
its measured cost pays (docs/serving.md). Proposers: n-gram lookup, a draft model
(``serving.draft``) and the target's multi-token prediction module (``serving.mtp``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import logging
import statistics
import time
from typing import Any

import jax
import numpy as np

from transformer_jax.decode.loop import decode_model, is_split
from transformer_jax.decode.speculative import (
    PRIOR_TRIES,
    Acceptance,
    SpeculativeConfig,
    expected_tokens,
    ngram_proposals,
    parse_spec,
    stop_message,
    verify,
)
from transformer_jax.decode.speculative_loop import check_no_rings
from transformer_jax.model.config import ModelConfig
from transformer_jax.serving.draft import EngineDraft, same_path
from transformer_jax.serving.mtp import EngineMTP, is_mtp
from transformer_jax.serving.page_pool import NULL_PAGE, pages_for
from transformer_jax.serving.paged_cache import PagedKVCache
from transformer_jax.serving.plan import StepPlan, row_sampling
from transformer_jax.serving.requests import Request, State, TokenEvent
from transformer_jax.serving.step import RowSampling, Sampler, _adapted, sample_positions

logger = logging.getLogger(__name__)

Params = dict[str, Any]
#: Refresh a step-time measurement older than this many steps.
STALE_STEPS = 256
#: Step times kept per (width, T); their median decides.
MEASUREMENTS = 9


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class VerifyRows:
    """Each slot's last token and proposals.

    Attributes:
      tokens: [B, T] int32: the slot's last token, then its proposals (padding after).
      start: [B] int32 the position of ``tokens[:, 0]`` (the slot's cached length).
      num_drafts: [B] int32 real proposals per slot, in [0, T - 1].
      page_table: [B, W] int32 each slot's pages (``NULL_PAGE`` for an idle slot).
      adapter: [B] int32 each slot's LoRA adapter, or None.
    """

    tokens: jax.Array
    start: jax.Array
    num_drafts: jax.Array
    page_table: jax.Array
    adapter: jax.Array | None = None


def verify_step(config: ModelConfig, params: Params, k_pages: Any, v_pages: Any,
                rows: VerifyRows, sampling: RowSampling, adapters: Params | None, *,
                sampler: Sampler, view: str = "auto"
                ) -> tuple[Any, Any, jax.Array, jax.Array, jax.Array]:
    """The verify rows' forward through the paged cache, the target's draw at every position,
    and each row's accepted proposals (``speculative.verify`` with the engine's sampler).

    Args:
      config, params, k_pages, v_pages: as ``step.engine_step``'s (all T positions written).
      rows: the ``VerifyRows``.
      sampling: [B * T] rows of sampling settings, row b's T positions consecutive.
      adapters: the engine's stacked LoRA adapters, or None.
      sampler, view: static, as ``step.engine_step``'s.

    Returns:
      (key pages, value pages, [B, T] (or [B, T, 1 + K]) tokens, their log-probabilities,
      [B] int32 accepted proposals a: row b keeps tokens ``[:a + 1]``).
    """
    cache = PagedKVCache(k=k_pages, v=v_pages, page_table=rows.page_table, lengths=rows.start,
                         view=view)
    cache, tokens, logprobs, accepted = verify(
        decode_model(config), _adapted(params, adapters, rows.adapter), cache, rows.tokens,
        rows.start, rows.num_drafts,
        functools.partial(sample_positions, rows=sampling, sampler=sampler))
    return cache.k, cache.v, tokens, logprobs, accepted


def jit_verify(**jit_options: Any) -> Any:
    """``verify_step`` jitted, its pages donated."""
    return jax.jit(verify_step, static_argnames=("config", "sampler", "view"),
                   donate_argnames=("k_pages", "v_pages"), **jit_options)


verify_jit = jit_verify()


def width_of(k: int) -> int:
    """T for up to k proposals: 1 + the smallest power of two >= k."""
    return 1 + (1 << max(0, (k - 1).bit_length()))


@dataclasses.dataclass
class Pending:
    """A verify step dispatched and not yet read."""

    rows: list[Request]
    held: dict[int, int]  # request id -> pages held before the step grew them
    drafts: dict[int, int]  # request id -> proposals
    outputs: tuple[Any, ...]  # the program's: tokens, logprobs, accepted (, proposals)
    t: int
    width: int
    started: float
    sampler: Sampler


class Speculation:
    """The engine's speculation: admission, the per-step choice, the verify step, its commit."""

    def __init__(self, engine: Any, draft: Any = None) -> None:
        self.engine = engine
        #: The draft model whose pages mirror the engine's (``serving.draft``), or None.
        self.draft: EngineDraft | None = None
        if draft is not None:
            path = draft if isinstance(draft, str) else None
            if path is not None:
                from transformer_jax.checkpoint.loading import load_draft

                draft = load_draft(path)
            self.draft = EngineDraft(draft, engine, path)
        self.mtp: EngineMTP | None = None  # the module's pages (``enable_mtp``), or None
        #: (W, T, chunk ran, sampler) -> (median seconds, step measured)
        self.times: dict[tuple[int, int, bool, Sampler], tuple[float, int]] = {}
        self._recent: dict[tuple[int, int, bool, Sampler], collections.deque] = {}
        self.backed_off = 0  # steps run plain although some row could propose
        self.verify_steps = 0
        self.total = Acceptance()  # every row's verifications, over all verify steps
        self.tried = 0  # proposals verified up to the first rejection, that one included
        self._stopped = False  # whether the stop was logged

    # Requests ----------------------------------------------------------------------------------

    def admit(self, req: Request) -> None:
        """Sets up a request that asked to speculate, or raises ValueError (one line)."""
        spec: SpeculativeConfig = parse_spec(req.params.speculative)
        if spec.method == "draft":
            if self.draft is None:
                raise ValueError(f"speculative {req.params.speculative!r}: the engine has no "
                                 "draft model (Engine(draft=...), serve --speculative "
                                 "draft:PATH)")
            if self.draft.path is not None and not same_path(spec.draft, self.draft.path):
                raise ValueError(f"speculative {req.params.speculative!r}: the engine's draft "
                                 f"model is {self.draft.path!r}")
        self.check_engine()
        if spec.method == "mtp":
            self.enable_mtp()
        # a new request's prior: the engine's acceptance so far (0.5 before any)
        prior = self.total.accepted / self.tried if self.tried else 0.5
        req.speculation = (spec, Acceptance(hits=prior * PRIOR_TRIES))

    def enable_mtp(self) -> None:
        """Makes the module's pages once (thread-safe), or raises ValueError (one line)."""
        self.check_engine()
        with self.engine._lock:
            self.mtp = self.mtp or EngineMTP(self.engine)

    def prefill(self, plan: StepPlan, chunk: Any, rows: RowSampling, sampler: Sampler) -> Any:
        """Runs the step's prompt chunk, through the module when a request of it uses it."""
        if self.mtp is not None and any(is_mtp(c.req) for c in plan.chunks):
            return self.mtp.prefill(plan, chunk, rows, sampler)
        return self.engine._run(None, chunk, rows, sampler)

    def check_engine(self) -> None:
        """Raises ValueError (one line) unless the engine can speculate: one device, no rings."""
        eng = self.engine
        if is_split(eng.mesh):
            raise ValueError("speculative decoding in the engine needs one device (no "
                             "tensor-parallel mesh)")
        if eng._rings is not None:
            check_no_rings(eng.config, "the model")

    # The step ----------------------------------------------------------------------------------

    def record(self, width: int, t: int, seconds: float, chunk: bool, sampler: Sampler
               ) -> None:
        """A step's measured time (plain: t = 1), kept among the last ``MEASUREMENTS``; the
        first of each kind is dropped (it may have compiled)."""
        key = (width, t, chunk, sampler)
        if key not in self._recent:
            self._recent[key] = collections.deque(maxlen=MEASUREMENTS)
            return
        self._recent[key].append(seconds)
        self.times[key] = (statistics.median(self._recent[key]), self.engine.steps)

    def plain_step(self, plan: StepPlan, tokens: np.ndarray, seconds: float, chunk: bool,
                   sampler: Sampler) -> None:
        """After a plain step whose rows speculate: records its time and checks the watched
        proposals against its [B] tokens."""
        self.record(plan.width, 1, seconds, chunk, sampler)
        self._observe(plan.decodes, tokens)

    def _observe(self, reqs: list[Request], tokens: np.ndarray) -> None:
        """Checks each watched row's proposal against its plain step's token ([B] by slot)."""
        nxt = None
        for req in reqs:
            if req.speculation is None or not req.speculation[1].watched:
                continue
            expect = None
            if req.speculation[0].method == "draft" and self.draft is not None:
                if nxt is None:
                    nxt = np.asarray(jax.device_get(self.draft.next))
                expect = int(nxt[req.slot])
            req.speculation[1].observe(int(np.ravel(tokens[req.slot])[0]), expect)

    def _time(self, width: int, t: int, chunk: bool, sampler: Sampler) -> float | None:
        found = self.times.get((width, t, chunk, sampler))
        if found is None or self.engine.steps - found[1] > STALE_STEPS:
            return None
        return found[0]

    def dispatch(self, plan: StepPlan, rows: RowSampling, sampler: Sampler) -> Pending | None:
        """Proposes, decides, grows pages and dispatches the verify step of ``plan``'s decode
        rows; None for a plain step."""
        sched = self.engine.scheduler
        if any(r.matcher is not None for r in plan.decodes):
            return None
        if plan.chunks and any(r.speculation for r in plan.decodes):
            # prompts are waiting: verification would only take time from them
            self.backed_off += 1
            return self._verify(plan, {}, {}, rows, sampler)
        drafts: dict[int, list[int]] = {}
        lookups: dict[tuple[int, int], list[tuple[Request, int]]] = {}  # (n, min_n) -> rows
        for req in plan.decodes:
            if req.speculation is None:
                continue
            spec = req.speculation[0]
            # the target adds a token of its own to those kept
            budget = min(spec.k, req.params.max_tokens - req.num_new - 1)
            if budget > 0 and spec.method == "draft":
                drafts[req.id] = [-1] * budget  # filled by the draft below, if it runs
            elif budget > 0 and spec.method == "mtp":
                drafts.update(self.mtp.proposal(req))
            elif budget > 0:
                lookups.setdefault((spec.n, spec.min_n), []).append((req, budget))
        for (n, min_n), group in lookups.items():  # one batched lookup, not one per row
            found = ngram_proposals([r.tokens for r, _ in group], [k for _, k in group], n, min_n)
            drafts.update((r.id, d) for (r, _), d in zip(group, found, strict=True) if d)
        if not drafts:
            return self._verify(plan, {}, {}, rows, sampler)
        t, width = self._shape(plan, drafts)
        plain_s = self._time(plan.width, 1, False, sampler)
        verify_s = self._time(width, t, False, sampler)  # measured, else estimated
        if verify_s is None and plain_s is not None:
            verify_s = self._estimate(width, t, self._time(width, 1, False, sampler) or plain_s,
                                      sampler)
        if verify_s is not None:  # the cost rule (no plain step's time yet: run one)
            drafts = self._decide(plan, drafts, None if plain_s is None else verify_s / plain_s, t)
        if not drafts:
            self.backed_off += 1
            return self._verify(plan, {}, {}, rows, sampler)
        t, width = self._shape(plan, drafts)
        held = {}
        for req in plan.decodes:
            if req.id not in drafts:
                continue
            held[req.id] = len(req.pages)
            want = req.cached + 1 + len(drafts[req.id])
            if not sched._grow(req, want, preempt=False):  # keep what fits the held pages
                fit = len(req.pages) * sched.page_size - req.cached - 1
                drafts[req.id] = drafts[req.id][:max(fit, 0)]
        if any(d and d[0] < 0 for d in drafts.values()):  # the draft's, pages grown
            proposed = self.draft.propose(plan, sched, width, t)
            for req in plan.decodes:
                if drafts.get(req.id) and drafts[req.id][0] < 0:
                    drafts[req.id] = proposed[req.slot, :len(drafts[req.id])].tolist()
        return self._verify(plan, drafts, held, rows, sampler)

    def _verify(self, plan: StepPlan, drafts: dict[int, list[int]], held: dict[int, int],
                rows: RowSampling, sampler: Sampler) -> Pending | None:
        """Dispatches the verify step of ``plan``'s decode rows with ``drafts`` (T = 1 for the
        module's rows without any); None for a plain step."""
        module = self.mtp is not None and any(is_mtp(r) for r in plan.decodes)
        if not drafts and not module:
            return None
        eng, sched = self.engine, self.engine.scheduler
        t, width = self._shape(plan, drafts)
        b = sched.num_slots
        decode = sched.decode_rows(plan.decodes, width, eng._adapters is not None)
        tokens, num = np.zeros((b, t), np.int32), np.zeros(b, np.int32)
        for req in plan.decodes:
            d = drafts.get(req.id, [])
            tokens[req.slot, 0], tokens[req.slot, 1:1 + len(d)] = req.tokens[-1], d
            num[req.slot] = len(d)
        flat = jax.tree.map(lambda x: np.repeat(np.asarray(x)[:b], t, axis=0), rows)
        flat = flat.replace(token_index=flat.token_index + np.tile(np.arange(t, dtype=np.int32),
                                                                   b))
        started = time.perf_counter()
        outputs = self._program(VerifyRows(tokens, decode.positions, num, decode.page_table,
                                           decode.adapter), flat, sampler, module)
        return Pending(list(plan.decodes), held, {i: len(d) for i, d in drafts.items()},
                       outputs, t, width, started, sampler)

    def _program(self, rows: VerifyRows, sampling: RowSampling, sampler: Sampler,
                 module: bool) -> tuple[Any, ...]:
        """Runs the verify program (with ``module``, ``EngineMTP.verify``'s); its outputs."""
        if module:
            return self.mtp.verify(rows, sampling, sampler)
        eng = self.engine
        eng._k, eng._v, *out = verify_jit(eng.config, eng.weights.params, eng._k, eng._v, rows,
                                          sampling, eng._adapters, sampler=sampler, view=eng.view)
        return tuple(out)

    def compile(self, k: int) -> int:
        """Runs the verify program once on idle rows at every page-table width and T up to k
        proposals, greedy and sampled (the module's when it runs); returns the shapes run."""
        eng, sched, b = self.engine, self.engine.scheduler, self.engine.scheduler.num_slots
        ts = sorted({width_of(j) for j in range(1, k + 1)})
        shapes = list(itertools.product(sched.widths, [1, 2] if self.mtp else ts, (False, True)))
        for width, t, sampled in shapes:
            rows = VerifyRows(np.zeros((b, t), np.int32), np.zeros(b, np.int32),
                              np.zeros(b, np.int32), np.zeros((b, width), np.int32),
                              None if eng._adapters is None else np.zeros(b, np.int32))
            sampling, _ = row_sampling([None] * (b * t), eng.config.vocab_size)  # greedy
            sampling = sampling.replace(temperature=np.full(b * t, float(sampled), np.float32))
            jax.block_until_ready(self._program(rows, sampling, Sampler(sampled=sampled),
                                                self.mtp is not None))
        done = len(shapes) + (self.mtp.compile(sched) if self.mtp else 0)
        return done + (0 if self.draft is None else self.draft.compile(
            sched, ts, eng._adapters is not None))

    def _shape(self, plan: StepPlan, drafts: dict[int, list[int]]) -> tuple[int, int]:
        """The verify step's T and page-table width for these proposals."""
        sched = self.engine.scheduler
        needed = max(pages_for(r.cached + len(drafts.get(r.id, ())) + 1, sched.page_size)
                     for r in plan.decodes)
        most = max((len(d) for d in drafts.values()), default=0)  # none: the module's T = 1
        return (width_of(most) if drafts else 1, sched._width(min(needed, sched.pages_per_seq)))

    def _decide(self, plan: StepPlan, drafts: dict[int, list[int]], cost: float | None,
                t: int) -> dict[int, list[int]]:
        """The cost rule for a verify step of ``cost`` plain steps (None: no choice): each
        row's, then the step's. Returns the proposals to verify ({}: a plain step); the others
        are watched."""
        kept, gain = {}, float(len(plan.decodes) - len(drafts))
        for req in plan.decodes:
            d = drafts.get(req.id)
            if d is not None and cost is not None and req.speculation[1].decide(len(d), cost):
                kept[req.id] = d
                gain += expected_tokens(req.speculation[1].rate, len(d))
            elif d is not None:
                gain += 1.0
        if kept and gain <= cost * len(plan.decodes):
            kept = {}
        for req in plan.decodes:
            if req.id in drafts and req.id not in kept:
                d = drafts[req.id]
                req.speculation[1].watch([None] * len(d) if d[0] < 0 else d)
        if not kept and cost is not None and not self._stopped:
            self._stopped = True
            acc = next(r.speculation[1] for r in plan.decodes if r.id in drafts)
            logger.info(stop_message("serving engine", cost, t, acc.rate,
                                     expected_tokens(acc.rate, t - 1)))
        return kept

    def _estimate(self, width: int, t: int, plain: float, sampler: Sampler) -> float | None:
        """A verify time at (width, t) not measured: linear in T from another T at this width,
        else the same T's cost in plain steps at another width."""
        other_width = None
        for w, other, c, smp in sorted(self.times, key=lambda key: key[:3]):
            measured = self._time(w, other, c, smp)
            if c or smp != sampler or other == 1 or measured is None:
                continue
            if w == width:
                return plain + (measured - plain) * (t - 1) / (other - 1)
            base = self._time(w, 1, False, sampler)
            if other == t and base is not None:
                other_width = plain * measured / base
        return other_width

    def finish(self, pending: Pending, deliver: Any, chunk_ran: bool
               ) -> list[tuple[Request, TokenEvent]]:
        """Reads the verify step's results and commits each row's kept tokens one at a time
        (so stops end it where they would); returns pages grown for rejected positions."""
        tokens, logprobs, accepted, *proposals = self.engine.step_clock.lap(
            "device", jax.device_get(pending.outputs))
        self.record(pending.width, pending.t, time.perf_counter() - pending.started, chunk_ran,
                    pending.sampler)
        sched = self.engine.scheduler
        self.verify_steps += int(pending.t > 1)
        if pending.t == 1:  # the module's plain step
            self._observe(pending.rows, tokens[:, 0])
        delivered = []
        for req in pending.rows:
            a = int(accepted[req.slot])
            n = pending.drafts.get(req.id, 0)
            if req.speculation is not None and n:
                req.speculation[1].record(n, a)
                self.total.record(n, a)
                self.tried += a + (a < n)
            for j in range(a + 1):
                req.cached += 1
                delivered += deliver([sched._emit(req, tokens[req.slot, j],
                                                  logprobs[req.slot, j])])
                if req.state == State.FINISHED:
                    break
            if req.state == State.RUNNING and req.id in pending.held:
                self._trim(req, pending.held[req.id])
        if proposals:  # the module's, at each row's new length
            self.mtp.keep(pending.rows, proposals[0])
        return delivered

    def _trim(self, req: Request, held: int) -> None:
        """Returns the pages grown this step that the kept positions do not use."""
        sched = self.engine.scheduler
        keep = max(held, pages_for(req.cached, sched.page_size))
        if len(req.pages) > keep:
            sched.prefix.release(req.pages[keep:])
            sched.page_table[req.slot, keep:len(req.pages)] = NULL_PAGE
            req.pages = req.pages[:keep]

    def metrics(self) -> dict[str, float]:
        """Engine-wide figures: proposals, acceptance, verify and backed-off steps."""
        total = self.total
        return {"proposed": total.proposed, "accepted": total.accepted,
                "acceptance_rate": total.acceptance_rate,
                "mean_accepted_length": total.mean_accepted,
                "verify_steps": self.verify_steps, "backed_off_steps": self.backed_off}
