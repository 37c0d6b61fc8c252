"""Tests for transformer_jax.plot: PNGs from synthetic metrics.jsonl files, the CLI, errors."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("matplotlib")
from matplotlib.image import imread  # noqa: E402

from transformer_jax.cli import plot as plot_cli  # noqa: E402
from transformer_jax.train import plot  # noqa: E402


def write_run(run_dir: Path, steps: int = 200, scale: float = 1.0, tokens: int | None = 512,
              extra_lines: tuple[str, ...] = ()) -> Path:
    """A metrics.jsonl as training writes it: train records every 10 steps, val every 50,
    a sample record, and a line cut short by a kill."""
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for step in range(10, steps + 1, 10):
        record = {"step": step, "split": "train", "loss": scale * (4.0 * math.exp(-step / 50)
                                                                   + 1.0),
                  "z_loss": 0.0, "grad_norm": 1.0, "lr": 1e-3 * min(1.0, step / 50),
                  "tokens_per_s": 1000.0, "mfu": None}
        if tokens is not None:
            record["tokens"] = tokens
        lines.append(json.dumps(record))
        if step % 50 == 0:
            lines.append(json.dumps({"step": step, "split": "val",
                                     "loss": scale * (4.2 * math.exp(-step / 50) + 1.1),
                                     "ppl": 10.0}))
            lines.append(json.dumps({"step": step, "split": "sample", "text": "hello"}))
    lines.extend(extra_lines)
    lines.append('{"step": 999, "split": "tra')  # cut short
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run_dir


def read_png(path: Path) -> np.ndarray:
    image = imread(path)
    assert image.ndim == 3
    return image


def test_plot_run_writes_a_png_that_changes_with_the_metrics(tmp_path):
    run = write_run(tmp_path / "run")
    out = plot.plot_run(run)
    assert out == run / "loss.png"
    image = read_png(out)
    height, width = image.shape[:2]
    assert width >= 400 and height >= 300, image.shape
    assert image[..., :3].std() > 0.05  # not a blank canvas

    write_run(run, scale=3.0, tokens=None)
    again = read_png(plot.plot_run(run, tmp_path / "other.png"))
    assert again.shape == image.shape and not np.array_equal(again, image)
    assert sorted(p.name for p in run.iterdir()) == ["loss.png", "metrics.jsonl"]  # no temps


def test_missing_keys_and_odd_records_are_tolerated(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("\n".join([
        json.dumps({"step": 1, "loss": 3.0}),  # no split, no lr
        json.dumps({"step": 2, "split": "train", "loss": float("nan")}),
        json.dumps({"step": 3, "split": "train", "loss": 2.0, "val_loss": 2.5}),
        json.dumps([1, 2]), "not json", "",
    ]) + "\n")
    metrics = plot.read_metrics(run)
    assert metrics.train == [(1, 3.0), (3, 2.0)] and metrics.val == [(3, 2.5)]
    assert metrics.lr == [] and metrics.tokens_per_step is None
    assert read_png(plot.plot_run(run)).shape[1] >= 400


def test_missing_or_empty_metrics_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"no metrics.jsonl in {tmp_path / 'nope'}"):
        plot.plot_run(tmp_path / "nope")
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="holds no train or validation loss"):
        plot.plot_run(tmp_path)


def test_plot_runs_compares_several_runs(tmp_path):
    a = write_run(tmp_path / "a" / "run")
    b = write_run(tmp_path / "b" / "run", scale=1.5, tokens=1024)
    out = plot.plot_runs([a, b], tmp_path / "both.png")
    both = read_png(out)
    single = read_png(plot.plot_runs([a], tmp_path / "one.png"))
    assert not np.array_equal(both, single)


def test_cli_with_two_runs_and_a_missing_one(tmp_path, capsys, monkeypatch):
    a = write_run(tmp_path / "a")
    b = write_run(tmp_path / "b", scale=2.0)
    out = tmp_path / "cmp.png"
    # The module entry point in a process of its own, once; the other cases call the same
    # main() here (a subprocess each would only import jax again).
    cli = [sys.executable, "-m", "transformer_jax.plot"]
    done = subprocess.run([*cli, str(a), str(b), "--out", str(out)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(out)
    assert read_png(out).shape[1] >= 400
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert plot_cli.main([str(a), str(tmp_path / "c")]) == 2
    missing = capsys.readouterr()
    assert missing.out == "" and not (tmp_path / "runs.png").exists()
    assert missing.err.strip().splitlines() == [
        f"error: no metrics.jsonl in {tmp_path / 'c'} (is it the run directory of a training "
        "run?)"]
    assert plot_cli.main([str(a)]) == 0 and (a / "loss.png").is_file()
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        plot_cli.main(["--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    assert "RUN_DIR" in help_text and "--out" in help_text and "examples" in help_text


def test_plotting_leaves_pyplot_alone(tmp_path):
    import matplotlib

    backend = matplotlib.get_backend()
    plot.plot_run(write_run(tmp_path / "run"))
    assert matplotlib.get_backend() == backend
    if "matplotlib.pyplot" in sys.modules:
        assert sys.modules["matplotlib.pyplot"].get_fignums() == []
