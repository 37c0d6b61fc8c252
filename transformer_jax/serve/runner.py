"""The engine on its own thread (``EngineRunner``), handing each step's events to the event
loop at once. A request also ends with reason ``"timeout"``, ``"abort"`` (a shutdown's grace
period over) or ``"error"`` (a step raised; the engine goes on).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Sequence

from transformer_jax.serve.metrics import Metrics
from transformer_jax.serving import Engine, SamplingParams, TokenEvent

logger = logging.getLogger(__name__)

#: The finish reason of a request ended by a shutdown (``EngineRunner.drain``).
ABORT = "abort"
#: How often a request waiting for its events checks whether the grace period is over, in s.
DRAIN_POLL_S = 0.25


@dataclasses.dataclass(eq=False)
class RequestStream:
    """A request's events as the handler reads them (``queue``: a list of events per engine
    step that concerned it, the last with its finish), and its figures."""

    request_id: int
    prompt_tokens: int
    loop: asyncio.AbstractEventLoop
    arrival: float
    deadline: float
    queue: asyncio.Queue = dataclasses.field(default_factory=asyncio.Queue)
    first_token: float | None = None
    last_token: float | None = None
    tokens: int = 0
    finish_reason: str | None = None
    timed_out: bool = False
    aborted: bool = False


class QueueFull(Exception):
    """More requests in flight than the runner admits."""


class ShuttingDown(Exception):
    """The runner is draining: it takes no new request."""


class EngineRunner:
    """Runs ``engine`` on a thread; thread-safe ``submit`` and ``cancel``.

    Args:
      engine: the engine (compiled already, or compiling on first use).
      metrics: where the runner records its figures.
      max_requests: the most requests in flight (running or waiting); more raise ``QueueFull``.
      request_timeout: seconds a request may run (then reason ``"timeout"``); None: no limit.
    """

    def __init__(self, engine: Engine, metrics: Metrics, max_requests: int,
                 request_timeout: float | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_requests = max_requests
        self.request_timeout = request_timeout
        self.ready = False
        self.draining = False
        #: ``time.perf_counter()`` from which the requests in flight are aborted (``drain``).
        self.abort_at = math.inf
        self._streams: dict[int, RequestStream] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._streams)

    def submit(self, prompt: Sequence[int], params: SamplingParams) -> RequestStream:
        """Queues a request; its stream belongs to the running event loop.

        Raises:
          QueueFull: ``max_requests`` are in flight already.
          ShuttingDown: the runner is draining.
          ValueError: the engine refused the request (``Engine.add_request``).
        """
        loop = asyncio.get_running_loop()
        now = time.perf_counter()
        with self._lock:
            if self.draining:
                raise ShuttingDown("the server is shutting down")
            if len(self._streams) >= self.max_requests:
                raise QueueFull(f"{len(self._streams)} requests in flight, the most this "
                                f"server admits (--max-requests {self.max_requests})")
            rid = self.engine.add_request(prompt, params)
            timeout = self.request_timeout
            stream = RequestStream(rid, len(prompt), loop, now,
                                   now + timeout if timeout else math.inf)
            self._streams[rid] = stream
        self.metrics.prompt_tokens.inc(len(prompt))
        self._wake.set()
        return stream

    async def next_events(self, stream: RequestStream, timeout: float | None = None
                          ) -> list[TokenEvent]:
        """The stream's next events; once the shutdown's grace period is over (``drain``), a
        request the engine has not ended is ended here, reason ``"abort"``.

        Raises:
          TimeoutError: no events came within ``timeout`` seconds.
        """
        end = math.inf if timeout is None else time.perf_counter() + timeout
        while True:
            if not stream.queue.empty():
                return stream.queue.get_nowait()
            now = time.perf_counter()
            if now >= self.abort_at:
                with self._lock:
                    ended = stream.finish_reason is not None  # its last events are coming
                    stream.aborted = True
                if not ended:
                    self.engine.cancel(stream.request_id)
                    self._wake.set()
                    return [TokenEvent(stream.request_id, None, stream.tokens,
                                       finish_reason=ABORT)]
                wait = DRAIN_POLL_S
            elif now >= end:
                raise TimeoutError
            else:
                wait = min(end - now, self.abort_at - now, DRAIN_POLL_S)
            try:
                return await asyncio.wait_for(stream.queue.get(), wait)
            except TimeoutError:
                continue

    def cancel(self, stream: RequestStream) -> None:
        """Ends a request that is still running (its client went away)."""
        if stream.finish_reason is None:
            self.engine.cancel(stream.request_id)
            self._wake.set()

    def drain(self, grace: float) -> None:
        """Takes no new request from now on, and aborts those still in flight ``grace`` seconds
        from now (reason ``"abort"``); thread-safe, and a second call extends nothing."""
        with self._lock:
            self.draining = True
            self.abort_at = min(self.abort_at, time.perf_counter() + max(0.0, grace))
            in_flight = len(self._streams)
        if in_flight:
            logger.info("draining: %d requests in flight, aborted in %.1f s unless done",
                        in_flight, max(0.0, grace))
        self._wake.set()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancels what is still in flight and ends the thread."""
        with self._lock:
            for stream in self._streams.values():
                self.engine.cancel(stream.request_id)
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            if self.engine.idle:
                if self._stop:
                    return
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                self._expire()
                try:
                    events = self.engine.step()
                except Exception:  # a failed step must not end the server
                    logger.exception("engine step failed; ending the requests in flight")
                    events = self._fail_all()
                self._deliver(events)
            except Exception:  # nor a failed hand-over
                logger.exception("the engine thread's iteration failed; going on")

    def _expire(self) -> None:
        now = time.perf_counter()
        with self._lock:
            cut = [s for s in self._streams.values() if not s.aborted and now >= self.abort_at]
            for stream in cut:
                stream.aborted = True
            late = [s for s in self._streams.values()
                    if s.deadline < now and not s.timed_out and not s.aborted]
            for stream in late:
                stream.timed_out = True
        if cut:
            logger.info("aborting %d requests still in flight (the grace period is over)",
                        len(cut))
        for stream in cut + late:
            self.engine.cancel(stream.request_id)

    def _fail_all(self) -> list[TokenEvent]:
        with self._lock:
            streams = list(self._streams.values())
        for stream in streams:
            self.engine.cancel(stream.request_id)
        self.engine.step()  # applies the cancels (no compiled step runs: nothing is left)
        return [TokenEvent(s.request_id, None, s.tokens, finish_reason="error")
                for s in streams]

    def _deliver(self, events: list[TokenEvent]) -> None:
        now = time.perf_counter()
        by_stream: dict[RequestStream, list[TokenEvent]] = {}
        with self._lock:
            for event in events:
                stream = self._streams.get(event.request_id)
                if stream is None:
                    continue
                if event.finish_reason is not None:
                    if stream.finish_reason is not None:
                        continue  # already ended (a failed step)
                    del self._streams[event.request_id]
                    if event.finish_reason == "cancelled" and (stream.aborted or
                                                                stream.timed_out):
                        event = dataclasses.replace(
                            event, finish_reason=ABORT if stream.aborted else "timeout")
                    stream.finish_reason = event.finish_reason
                by_stream.setdefault(stream, []).append(event)
        for stream, got in by_stream.items():
            self._record(stream, got, now)
            try:  # one item per token (a multi-step round brings several): one chunk each
                for event in got:
                    stream.loop.call_soon_threadsafe(stream.queue.put_nowait, [event])
            except RuntimeError:  # its event loop has closed: nobody is reading
                pass
        self.metrics.observe_engine(self.engine, self.in_flight)

    def _record(self, stream: RequestStream, events: list[TokenEvent], now: float) -> None:
        m = self.metrics
        new = sum(e.token is not None for e in events)
        if new:
            if stream.first_token is None:
                m.ttft.observe(now - stream.arrival)
            else:
                m.per_token.observe((now - stream.last_token) / new)
            stream.first_token = stream.first_token or now
            stream.last_token = now
            stream.tokens += new
            m.generation_tokens.inc(new)
        if stream.finish_reason is not None:
            m.finished.labels(stream.finish_reason).inc()
            m.e2e.observe(now - stream.arrival)
