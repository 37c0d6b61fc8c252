"""The server's Prometheus metrics (``GET /metrics``), in a registry of its own per server:
gauges the engine thread sets after every step, histograms and counters as requests go."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from transformer_jax.serving.step_times import PHASES

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
            30.0, 60.0)


class Metrics:
    """One server's metrics (prefix ``transformer_jax_``)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r, p = self.registry, "transformer_jax_"
        self.running = Gauge(p + "requests_running", "Requests holding a slot (prefill or "
                             "decode)", registry=r)
        self.waiting = Gauge(p + "requests_waiting", "Requests queued for a slot or pages",
                             registry=r)
        self.pages_used = Gauge(p + "kv_pages_used", "KV cache pages held by requests",
                                registry=r)
        self.pages_total = Gauge(p + "kv_pages_total", "KV cache pages in the pool (null page "
                                 "excluded)", registry=r)
        self.prefix_hit_rate = Gauge(p + "prefix_cache_hit_rate", "Full prompt pages found in "
                                     "the prefix cache / pages looked up, since start",
                                     registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Arrival to first token",
                              buckets=_LATENCY, registry=r)
        self.per_token = Histogram(p + "time_per_output_token_seconds", "Time between a "
                                   "request's output tokens", buckets=_LATENCY, registry=r)
        self.e2e = Histogram(p + "request_latency_seconds", "Arrival to last token",
                             buckets=_LATENCY, registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated",
                                         registry=r)
        self.finished = Counter(p + "requests_finished", "Requests ended, by finish reason",
                                ["finish_reason"], registry=r)
        self.step_seconds = Gauge(p + "engine_step_seconds", "Engine steps' time since start, "
                                  "by phase: the host's and the wait for the device "
                                  "(serving.step_times)", ["phase"], registry=r)
        self.host_share = Gauge(p + "engine_step_host_share", "Host time / (host + device) of "
                                "the engine's steps since start", registry=r)
        self.speculative = {
            name: Gauge(p + "speculative_" + name, help_, registry=r) for name, help_ in (
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
