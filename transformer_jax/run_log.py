"""What a run shows and writes while it trains: metrics checked for NaN/inf (one step late),
``metrics.jsonl``, TensorBoard events, the progress bar, and SIGTERM/SIGINT turned into a request
to checkpoint and stop."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import jax

from transformer_jax.train_config import TrainConfig

logger = logging.getLogger(__name__)

Params = dict[str, Any]
Batch = dict[str, jax.Array]
Metrics = dict[str, jax.Array]


class NonFiniteLossError(FloatingPointError):
    """The loss or gradient became NaN/inf; the run stopped without saving."""


class RunLog:
    """Collects step metrics (one step late), checks them, and writes logs.

    Writes ``metrics.jsonl`` (one JSON object per line: train records every ``log_every``
    steps, val records and samples at evaluations) and TensorBoard events under ``tb/``. On a
    resumed run, records after the restored step (written by the killed run) are dropped, so
    the file reads as if the run had never stopped.
    """

    def __init__(self, run_dir: Path, start_step: int, tc: TrainConfig, flops: float,
                 peak: float, log_train: bool, write: bool = True) -> None:
        from tensorboardX import SummaryWriter

        self.tc, self.flops, self.peak = tc, flops, peak
        # Without a progress bar, train records are logged at INFO so that progress shows.
        self._train_level = logging.INFO if log_train else logging.DEBUG
        # Only one process of a multi-host run writes the logs; the others compute the same
        # (replicated) metrics and discard them.
        self.path = run_dir / "metrics.jsonl" if write else Path(os.devnull)
        if write:
            _truncate_jsonl(self.path, start_step)
        self._file = open(self.path, "a")  # noqa: SIM115 - closed in close()
        self._tb = SummaryWriter(str(run_dir / "tb"),
                                 purge_step=start_step + 1 if start_step else None,
                                 write_to_disk=write)
        self._pending: list[tuple[int, Metrics]] = []
        self.last_loss: float | None = None
        self.train_time = 0.0
        self._timer: float | None = None
        self._interval_time = 0.0
        self._interval_steps = 0
        self._rate: float | None = None
        self._warm = False
        self.timed_steps = 0

    def push(self, step: int, metrics: Metrics) -> None:
        self._pending.append((step, metrics))

    def flush(self, keep_last: int = 0) -> None:
        while len(self._pending) > keep_last:
            step, metrics = self._pending.pop(0)
            self._record(step, {k: float(v) for k, v in jax.device_get(metrics).items()})

    def _record(self, step: int, m: dict[str, float]) -> None:
        if not (math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])):
            raise NonFiniteLossError(f"non-finite loss {m['loss']} (grad norm {m['grad_norm']}) "
                                     f"at step {step}")
        self.last_loss = m["loss"]
        if not self._warm:
            # The first step of a process runs slower (allocations, thread start-up); time
            # from its end so the rate describes the steady state.
            self._warm = True
            self._interval_time, self._interval_steps = 0.0, 0
            if self._timer is not None:
                self._timer = time.perf_counter()
        else:
            self._interval_steps += 1
        if step % self.tc.log_every == 0 or step == self.tc.steps:
            self._update_rate()
            record = {"step": step, "split": "train", **m,
                      "tokens_per_s": self._rate, "mfu": self.mfu()}
            self._write(record)
            for k in ("loss", "lr", "grad_norm"):
                self._tb.add_scalar(f"train/{k}", m[k], step)
            if self._rate:
                self._tb.add_scalar("train/tokens_per_s", self._rate, step)
            logger.log(self._train_level, "step %d: %s, lr %.3g, grad norm %.3g",
                       step, self.postfix(), m["lr"], m["grad_norm"])

    def _update_rate(self) -> None:
        now = time.perf_counter()
        elapsed = self._interval_time + (now - self._timer if self._timer is not None else 0.0)
        if elapsed > 0 and self._interval_steps:
            self._rate = self._interval_steps * self.tc.tokens_per_step / elapsed
        self.train_time += elapsed
        self.timed_steps += self._interval_steps
        self._interval_time, self._interval_steps = 0.0, 0
        if self._timer is not None:
            self._timer = now

    def start_timer(self) -> None:
        self._timer = time.perf_counter()

    def stop_timer(self) -> None:
        if self._timer is not None:
            self._interval_time += time.perf_counter() - self._timer
            self._timer = None

    def tokens_per_s(self, overall: bool = False) -> float | None:
        """Training tokens/s over the last log interval, or over the whole run."""
        if overall:
            if not self.timed_steps or not self.train_time:
                return self._rate
            return self.timed_steps * self.tc.tokens_per_step / self.train_time
        return self._rate

    def mfu(self, overall: bool = False) -> float | None:
        rate = self.tokens_per_s(overall)
        return rate * self.flops / self.peak if rate else None

    def postfix(self) -> str:
        parts = []
        if self.last_loss is not None:
            parts.append(f"loss {self.last_loss:.4f}")
        if self._rate:
            parts.append(f"{self._rate:,.0f} tok/s")
            parts.append(f"MFU {100 * self.mfu():.1f}%")
        return ", ".join(parts)

    def record_eval(self, step: int, val_loss: float) -> None:
        ppl = math.exp(val_loss) if val_loss < 700 else math.inf
        self._write({"step": step, "split": "val", "loss": val_loss, "ppl": ppl})
        self._tb.add_scalar("val/loss", val_loss, step)
        self._tb.add_scalar("val/ppl", ppl, step)
        train = f"train loss {self.last_loss:.4f}, " if self.last_loss is not None else ""
        logger.info("step %d: %sval loss %.4f, ppl %.2f", step, train, val_loss, ppl)

    def record_sample(self, step: int, text: str) -> None:
        self._write({"step": step, "split": "sample", "text": text})
        self._tb.add_text("sample", text, step)
        logger.info("sample at step %d:\n%s", step, text)

    def _write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
        self._tb.close()


def _truncate_jsonl(path: Path, last_step: int) -> None:
    """Drops the records of ``path`` with a step after ``last_step`` (atomically)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= last_step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by a kill
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def set_postfix_str(self, s: str, refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(enabled: bool, start: int, total: int) -> Any:
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True,
                smoothing=0.1)


class StopOnSignal(contextlib.AbstractContextManager):
    """Turns SIGTERM/SIGINT into a request to checkpoint and stop (``.signal`` is its name).

    A second SIGINT raises KeyboardInterrupt at once. Only active in the main thread (signal
    handlers cannot be installed elsewhere).
    """

    def __init__(self) -> None:
        self.signal: str | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        logger.warning("received %s: saving a checkpoint and stopping after this step", name)
        self.signal = name

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
