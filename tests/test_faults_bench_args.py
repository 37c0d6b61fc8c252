"""Bad arguments of ``bench train``, ``choices``, ``eval``, ``qlora``, ``grpo`` and
``speculative``, and an unknown bench kind: each is one error line (exit status 2) before any
model is built, checkpoint written or run started (those functions are replaced by ones that
fail the test, so nothing here compiles or trains); the defaults still reach that work. And
``bench grpo`` stops where a run of it was stopped by SIGTERM, reporting the steps that ran."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers import exit_and_line, must_not_run

from transformer_jax.bench import __main__ as bench_main
from transformer_jax.bench import choices as bench_choices
from transformer_jax.bench import eval as bench_eval
from transformer_jax.bench import grpo as bench_grpo
from transformer_jax.bench import qlora as bench_qlora
from transformer_jax.bench import speculative as bench_speculative
from transformer_jax.bench import train as bench_train
from transformer_jax.checkpoint import loading
from transformer_jax.model import transformer
from transformer_jax.train import run as run_lib
from transformer_jax.train.log import RunSummary


@pytest.fixture
def no_work(monkeypatch):
    """Every benchmark's first expensive step replaced by ``must_not_run``."""
    for module, name in ((bench_train, "configure_cpu_devices"), (bench_train, "make_init_fn"),
                         (bench_choices, "init_params"), (bench_choices, "Engine"),
                         (bench_eval, "write_checkpoint"), (bench_qlora, "corpus"),
                         (bench_qlora, "write_checkpoint"), (bench_qlora, "finetune"),
                         (bench_grpo, "write_model"), (bench_grpo, "make_task"),
                         (transformer, "init_params"), (loading, "load"),
                         (run_lib, "run")):
        monkeypatch.setattr(module, name, must_not_run(f"{module.__name__}.{name}"))


MISSING = "/nonexistent/transformer_jax_checkpoint"


@pytest.mark.parametrize(("main", "argv", "message"), [
    (bench_train.main, ["--steps", "0"], "argument --steps: must be an integer >= 1, got '0'"),
    (bench_train.main, ["--warmup", "-1"], "argument --warmup: must be an integer >= 0"),
    (bench_train.main, ["--cpu-devices", "-2"], "argument --cpu-devices: must be an integer"),
    (bench_train.main, ["--moe-layer", "--tokens", "0"], "argument --tokens: must be an"),
    # The defaults' prompts (256, 512) do not fit tiny's 256 positions.
    (bench_choices.main, ["--config", "tiny"], "argument --prompt-lens: the longest prompt "
     r"\(512\) and --max-tokens \(1\) need 513 positions, more than tiny's max_seq_len 256"),
    (bench_choices.main, ["--rounds", "0"], "argument --rounds: must be an integer >= 1"),
    (bench_choices.main, ["--n", "9"], r"argument --n: must be <= --slots \(8\), got 9"),
    (bench_choices.main, ["--n", "1"], "argument --n: must be an integer >= 2"),
    (bench_choices.main, ["--token-budget", "8"], "argument --token-budget: must exceed"),
    (bench_choices.main, ["--prompt-lens", "0,4"], "argument --prompt-lens: must be comma"),
    (bench_choices.main, ["--config", "no_such_preset"], "argument --config: "),
    (bench_eval.main, ["--docs", "0"], "argument --docs: must be an integer >= 1, got '0'"),
    (bench_eval.main, ["--choices", "1"], "argument --choices: must be an integer >= 2"),
    (bench_eval.main, ["--heads", "3"], r"argument --heads: must divide --d-model \(256\)"),
    (bench_eval.main, ["--kv-heads", "3"], r"argument --kv-heads: must divide --heads \(8\)"),
    (bench_qlora.main, ["--rank", "0"], "argument --rank: must be an integer >= 1, got '0'"),
    (bench_qlora.main, ["--quant", "int3"], "argument --quant: .*got 'int3'"),
    (bench_qlora.main, ["--steps", "10"], "argument --steps: must be an integer >= 11"),
    (bench_qlora.main, ["--hf", MISSING], f"argument --hf: .*{MISSING} does not exist"),
    (bench_qlora.main, ["--lr", "0"], "argument --lr: must be a finite number > 0"),
    (bench_grpo.main, ["--group", "1"], "argument --group: must be an integer >= 2, got '1'"),
    (bench_grpo.main, ["--skip", "foo"], "argument --skip: must be comma-separated phases "
     "among learn, speed, got foo"),
    (bench_grpo.main, ["--skip", "learn,speeed"], "argument --skip: .*got speeed"),
    (bench_grpo.main, ["--grad-accum", "3"], r"argument --grad-accum: must divide the batch, "
     r"--prompts x --group = 256, got 3"),
    (bench_grpo.main, ["--speed-steps", "1"], "argument --speed-steps: must be an integer >= 2"),
    (bench_grpo.main, ["--width", "12"], "argument --width: must be a multiple of 8"),
    (bench_grpo.main, ["--beta", "-1"], "grpo_kl_beta must be a number >= 0"),
    (bench_speculative.main, ["--config", "tiny", "--modes", "foo"], "argument --modes: must "
     "be comma-separated modes among plain, ngram, draft, each once, got 'foo'"),
    (bench_speculative.main, ["--config", "tiny", "--modes", "plain,draft"],
     "argument --modes: the draft mode needs --draft"),
    (bench_speculative.main, ["--config", "tiny", "--draft", MISSING],
     f"argument --draft: .*{MISSING} does not exist"),
    (bench_speculative.main, ["--checkpoint", MISSING], "argument --checkpoint: "),
    (bench_speculative.main, ["--config", "tiny", "--lead", "200"],
     r"argument --lead: must be at most --passage \(160\)"),
    (bench_main.main, ["foo"], "bench: error: unknown kind 'foo'; choose from train, decode"),
])
def test_bench_arguments_are_one_line_errors_before_any_work(no_work, capsys, main, argv,
                                                             message):
    code, line = exit_and_line(capsys, main, *argv)
    assert code == 2
    assert re.search(message, line), line


@pytest.mark.parametrize(("main", "argv", "first_work"), [
    (bench_choices.main, [], "init_params"),
    (bench_qlora.main, [], "corpus"),
    (bench_grpo.main, [], "write_model"),
    (bench_grpo.main, ["--skip", "learn,speed"], "write_model"),
])
def test_bench_defaults_pass_the_checks(no_work, tmp_path, main, argv, first_work):
    """The checks refuse no valid command line: the defaults reach the first expensive step."""
    with pytest.raises(AssertionError, match=f"{first_work} ran"):
        main([*argv, *(["--dir", str(tmp_path)] if main is not bench_choices.main else [])])


def _summary(run_dir: Path, steps: int, interrupted: str | None) -> RunSummary:
    return RunSummary(run_dir=str(run_dir), start_step=0, final_step=steps, train_loss=1.0,
                      val_loss=None, val_ppl=None, loss_unit="", tokens_seen=0,
                      wall_time_s=0.0, train_time_s=0.0, compile_time_s=0.0,
                      tokens_per_s=None, step_time_ms=None, mfu=None, checkpoint=None,
                      interrupted=interrupted)


@pytest.mark.parametrize("stopped", ["SFT", "GRPO"])
def test_bench_grpo_stops_where_sigterm_stopped_a_run(monkeypatch, capsys, tmp_path, stopped):
    """A run that SIGTERM stopped (``RunSummary.interrupted``; it saved a checkpoint) ends the
    benchmark there: the steps that ran are reported, not the planned ones, no later phase
    starts, and the exit status is 143 (128 + SIGTERM)."""
    from transformer_jax.train import config as config_lib

    build_configs = config_lib.build_configs
    evaluated = []
    monkeypatch.setattr(bench_grpo, "write_model", lambda directory, args: None)
    monkeypatch.setattr(bench_grpo, "evaluate",
                        lambda *args: evaluated.append(args[0].name) or (0.25, 0.5))
    monkeypatch.setattr(bench_grpo, "logprob_gap", must_not_run("logprob_gap"))
    monkeypatch.setattr(bench_grpo, "trl_step_times", must_not_run("trl_step_times"))
    # No checkpoint to fine-tune from: the configs are built without train.init_from.
    monkeypatch.setattr(config_lib, "build_configs", lambda preset, overrides: build_configs(
        preset, [o for o in overrides if not o.startswith("train.init_from=")]))

    def run(model, tc, data, progress=True, memory_check=True):
        """3 steps of a run, then SIGTERM (for the phase ``stopped``): metrics and summary."""
        kind = "SFT" if tc.objective == "sft" else "GRPO"
        steps = 3 if kind == stopped else tc.steps
        run_dir = Path(tc.run_dir)
        run_dir.mkdir(parents=True)
        (run_dir / "metrics.jsonl").write_text("".join(
            json.dumps({"step": s, "split": "train", "loss": 1.0, "reward_mean": s / 10,
                        "time/refresh_share": 0.01}) + "\n" for s in range(1, steps + 1)))
        return _summary(run_dir, steps, "SIGTERM" if kind == stopped else None)

    monkeypatch.setattr(run_lib, "run", run)
    code = bench_grpo.main(["--dir", str(tmp_path), "--sft-steps", "20", "--steps", "600"])
    out = capsys.readouterr().out
    assert code == 143
    planned = 20 if stopped == "SFT" else 600
    assert f"{stopped} stopped by SIGTERM after 3 of {planned} steps; the benchmark stops " \
           "here" in out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["interrupted"] == "SIGTERM" and result["stopped_at_step"] == 3
    if stopped == "GRPO":
        assert evaluated == ["sft"]  # the SFT model's reward; nothing after the stop
        assert result["steps"] == 3 and result["curve"] == [0.1, 0.2, 0.3]
        assert "GRPO 600 steps" not in out
    else:
        assert evaluated == [] and "steps" not in result
