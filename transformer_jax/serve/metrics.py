"""The server's Prometheus metrics (``GET /metrics``), in a registry of its own per server:
gauges the engine thread sets after every step, histograms and counters as requests go."""

from __future__ import annotations

from functools import partial
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from transformer_jax.serving.step_times import PHASES

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
            30.0, 60.0)


class Metrics:
    """One server's metrics (prefix ``transformer_jax_``)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        p = "transformer_jax_"
        gauge, counter = partial(Gauge, registry=r), partial(Counter, registry=r)
        histogram = partial(Histogram, buckets=_LATENCY, registry=r)
        self.running = gauge(p + "requests_running", "Requests holding a slot (prefill or decode)")
        self.waiting = gauge(p + "requests_waiting", "Requests queued for a slot or pages")
        self.pages_used = gauge(p + "kv_pages_used", "KV cache pages held by requests")
        self.pages_total = gauge(p + "kv_pages_total",
                                 "KV cache pages in the pool (null page excluded)")
        self.prefix_hit_rate = gauge(p + "prefix_cache_hit_rate", "Full prompt pages found in "
                                     "the prefix cache / pages looked up, since start")
        self.ttft = histogram(p + "time_to_first_token_seconds", "Arrival to first token")
        self.per_token = histogram(p + "time_per_output_token_seconds",
                                   "Time between a request's output tokens")
        self.e2e = histogram(p + "request_latency_seconds", "Arrival to last token")
        self.prompt_tokens = counter(p + "prompt_tokens", "Prompt tokens admitted")
        self.generation_tokens = counter(p + "generation_tokens", "Tokens generated")
        self.finished = counter(p + "requests_finished", "Requests ended, by finish reason",
                                ["finish_reason"])
        self.step_seconds = gauge(p + "engine_step_seconds", "Engine steps' time since start, "
                                  "by phase: the host's and the wait for the device "
                                  "(serving.step_times)", ["phase"])
        self.host_share = gauge(p + "engine_step_host_share", "Host time / (host + device) of "
                                "the engine's steps since start")
        self.speculative = {
            name: gauge(p + "speculative_" + name, help_) for name, help_ in (
                ("proposed", "Tokens proposed by speculative decoding, since start"),
                ("accepted", "Proposed tokens the target kept, since start"),
                ("acceptance_rate", "Accepted / proposed tokens, since start"),
                ("mean_accepted_length", "Tokens a speculating row gets per verification "
                 "(its own token included), since start"),
                ("verify_steps", "Engine steps that verified proposals"),
                ("backed_off_steps", "Steps run plain although rows proposed (verification "
                 "measured as not worth it)"))}

    def observe_engine(self, engine: Any, in_flight: int) -> None:
        """Sets the gauges from the engine's scheduler (called on the engine thread)."""
        sched = engine.scheduler
        running = len(sched.running) + len(sched.prefilling)
        self.running.set(running)
        self.waiting.set(max(0, in_flight - running))
        self.pages_used.set(engine.pages_in_use)
        self.pages_total.set(sched.pool.capacity)
        prefix = sched.prefix
        self.prefix_hit_rate.set(prefix.hits / prefix.queries if prefix.queries else 0.0)
        times = engine.step_times
        for phase, total in zip(PHASES, times.totals, strict=True):
            self.step_seconds.labels(phase).set(total)
        self.host_share.set(times.host_share)
        for name, value in engine.speculation.metrics().items():
            self.speculative[name].set(value)

    def text(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)
