"""Overlapping the host with the device: steady decode steps dispatched one step ahead.

In a steady decode (``Overlap.steady``: every running request decodes, none can be admitted,
nothing is in prefill) the engine dispatches step t+1 before it reads step t's tokens: t+1's
input tokens are t's sampled tokens on the device, and the host commits step t while the device
runs t+1. The tokens are the synchronous steps'. A request that finishes at step t by a stop or
a cancel already has a row in step t+1, whose token is discarded (``discarded``). See
docs/serving.md for when the engine is not steady.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from transformer_jax.decode.loop import is_split
from transformer_jax.serving.page_pool import pages_for
from transformer_jax.serving.plan import row_sampling
from transformer_jax.serving.requests import Request, State, TokenEvent
from transformer_jax.serving.step_times import StepClock


@dataclasses.dataclass
class Flight:
    """A decode step dispatched whose tokens the host has not read: its ``rows`` (each at its
    slot) and its [B] tokens and log-probs ([B, 1 + K] with top log-probs) on the device."""

    rows: list[Request]
    tokens: jax.Array
    logprobs: jax.Array


class Overlap:
    """An engine's lagged decode steps (see the module docstring); ``engine`` is the ``Engine``.

    Attributes:
      enabled: whether steady decode steps run one step ahead (``Engine(overlap=...)``).
      flight: the step dispatched and not read yet, or None.
      lagged: steps dispatched before the previous step's tokens were read.
      discarded: tokens computed for requests that had finished meanwhile, thrown away.
    """

    def __init__(self, engine: Any, enabled: bool = True) -> None:
        self.engine = engine
        self.enabled = enabled
        self.flight: Flight | None = None
        self.lagged = 0
        self.discarded = 0

    def steady(self) -> bool:
        """Whether the next decode step may be dispatched before the last one is read."""
        e = self.engine
        sched = e.scheduler
        if (not self.enabled or not sched.running or sched.prefilling or e._pending
                or (sched.waiting and None in sched.slots) or e._rings is not None
                or e.speculation.draft is not None or is_split(e.mesh)):
            return False
        if any(r.state != State.RUNNING or r.matcher is not None or r.speculation is not None
               for r in sched.running):
            return False
        return not e.multistep.steps_for()

    def step(self, clock: StepClock, delivered: list[tuple[Request, TokenEvent]]) -> bool:
        """One engine step of the lag: dispatches the next decode step when the engine is
        steady and reads the step in flight, its events added to ``delivered``. Returns whether
        the engine's step is done (else a synchronous step follows)."""
        steady = self.steady()
        if self.flight is None:
            if not steady or (first := self._dispatch(clock, None)) is None:
                return False
            self.flight = first
        flight = self.flight
        ahead = self._dispatch(clock, flight) if steady else None
        self.lagged += ahead is not None
        delivered += self._read(flight, clock, record=steady)
        if ahead is not None and all(r.state == State.FINISHED for r in ahead.rows):
            self.discarded += len(ahead.rows)  # every row finished: not worth reading
            ahead = None
        self.flight = ahead
        return steady

    def _dispatch(self, clock: StepClock, after: Flight | None) -> Flight | None:
        """Dispatches a decode step of the running requests, from ``after``'s tokens on the
        device or the host's; None when no row decodes or the pool lacks a page."""
        sched = self.engine.scheduler
        lag = int(after is not None)
        rows = [r for r in sched.running if not lag or r.num_new + 1 < r.params.max_tokens]
        need = sum(max(0, pages_for(r.cached + lag + 1, sched.page_size) - len(r.pages))
                   for r in rows)
        if not rows or need > sched.prefix.num_available:
            return None
        for req in rows:  # counted free above: no preemption
            sched._grow(req, req.cached + lag + 1, preempt=False)
        clock.lap("schedule")
        e, b = self.engine, sched.num_slots
        width = sched._width(max(len(r.pages) for r in rows))
        decode = sched.decode_rows(rows, width, e._adapters is not None, ahead=lag)
        reqs: list[Request | None] = [None] * b
        for req in rows:
            reqs[req.slot] = req
        sampling, sampler = row_sampling(reqs, e.config.vocab_size)
        if after is not None:  # the previous step's tokens, where they are
            decode = decode.replace(
                tokens=after.tokens if after.tokens.ndim == 1 else after.tokens[:, 0])
            sampling.token_index[[r.slot for r in rows]] += 1
        clock.lap("inputs")
        out = e._run(decode, None, sampling, sampler)
        clock.lap("dispatch")
        return Flight(rows, *out)

    def _read(self, flight: Flight, clock: StepClock, record: bool
              ) -> list[tuple[Request, TokenEvent]]:
        """Waits for ``flight``'s tokens and commits them (finished rows discarded); the events,
        delivered. With ``record``, the engine's step ends here."""
        e, sched = self.engine, self.engine.scheduler
        live = [r for r in flight.rows if r.state == State.RUNNING]
        self.discarded += len(flight.rows) - len(live)
        events = []
        if live:
            tokens, logprobs = clock.lap("device",
                                         jax.device_get((flight.tokens, flight.logprobs)))
            events = sched.commit_decodes(live, tokens, logprobs)
        delivered = e._deliver(events)
        if record:
            e.steps += 1
            e.step_times.record(clock)
        return delivered
