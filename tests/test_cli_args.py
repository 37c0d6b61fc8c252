"""Arguments a new user gets wrong: each is one line naming the argument, never a traceback, and
nothing is accepted silently (``python -m transformer_jax.bench memory``, ``train.py``,
``TrainConfig``)."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import numpy as np
import pytest

from transformer_jax.bench import memory as bench_memory
from transformer_jax.model.config import ModelConfig
from transformer_jax.parallel.sharding import configure_cpu_devices
from transformer_jax.train.config import ConfigError, TrainConfig, build_configs, config_help

ROOT = Path(__file__).resolve().parent.parent
from transformer_jax.cli import train  # noqa: E402  (the train command)

SMALL = ["--config", "tiny", "--mesh", "1,1,1", "--batch", "1", "--seq", "16", "--no-compile"]


def one_error_line(err: str) -> str:
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if "error: " in line]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


# bench memory ------------------------------------------------------------------------------------

@pytest.fixture
def bench(monkeypatch):
    """Runs the bench's main in this process (whose JAX backend has started, so the bench asks
    for no simulated devices); returns (exit status, the one error line)."""
    jax.devices()  # the backend exists: the bench must not change this process's flags
    monkeypatch.setenv("XLA_FLAGS", "")  # restored afterwards, whatever the bench sets

    def call(capsys, *argv: str) -> tuple[int, str]:
        try:
            code = bench_memory.main([*SMALL, *argv])
        except SystemExit as e:  # argparse's errors
            code = e.code
        return code, one_error_line(capsys.readouterr().err)

    return call


@pytest.mark.parametrize(("argv", "message"), [
    (["--seq", "0"], "--seq must be >= 1, got 0"),
    (["--seq", "-5"], "--seq must be >= 1, got -5"),
    (["--batch", "0"], "--batch must be >= 1, got 0"),
    (["--loss-chunk", "-1"], "--loss-chunk must be >= 0, got -1"),
    (["--attention", "cudnn"], "--attention cudnn is a GPU/TPU kernel"),
    (["--devices", "0"], "--devices must be >= 1, got 0"),
    (["--config", "nosuch"], "no config file or preset named 'nosuch'"),
    (["--layers", "0", "--compile-time"], "--layers must be positive depths"),
    (["--config", "finetune"], "the preset has no [model] table"),
    (["--mesh", "1,1,3"], "not divisible by mesh axis tensor=3"),
])
def test_bench_memory_arguments_are_one_line_errors(bench, capsys, argv, message):
    code, line = bench(capsys, *argv)
    assert code == 2
    assert message in line, line


# train.py ----------------------------------------------------------------------------------------

def test_help_shows_each_keys_whole_description(capsys):
    with pytest.raises(SystemExit):
        train.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert ".jsonl and text files together are an error" in text  # data.path's last sentence
    assert "empty means the model's param_dtype" in text  # the end of lora_base_dtype's


def test_config_help_keeps_every_sentence():
    text = " ".join(config_help().split())
    assert "0 disables clipping" in text  # grad_clip: "clip ...; 0 disables clipping"
    assert "The model comes from it" in text  # init_from's second sentence


@pytest.mark.parametrize(("make", "shown"), [
    (lambda: TrainConfig(steps=np.float64(5.0)), "got 5.0"),
    (lambda: TrainConfig(seed=np.int64(-3)), "got -3"),
    (lambda: ModelConfig(n_layers=np.float32(2.0)), "got 2.0"),
    (lambda: ModelConfig(remat=np.str_("some")), "got 'some'"),
])
def test_errors_print_plain_numbers(make, shown):
    with pytest.raises(ValueError) as info:
        make()
    assert shown in str(info.value) and "np." not in str(info.value)


@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
@pytest.mark.parametrize("key", ["lr", "min_lr", "weight_decay", "grad_clip", "z_loss",
                                 "peak_flops", "lora_alpha"])
def test_train_floats_must_be_finite(key, value):
    with pytest.raises(ConfigError, match=rf"\b{key} must be a finite number, got {value}$"):
        build_configs("tiny", [f"train.{key}={value}"])


def test_lora_targets_are_checked_without_adapters():
    with pytest.raises(ConfigError, match=r"lora_targets='q,zz': unknown lora target 'zz'"):
        build_configs("tiny", ["train.lora_targets=q,zz"])
    assert TrainConfig(lora_targets="q,v").lora_config is None  # valid, unused at rank 0


@pytest.mark.parametrize(("argv", "message"), [
    (["--cpu-devices", "-2"], "--cpu-devices must be >= 0"),
    (["--cpu-devices", "3"], "--cpu-devices 3: the micro-batch of 4 rows"),
])
def test_cpu_devices_are_validated(capsys, argv, message):
    try:
        code = train.main(["--no-fast-math", *argv, "train.batch_size=4"])
    except SystemExit as e:
        code = e.code
    assert code == 2
    line = one_error_line(capsys.readouterr().err)
    assert message in line, line
    if "3" in argv:
        assert "use one of [1, 2, 4]" in line


def test_bench_train_cpu_devices_are_one_line_errors(capsys):
    from transformer_jax.bench import train as bench_train

    assert bench_train.main(["--no-fast-math", "--cpu-devices", "3", "train.batch_size=4"]) == 2
    assert "use one of [1, 2, 4]" in one_error_line(capsys.readouterr().err)


def test_configure_cpu_devices_refuses_what_it_used_to_change():
    with pytest.raises(ValueError, match=">= 0"):
        configure_cpu_devices(4, -2)
    with pytest.raises(ValueError, match=re.escape("3 devices do not divide 4")):
        configure_cpu_devices(4, 3)


def test_no_memory_check_reaches_the_run(monkeypatch, capsys):
    from transformer_jax.train.run import RunSummary

    calls = []

    def fake_run(model, tc, data, **kwargs):
        calls.append(kwargs)
        return RunSummary(run_dir="r", start_step=0, final_step=1, train_loss=None,
                          val_loss=None, val_ppl=None, loss_unit="nats/token", tokens_seen=1,
                          wall_time_s=0.0, train_time_s=0.0, compile_time_s=0.0,
                          tokens_per_s=None, step_time_ms=None, mfu=None, checkpoint=None)

    monkeypatch.setattr(train, "run", fake_run)
    monkeypatch.setattr(train, "_setup_logging", lambda verbose: None)
    monkeypatch.setattr(train, "_enable_compilation_cache", lambda cache_dir: None)
    for argv, expected in ((["--no-memory-check"], False), ([], True)):
        assert train.main(["--no-fast-math", "--no-progress", *argv]) == 0
        assert calls[-1]["memory_check"] is expected
    capsys.readouterr()

