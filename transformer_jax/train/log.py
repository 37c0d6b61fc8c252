"""What a run shows and writes while it trains: metrics checked for NaN/inf (one step late),
``metrics.jsonl``, TensorBoard events, the progress bar, the peak FLOP/s behind MFU, and
SIGTERM/SIGINT turned into a request to checkpoint and stop. Speeds are of training alone
(the timer stops during evaluation, samples and checkpoints)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax

from transformer_jax.checkpoint.files import disk_steps
from transformer_jax.checkpoint.manager import CheckpointManager
from transformer_jax.train.config import TrainConfig
from transformer_jax.train.perf import measure_matmul_peak
from transformer_jax.train.step import Metrics

logger = logging.getLogger(__name__)


class NonFiniteLossError(FloatingPointError):
    """The loss or gradient became NaN/inf; the run stopped without saving."""


# Published dense bf16 peaks of one device, TFLOP/s; the first substring of
# ``device.device_kind`` counts, so longer names come first.
PEAK_BF16_TFLOPS = (
    ("H200", 989.0), ("H100 NVL", 835.0), ("H100 PCIe", 756.0), ("H100", 989.0),
    ("A100", 312.0), ("L40S", 362.0), ("L4", 121.0),
    ("TPU v6 lite", 918.0), ("TPU v5 lite", 197.0), ("TPU v5p", 459.0), ("TPU v4", 275.0),
)


def published_peak_flops(device_kind: str) -> float | None:
    """One device's published dense bf16 peak in FLOP/s, or None for a kind not listed."""
    return next((1e12 * tflops for name, tflops in PEAK_BF16_TFLOPS if name in device_kind), None)


def mesh_peak_flops(devices: list[jax.Device], per_device: float = 0.0) -> tuple[float, str]:
    """``(FLOP/s, where the figure comes from)``: the peak of a mesh's ``devices`` together.
    ``per_device`` (``train.peak_flops``) 0: a measured matmul per host on CPU, else the
    published dense bf16 peak of the device kind (measured for a kind not listed)."""
    n = len(devices)
    if per_device:
        return per_device * n, f"train.peak_flops x {n} devices"
    device = next((d for d in devices if d.process_index == jax.process_index()), devices[0])
    if device.platform == "cpu":
        hosts = len({d.process_index for d in devices})
        return (_measured_peak(1024, "float32", device=device) * hosts,
                f"measured float32 matmul, one per host ({hosts}) shared by its devices")
    if (published := published_peak_flops(device.device_kind)) is not None:
        return published * n, f"published bf16 peak of {device.device_kind} x {n} devices"
    return (_measured_peak(4096, "bfloat16", device=device) * n,
            f"measured bf16 matmul on one {device.device_kind} x {n} devices")


# A measured matmul's FLOP/s, once per process, device, dtype and size.
_measured_peak = functools.cache(measure_matmul_peak)


def _summary_writer_class() -> type:
    """tensorboardX's ``SummaryWriter``, imported without torch and google-cloud-storage."""
    blocked = [name for name in ("torch", "google.cloud.storage") if name not in sys.modules]
    for name in blocked:
        sys.modules[name] = None  # type: ignore[assignment]  # import raises ImportError
    try:
        from tensorboardX import SummaryWriter
    finally:
        for name in blocked:
            del sys.modules[name]
    return SummaryWriter


class RunLog:
    """Collects step metrics (one step late), checks them, and writes logs.

    Writes ``metrics.jsonl`` and TensorBoard events under ``tb/`` (a resumed run drops the
    records after the restored step). ``peak`` is the mesh's FLOP/s, so ``mfu`` is per device.
    """

    def __init__(self, run_dir: Path, start_step: int, tc: TrainConfig, flops: float,
                 peak: float, log_train: bool, write: bool = True, every_step: bool = False,
                 describe: Callable[[dict[str, float]], str | None] | None = None) -> None:
        """``every_step``: a train record each step (the log line stays every ``log_every``);
        ``describe(metrics)``: a log line's text after ``step N:`` (None: loss, speed, lr...)."""
        SummaryWriter = _summary_writer_class()
        self.tc, self.flops, self.peak = tc, flops, peak
        self._every = 1 if every_step else tc.log_every
        self._describe = describe or (lambda m: None)
        self._train_level = logging.INFO if log_train else logging.DEBUG
        # Only one process of a multi-host run writes the logs.
        self.path = run_dir / "metrics.jsonl" if write else Path(os.devnull)
        if write:
            _truncate_jsonl(self.path, start_step)
        self._file = open(self.path, "a")  # noqa: SIM115 - closed in close()
        self._tb = SummaryWriter(str(run_dir / "tb"),
                                 purge_step=start_step + 1 if start_step else None,
                                 write_to_disk=write)
        self._pending: list[tuple[int, Metrics]] = []
        self.last_loss: float | None = None
        self.logged_loss: float | None = None  # of the latest record in metrics.jsonl
        self.step = start_step
        self.train_time = 0.0
        self._timer: float | None = None
        self._interval_time, self._interval_steps = 0.0, 0
        self._rate: float | None = None
        self._warm = False
        self.timed_steps = 0

    def push(self, step: int, metrics: Metrics) -> None:
        self._pending.append((step, metrics))

    def flush(self, keep_last: int = 0) -> None:
        while len(self._pending) > keep_last:
            step, metrics = self._pending.pop(0)
            values = jax.device_get(metrics)  # a dict's keys come back sorted: keep the order
            self._record(step, {k: v if isinstance(v := values[k], int) else float(v)
                                for k in metrics})

    def _record(self, step: int, m: dict[str, float]) -> None:
        if not math.isfinite(m["loss"]):
            raise NonFiniteLossError(f"non-finite loss {m['loss']} at step {step}")
        if not math.isfinite(m["grad_norm"]):
            raise NonFiniteLossError(f"non-finite gradient (grad norm {m['grad_norm']}, loss "
                                     f"{m['loss']:.4g}) at step {step}")
        self.last_loss = m["loss"]
        self.step = step
        if not self._warm:
            # The first step of a process runs slower: time from its end.
            self._warm = True
            self._interval_time, self._interval_steps = 0.0, 0
            if self._timer is not None:
                self._timer = time.perf_counter()
        else:
            self._interval_steps += 1
        if step % self._every == 0 or step == self.tc.steps:
            self._update_rate()
            self.logged_loss = m["loss"]
            self._write({"step": step, "split": "train", **m, "tokens_per_s": self._rate,
                         "mfu": self.mfu()})
            extra = (k for k in m if k.startswith(("moe_", "mtp_", "rewards/")))
            for k in ("loss", "lr", "grad_norm", *extra):
                self._tb.add_scalar(f"train/{k}", m[k], step)
            if self._rate:
                self._tb.add_scalar("train/tokens_per_s", self._rate, step)
            if (text := self._describe(m)) is None:
                logger.log(self._train_level, "step %d: %s, lr %.3g, grad norm %.3g",
                           step, self.postfix(), m["lr"], m["grad_norm"])
            elif step % self.tc.log_every == 0 or step == self.tc.steps:
                logger.log(self._train_level, "step %d: %s", step, text)

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
        """Training tokens/s over the last log interval, or over the whole run (once timed)."""
        if overall and self.timed_steps and self.train_time:
            return self.timed_steps * self.tc.tokens_per_step / self.train_time
        return self._rate

    def mfu(self, overall: bool = False) -> float | None:
        rate = self.tokens_per_s(overall)
        return rate * self.flops / self.peak if rate else None

    def steps_per_s(self) -> float | None:
        """Training steps per second over the last log interval (evaluation etc. excluded)."""
        return self._rate / self.tc.tokens_per_step if self._rate else None

    def eta_s(self) -> float | None:
        """Seconds of training left at the current training rate."""
        rate = self.steps_per_s()
        return (self.tc.steps - self.step) / rate if rate else None

    def postfix(self) -> str:
        """The loss of the latest train record, training speed, MFU and the training ETA."""
        parts = [] if self.logged_loss is None else [f"loss {self.logged_loss:.4f}"]
        if self._rate:
            parts += [f"{self.steps_per_s():.2f} step/s", f"{self._rate:,.0f} tok/s",
                      f"MFU {100 * self.mfu():.1f}%", f"ETA {_duration(self.eta_s() or 0.0)}"]
        return ", ".join(parts)

    def record_eval(self, step: int, val_loss: float, of: str = "") -> None:
        """The validation loss (``split`` ``val``); ``of``: what it is, in the log line."""
        ppl = math.exp(val_loss) if val_loss < 700 else math.inf
        self._write({"step": step, "split": "val", "loss": val_loss, "ppl": ppl})
        self._tb.add_scalar("val/loss", val_loss, step)
        self._tb.add_scalar("val/ppl", ppl, step)
        train = f"train loss {self.last_loss:.4f}, " if self.last_loss is not None else ""
        logger.info("step %d: %sval loss %.4f, ppl %.2f%s", step, train, val_loss, ppl,
                    f" ({of})" if of else "")

    def record_eval_set(self, step: int, name: str, loss: float, bpb: float) -> None:
        """One ``train.eval_sets`` set's loss (nats per token) and bits per byte."""
        self._write({"step": step, "split": "eval_set", "name": name, "loss": loss,
                     "bpb": bpb})
        self._tb.add_scalar(f"eval/{name}/loss", loss, step)
        self._tb.add_scalar(f"eval/{name}/bpb", bpb, step)
        logger.info("step %d: %s loss %.4f, %.4f bits/byte", step, name, loss, bpb)

    def record_source_eval(self, step: int, source: str, val_loss: float) -> None:
        """One mixture source's validation loss (``split`` ``val/SOURCE``)."""
        self._write({"step": step, "split": f"val/{source}", "loss": val_loss})
        self._tb.add_scalar(f"val/{source}/loss", val_loss, step)
        logger.info("step %d: val loss of %s %.4f", step, source, val_loss)

    def record_sample(self, step: int, text: str) -> None:
        self._write({"step": step, "split": "sample", "text": text})
        self._tb.add_text("sample", text, step)
        logger.info("sample at step %d:\n%s", step, text)

    def _write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def flush_events(self) -> None:
        """Writes out the TensorBoard events buffered so far."""
        self._tb.flush()

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


def _duration(seconds: float) -> str:
    minutes, sec = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{sec:02d}" if hours else f"{minutes:02d}:{sec:02d}"


def progress_bar(enabled: bool, start: int, total: int) -> Any:
    """A tqdm bar of steps without tqdm's own rate and ETA (which would count evaluation and
    checkpoints): ``RunLog.postfix`` shows the training ones."""
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True,
                disable=not enabled,
                bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} "
                           "[{elapsed}{postfix}]")


class SaveAborted(KeyboardInterrupt):
    """A third SIGTERM/SIGINT: stop at once, abandoning the save in flight (``.signal``)."""

    def __init__(self, name: str, message: str = "") -> None:
        super().__init__(message or f"aborted by a third {name}")
        self.signal = name


class StopOnSignal(contextlib.AbstractContextManager):
    """Turns SIGTERM/SIGINT into a request to checkpoint and stop (``.signal`` is its name).

    A second signal is told to wait for the save; a third raises ``SaveAborted`` at once. Keep
    it entered until the last save is on disk. Only active in the main thread.
    """

    def __init__(self) -> None:
        self.signal: str | None = None
        self.count = 0
        self._previous: dict[int, Any] = {}
        self._defer = False
        self._pending: str | None = None

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        self.count += 1
        if self.count >= 3:
            if self._defer:  # raised when the block under ``deferred`` ends
                self._pending = name
                return
            raise SaveAborted(name)
        if self.count == 2:
            logger.warning("received %s again: saving, please wait; a third signal aborts "
                           "(the earlier checkpoints are kept)", name)
            return
        logger.warning("received %s: saving a checkpoint and stopping after this step", name)
        self.signal = name

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Holds a third signal back until the block (starting an orbax save) ends."""
        self._defer = True
        try:
            yield
        finally:
            self._defer = False
        if self._pending is not None:
            raise SaveAborted(self._pending)

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()


def abandon_save(ckpt: CheckpointManager, aborted: SaveAborted) -> SaveAborted:
    """After a third signal: gives up the save in flight; the error names what is kept."""
    step = ckpt.abandon()
    kept = disk_steps(ckpt.directory)
    newest = (f"the newest checkpoint is {ckpt.step_path(kept[-1])}" if kept
              else "there is no checkpoint")
    abandoned = f": the save of step {step} was abandoned" if step is not None else ""
    return SaveAborted(aborted.signal, f"aborted by a third {aborted.signal}{abandoned}; "
                                       f"{newest}")


@dataclasses.dataclass
class RunSummary:
    """What a run did (also written to ``run_dir/summary.json``). ``time_s`` splits the wall
    time into ``run.TIME_PARTS`` (seconds; ``data``: the host's making of the train batches)."""

    run_dir: str
    start_step: int
    final_step: int
    train_loss: float | None
    val_loss: float | None
    val_ppl: float | None
    loss_unit: str
    tokens_seen: int
    wall_time_s: float
    train_time_s: float
    compile_time_s: float
    tokens_per_s: float | None
    step_time_ms: float | None
    mfu: float | None
    checkpoint: str | None
    interrupted: str | None = None
    time_s: dict[str, float] = dataclasses.field(default_factory=dict)
