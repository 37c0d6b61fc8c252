"""Where an engine step's time goes: the host's phases and the wait for the device.

Every ``Engine`` step runs a ``StepClock``: each ``lap`` gives the time since the previous one
to a phase: ``schedule`` (queued adds and cancels, the scheduler's plan), ``inputs`` (the step's
device inputs built on the host), ``dispatch`` (the compiled programs' calls), ``device`` (the
host waiting for the step's outputs), ``commit`` (the scheduler taking the tokens) and
``deliver`` (detokenising and streaming). Host time is every phase but ``device``; on the CPU
backend ``dispatch`` holds some device work, so the host share is an upper bound.
``StepTimes`` keeps the last steps' laps for ``summary`` and running totals for a server's
gauges.
"""

from __future__ import annotations

import collections
import time
from typing import Any

import numpy as np

PHASES = ("schedule", "inputs", "dispatch", "device", "commit", "deliver")
HOST_PHASES = tuple(p for p in PHASES if p != "device")
_INDEX = {p: i for i, p in enumerate(PHASES)}

class StepClock:
    """The laps of one step: ``lap(phase)`` gives the time since the last lap (or the clock's
    start) to ``phase``."""

    __slots__ = ("last", "spans")

    def __init__(self) -> None:
        self.last = time.perf_counter()
        self.spans = [0.0] * len(PHASES)

    def lap(self, phase: str, value: Any = None) -> Any:
        """Ends a lap of ``phase``; returns ``value`` (so a call can be timed in place)."""
        now = time.perf_counter()
        self.spans[_INDEX[phase]] += now - self.last
        self.last = now
        return value


class StepTimes:
    """The laps of an engine's steps: the last ``keep`` steps', and totals since ``reset``."""

    def __init__(self, keep: int = 1 << 16) -> None:
        #: The kept steps' laps: each a list of seconds by phase (``PHASES``' order).
        self.steps: collections.deque[list[float]] = collections.deque(maxlen=keep)
        #: Whether each kept step ran a prompt chunk (the others decode only).
        self.prefill: collections.deque[bool] = collections.deque(maxlen=keep)
        self.reset()

    def reset(self) -> None:
        """Forgets every step timed so far."""
        self.steps.clear()
        self.prefill.clear()
        self.totals = [0.0] * len(PHASES)  # seconds by phase, and the steps they sum
        self.count = 0

    def record(self, clock: StepClock, prefill: bool = False) -> None:
        """Adds one finished step's laps (``prefill``: it ran a prompt chunk)."""
        self.steps.append(clock.spans)
        self.prefill.append(prefill)
        self.totals = [a + b for a, b in zip(self.totals, clock.spans, strict=True)]
        self.count += 1

    @property
    def host_share(self) -> float:
        """Host time / (host + device) over every step since ``reset`` (0 with none)."""
        host = sum(self.totals) - self.totals[_INDEX["device"]]
        total = sum(self.totals)
        return host / total if total > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        """Per step, in seconds, over the kept steps: ``phases`` {phase: {mean, median}},
        ``host`` and ``device`` {mean, median}, ``host_share`` and ``steps``; ``decode_only``:
        the same over the steps that ran no prompt chunk (None without any)."""
        return _summary(np.asarray(self.steps).reshape(-1, len(PHASES)),
                        ~np.asarray(self.prefill, bool))


def _summary(spans: np.ndarray, decode_only: np.ndarray | None) -> dict[str, Any]:
    """``StepTimes.summary`` of [steps, phases] laps (and of the ``decode_only`` ones)."""
    if not len(spans):
        return {"steps": 0, "phases": {}, "host": None, "device": None, "host_share": None,
                "decode_only": None}
    host = spans[:, [_INDEX[p] for p in HOST_PHASES]].sum(1)
    device = spans[:, _INDEX["device"]]

    def stats(x: np.ndarray) -> dict[str, float]:
        return {"mean": float(np.mean(x)), "median": float(np.median(x))}

    return {"steps": len(spans), "phases": {p: stats(spans[:, i]) for i, p in enumerate(PHASES)},
            "host": stats(host), "device": stats(device),
            "host_share": float(host.sum() / max(host.sum() + device.sum(), 1e-12)),
            "decode_only": None if decode_only is None or not decode_only.any() else
            _summary(spans[decode_only], None)}


def table(summary: dict[str, Any]) -> list[str]:
    """``summary`` as printed lines: each phase's mean/median ms per step, then host, device
    and the host share, of every step and of the decode-only ones."""
    if not summary["steps"]:
        return ["no steps timed"]
    ms = "  ".join(f"{p} {s['mean'] * 1e3:.2f}/{s['median'] * 1e3:.2f}"
                   for p, s in summary["phases"].items())
    lines = [f"per step (ms, mean/median): {ms}", f"{summary['steps']} steps: {_shares(summary)}"]
    if summary.get("decode_only"):
        only = summary["decode_only"]
        lines.append(f"{only['steps']} decode-only steps: {_shares(only)}")
    return lines


def _shares(summary: dict[str, Any]) -> str:
    host, device = summary["host"], summary["device"]
    return (f"host {host['mean'] * 1e3:.2f}/{host['median'] * 1e3:.2f} ms, device "
            f"{device['mean'] * 1e3:.2f}/{device['median'] * 1e3:.2f} ms, host share "
            f"{summary['host_share']:.3f}")
