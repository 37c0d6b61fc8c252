"""Loss curves of training runs from their ``metrics.jsonl``: ``plot_run(run_dir)`` writes
``run_dir/loss.png`` (losses, each eval set's bits per byte, the learning rate);
``plot_runs(dirs, out)`` draws several runs on one figure (matplotlib's object API, no pyplot).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformer_jax import storage
from transformer_jax.storage.files import atomic_writer

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"
# A loss curve spanning more than this ratio (max / min) is drawn on a log axis.
_LOG_SCALE_RATIO = 4.0


@dataclasses.dataclass(frozen=True)
class RunMetrics:
    """The curves of one run, each ``(step, value)`` sorted by step (the last value written).

    Attributes:
      name: the label of the run (its directory name).
      train, val, lr: the train loss, the validation loss and the learning rate.
      tokens_per_step: tokens per train step, if recorded and constant; else None.
      eval_sets: per ``train.eval_sets`` set, its bits per byte.
    """

    name: str
    train: list[tuple[int, float]]
    val: list[tuple[int, float]]
    lr: list[tuple[int, float]]
    tokens_per_step: float | None
    eval_sets: dict[str, list[tuple[int, float]]] = dataclasses.field(default_factory=dict)


def read_metrics(run_dir: str | os.PathLike[str]) -> RunMetrics:
    """The curves of a run from ``run_dir/metrics.jsonl`` (or that file itself).

    Records without ``split`` count as train records, ``val_loss`` is read as a validation loss;
    lines that are not JSON and non-finite values are skipped.

    Raises:
      FileNotFoundError: there is no metrics file.
      ValueError: the file holds no train or validation loss.
    """
    path = storage.as_path(run_dir) if storage.is_remote(run_dir) else Path(run_dir)
    if path.is_dir() or not path.name.endswith(".jsonl"):
        path = path / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {METRICS_FILE} in {path.parent} (is it the run directory "
                                "of a training run?)")
    train: dict[int, float] = {}
    val: dict[int, float] = {}
    lr: dict[int, float] = {}
    sets: dict[str, dict[int, float]] = {}
    tokens: list[float] = []
    skipped = 0
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            step = int(record["step"])
        except (ValueError, KeyError, TypeError):
            skipped += 1
            continue
        split = record.get("split", "train")
        if split == "val":
            _put(val, step, record.get("loss"))
        elif split == "eval_set":
            _put(sets.setdefault(str(record.get("name")), {}), step, record.get("bpb"))
        elif split == "train":
            _put(train, step, record.get("loss"))
            _put(lr, step, record.get("lr"))
            if _finite(record.get("tokens")) is not None:
                tokens.append(float(record["tokens"]))
        if split != "val" and "val_loss" in record:
            _put(val, step, record.get("val_loss"))
    if skipped:
        logger.debug("%s: skipped %d unreadable line(s)", path, skipped)
    if not train and not val:
        raise ValueError(f"{path} holds no train or validation loss (empty, or not written by "
                         "a training run)")
    return RunMetrics(name=path.parent.name or str(path.parent), train=sorted(train.items()),
                      val=sorted(val.items()), lr=sorted(lr.items()),
                      tokens_per_step=_constant(tokens),
                      eval_sets={k: sorted(v.items()) for k, v in sets.items() if v})


def plot_run(run_dir: str | os.PathLike[str], out: str | os.PathLike[str] | None = None) -> Path:
    """Draws the curves of ``run_dir`` into ``out`` (default ``run_dir/loss.png``); its path.
    Raises as ``read_metrics``, and OSError (one line) when ``out`` cannot be written."""
    runs = [read_metrics(run_dir)]
    target = f"{os.fspath(run_dir).rstrip('/')}/{PLOT_FILE}" if out is None else os.fspath(out)
    if storage.is_remote(target):  # drawn locally, then one upload
        local = _draw(runs, storage.staging_dir(target, "plot") / PLOT_FILE, title=runs[0].name)
        fs, inner = storage.filesystem(target)
        fs.put_file(str(local), inner)
        return storage.as_path(target)
    return _draw(runs, Path(target), title=runs[0].name)


def plot_runs(run_dirs: Sequence[str | os.PathLike[str]], out: str | os.PathLike[str]) -> Path:
    """Draws several runs on one figure (a colour per run: train loss solid, validation loss
    dashed) into the PNG ``out``; its path. Raises as ``read_metrics`` (ValueError: no run)."""
    if not run_dirs:
        raise ValueError("plot_runs needs at least one run directory")
    runs = [read_metrics(d) for d in run_dirs]
    names = [r.name for r in runs]
    if len(set(names)) < len(names):  # e.g. runs/a/run and runs/b/run: label by full path
        runs = [dataclasses.replace(r, name=str(d)) for r, d in zip(runs, run_dirs, strict=True)]
    return _draw(runs, Path(out), title=f"{len(runs)} runs" if len(runs) > 1 else runs[0].name)


def _draw(runs: list[RunMetrics], out: Path, title: str) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 7), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    with_sets = any(run.eval_sets for run in runs)
    if with_sets:
        loss_ax, bpb_ax, lr_ax = fig.subplots(3, 1, sharex=True, height_ratios=[3, 2, 1])
    else:
        loss_ax, lr_ax = fig.subplots(2, 1, sharex=True, height_ratios=[3, 1])
    several = len(runs) > 1
    for i, run in enumerate(runs):
        colour, prefix = f"C{i % 10}", f"{run.name}: " if several else ""
        if run.train:
            steps, losses = zip(*run.train, strict=True)
            loss_ax.plot(steps, losses, color=colour, lw=1.2, label=f"{prefix}train")
        if run.val:
            steps, losses = zip(*run.val, strict=True)
            loss_ax.plot(steps, losses, color=colour, lw=1.2, ls="--", marker="o", ms=4,
                         label=f"{prefix}validation")
        for k, (set_name, curve) in enumerate(sorted(run.eval_sets.items())):
            steps, bpb = zip(*curve, strict=True)
            bpb_ax.plot(steps, bpb, color=colour, lw=1.2, marker="os^vD<>"[k % 7], ms=4,
                        ls=("-", "--", ":", "-.")[k % 4], label=f"{prefix}{set_name}")
        if run.lr:
            steps, rates = zip(*run.lr, strict=True)
            lr_ax.plot(steps, rates, color=colour, lw=1.2, label=run.name if several else None)

    losses = [v for run in runs for _, v in run.train + run.val]
    if min(losses) > 0 and max(losses) / min(losses) > _LOG_SCALE_RATIO:
        loss_ax.set_yscale("log")
    loss_ax.set_ylabel("loss (nats)")
    loss_ax.set_title(title)
    loss_ax.grid(True, which="both", alpha=0.3)
    loss_ax.legend(loc="upper right", fontsize="small")

    if with_sets:
        bpb_ax.set_ylabel("bits per byte")
        bpb_ax.grid(True, alpha=0.3)
        bpb_ax.legend(loc="upper right", fontsize="small")

    # Tokens on a second axis, when every run saw the same number per step.
    per_step = {run.tokens_per_step for run in runs}
    if len(per_step) == 1 and (n := per_step.pop()) is not None and n > 0:
        top = loss_ax.secondary_xaxis("top", functions=(lambda s: s * n, lambda t: t / n))
        top.set_xlabel(f"tokens ({n:,.0f} per step)")

    if any(run.lr for run in runs):
        lr_ax.set_ylabel("learning rate")
        lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
        if several:
            lr_ax.legend(loc="upper right", fontsize="small")
    else:
        lr_ax.text(0.5, 0.5, "no learning rate recorded", ha="center", va="center",
                   transform=lr_ax.transAxes, color="gray")
    lr_ax.grid(True, alpha=0.3)
    lr_ax.set_xlabel("step")

    try:
        with atomic_writer(out) as f:
            fig.savefig(f, format="png")
    except OSError as e:  # a read-only run directory, say: one line naming the file
        raise type(e)(f"could not write {out}: {e.strerror or e}") from None
    logger.info("wrote %s", out)
    return out


def _finite(value: Any) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _put(curve: dict[int, float], step: int, value: Any) -> None:
    value = _finite(value)
    if value is not None:
        curve[step] = value


def _constant(values: list[float]) -> float | None:
    """The value if (nearly) all are the same (padding may shave a few tokens), else None."""
    if not values:
        return None
    median = statistics.median(values)
    return median if median > 0 and max(values) <= 1.05 * median else None
