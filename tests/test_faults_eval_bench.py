"""Bad arguments of ``evaluate`` and the benchmarks (``bench serve``, ``decode``, ``quant``,
``data``): each is one argparse error line (exit status 2) before any model is built, any
checkpoint read or any corpus written, and ``bench data`` removes its temporary folder on every
failure. Every command runs in this process with the loading or building functions replaced by
ones that fail the test, so nothing here compiles or loads."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import exit_and_line, must_not_run

from transformer_jax.bench import data as bench_data
from transformer_jax.bench import decode as bench_decode
from transformer_jax.bench import quant as bench_quant
from transformer_jax.bench import serve as bench_serve
from transformer_jax.checkpoint import loading
from transformer_jax.model.config import ModelConfig

MICRO = ("[model]\nvocab_size = 64\nd_model = 32\nn_layers = 1\nn_heads = 2\nd_ff = 32\n"
         "max_seq_len = 32\n")


@pytest.fixture(scope="module")
def micro_toml(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("configs") / "micro.toml"
    path.write_text(MICRO)
    return path


@pytest.fixture(scope="module")
def places(tmp_path_factory) -> SimpleNamespace:
    """Paths the bad values point at: a directory, a file, a missing path, an unwritable one,
    a port nothing listens on."""
    root = tmp_path_factory.mktemp("places")
    (root / "a_dir").mkdir()
    (root / "a_file").write_text("x")
    if os.geteuid() == 0:  # root may write to any directory, but not to sysfs
        unwritable = "/sys/transformer_jax_results.json"
    else:
        locked = root / "locked"
        locked.mkdir(mode=0o555)
        unwritable = str(locked / "results.json")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    return SimpleNamespace(dir=str(root / "a_dir"), file=str(root / "a_file"),
                           missing=str(root / "missing"), unwritable=unwritable,
                           in_file=str(root / "a_file" / "results.json"),
                           closed_url=f"http://127.0.0.1:{closed_port}")


# evaluate ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    """``tiny_mc`` (a valid task) and ``tiny_bad.yaml``, which does not parse."""
    from transformer_jax.evaluate.local_tasks import write_multiple_choice_task

    directory = tmp_path_factory.mktemp("tasks")
    write_multiple_choice_task(directory, "tiny_mc", [
        {"question": "a is", "choices": ["b", "c"], "answer": 0}])
    (directory / "tiny_bad.yaml").write_text("task: tiny_bad\ndoc_to_text: [unclosed\n")
    return directory


@pytest.fixture
def evaluate(monkeypatch, tmp_path, task_dir):
    """``evaluate``'s main on a valid command line plus the arguments given, with a model of
    max_seq_len 32 that is located but never loaded."""
    from transformer_jax.cli.evaluate import main
    from transformer_jax.evaluate import harness

    source = loading.Source(tmp_path, loading.HF, ModelConfig(vocab_size=64, max_seq_len=32))
    monkeypatch.setattr(loading, "locate", lambda *a, **k: source)
    monkeypatch.setattr(loading, "load", must_not_run("loading.load"))
    monkeypatch.setattr(harness, "JaxLM", must_not_run("JaxLM"))

    def call(capsys, *argv: str, tasks: str = "tiny_mc") -> tuple[int, str]:
        base = ["--checkpoint", str(tmp_path), "--tasks", tasks, "--include-path",
                str(task_dir), "--output", str(tmp_path / "out" / "r.json")]
        return exit_and_line(capsys, main, *base, *argv)

    return call


@pytest.mark.parametrize(("argv", "message"), [
    (["--output", "{dir}"], "{dir} is a directory"),
    (["--output", "{in_file}"], "{file} is a file, not a directory"),
    (["--output", "{unwritable}"], "{unwritable} cannot be written"),
    (["--limit", "inf"], "argument --limit: must be a count of documents"),
    (["--limit", "nan"], "argument --limit"),
    (["--limit", "0"], "argument --limit"),
    (["--limit", "2.5"], "argument --limit"),
    (["--max-length", "0"], "argument --max-length: must be an integer >= 1, got '0'"),
    (["--max-length", "33"], "--max-length 33 exceeds the model's max_seq_len 32"),
    (["--num-fewshot", "-1"], "argument --num-fewshot: must be an integer >= 0, got '-1'"),
    (["--bootstrap-iters", "-5"], "argument --bootstrap-iters: must be an integer >= 0"),
    (["--batch-size", "0"], "argument --batch-size: must be an integer >= 1"),
    (["--seed", "-1"], "argument --seed"),
    (["--mesh", "1,2"], "argument --mesh: mesh '1,2' must be three"),
    (["--tokenizer", "{missing}"], "argument --tokenizer: {missing}: no such file"),
    (["--include-path", "{missing}"], "argument --include-path: {missing}: no such directory"),
    (["--include-path", "{file}"], "argument --include-path: {file} is a file, not a directory"),
])
def test_evaluate_arguments_are_checked_before_loading(evaluate, capsys, places, argv, message):
    code, line = evaluate(capsys, *(a.format(**vars(places)) for a in argv))
    assert code == 2
    assert message.format(**vars(places)) in line, line


def test_evaluate_names_a_task_file_that_does_not_parse(evaluate, capsys, task_dir):
    code, line = evaluate(capsys, tasks="tiny_bad")
    assert code == 2
    assert f"{task_dir / 'tiny_bad.yaml'} does not parse: " in line, line
    assert "unclosed" in line or "flow sequence" in line, line  # the parser's own words


def test_evaluate_output_check_leaves_nothing_behind(evaluate, capsys, tmp_path, monkeypatch):
    """Valid arguments reach the model (here: a one-line failure) and the output check wrote
    nothing on the way, not even its directory."""
    from transformer_jax.evaluate import harness

    def refuse(*args, **kwargs):
        raise ValueError("no weights here")

    monkeypatch.setattr(harness, "JaxLM", refuse)
    code, line = evaluate(capsys)
    assert (code, line) == (1, "error: no weights here")
    assert not (tmp_path / "out").exists()


# bench serve -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("argv", "message"), [
    (["--config", "nope"], "argument --config: no config file or preset named 'nope'"),
    (["--config", "finetune"], "has no [model] table"),
    (["--requests", "0"], "argument --requests: must be an integer >= 1, got '0'"),
    (["--requests", "-3"], "argument --requests: must be an integer >= 1, got '-3'"),
    (["--input-len", "5,2"], "argument --input-len: must be MIN,MAX with 1 <= MIN <= MAX"),
    (["--input-len", "5"], "argument --input-len: must be MIN,MAX"),
    (["--output-len", "0,0"], "argument --output-len: must be MIN,MAX with 1 <= MIN"),
    (["--slots", "0"], "argument --slots: must be an integer >= 1"),
    (["--rate", "-1"], "argument --rate: must be a number > 0 (or inf), got '-1'"),
    (["--rate", "nan"], "argument --rate"),
    (["--burstiness", "0"], "argument --burstiness"),
    (["--url", "{closed_url}"], "argument --url: {closed_url}: no server accepts connections"),
    (["--url", "localhost:8000"], "argument --url: must be a URL such as"),
    (["--modes", "engine,bogus"], "--modes: unknown mode(s) 'bogus'"),
    (["--modes", "http"], "the http mode needs --url"),
    (["--slots", "4", "--token-budget", "4"], "--token-budget 4 must exceed --slots 4"),
    (["--input-len", "3,10", "--shared-prefix", "4"], "--shared-prefix 4 must be at most"),
    (["--input-len", "20,30", "--output-len", "2,4"], "exceeds the model's max_seq_len 32"),
    (["--pages", "1"], "--pages 1 cannot hold the longest request"),
    (["--json", "{dir}"], "argument --json: {dir} is a directory"),
    (["--scenario", "stall", "--long-prompt", "40"], "--long-prompt 40 + its token must fit"),
    (["--text", "{dir}"], "argument --text: {dir} is a directory, not a file"),
    (["--text", "{missing}"], "argument --text: {missing}: no such file"),
    (["--text", "{file}", "--workload", "repeat"], "--text makes the repeat workload's prompts "
     "with a checkpoint's tokenizer: it needs --workload repeat and --checkpoint"),
])
def test_bench_serve_arguments_are_one_line_errors(monkeypatch, capsys, micro_toml, places,
                                                   argv, message):
    monkeypatch.setattr(bench_serve, "init_params", must_not_run("init_params"))
    monkeypatch.setattr(bench_serve.decode, "prepare", must_not_run("decode.prepare"))
    monkeypatch.setattr(bench_serve, "Engine", must_not_run("Engine"))
    base = ["--config", str(micro_toml), "--input-len", "3,10", "--output-len", "2,4",
            "--output-multiple", "4", "--slots", "2", "--page-size", "8", "--token-budget", "18"]
    code, line = exit_and_line(capsys, bench_serve.main,
                                *base, *(a.format(**vars(places)) for a in argv))
    assert code == 2
    assert message.format(**vars(places)) in line, line


# bench decode ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("argv", "message"), [
    (["--batch", "0"], "argument --batch: must be comma-separated integers >= 1, got '0'"),
    (["--batch", ","], "argument --batch"),
    (["--batch", "1,x"], "argument --batch"),
    (["--prompt-len", "0"], "argument --prompt-len"),
    (["--cache-size", "-1"], "argument --cache-size: must be comma-separated integers >= 0"),
    (["--quant", "bogus"], "argument --quant: quant must be one of"),
    (["--quant", "int4:3"], "argument --quant"),
    (["--config", "nope"], "argument --config: no config file or preset named 'nope'"),
    (["--prompt-len", "30", "--new-tokens", "3"], "= 33 exceeds the model's max_seq_len 32"),
    (["--cache-size", "8"], "--cache-size 8 is smaller than --prompt-len + --new-tokens = 11"),
    (["--repeats", "0"], "argument --repeats"),
    (["--peak-gb-s", "0"], "argument --peak-gb-s"),
    (["--out", "{in_file}"], "argument --out/--json: {in_file}: {file} is a file"),
])
def test_bench_decode_arguments_are_one_line_errors(monkeypatch, capsys, micro_toml, places,
                                                    argv, message):
    monkeypatch.setattr(bench_decode, "init_params", must_not_run("init_params"))
    monkeypatch.setattr(bench_decode.sharding, "configure_cpu_devices",
                        must_not_run("configure_cpu_devices"))
    base = ["--config", str(micro_toml), "--batch", "2", "--prompt-len", "5", "--new-tokens",
            "6", "--tensor", "1", "--no-hf"]
    code, line = exit_and_line(capsys, bench_decode.main,
                                *base, *(a.format(**vars(places)) for a in argv))
    assert code == 2
    assert message.format(**vars(places)) in line, line


# bench quant -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """Looks like a run to the argument check (its config.json); never loaded."""
    directory = tmp_path_factory.mktemp("run")
    (directory / "config.json").write_text("{}")
    return directory


@pytest.mark.parametrize(("argv", "message"), [
    (["--run", "{missing}"], "argument --run: {missing}: no such directory"),
    (["--run", "{file}"], "argument --run: {file} is a file, not a directory"),
    (["--run", "{dir}"], "argument --run: {dir} is not a training run (no config.json)"),
    (["--quant", "int8,bogus"], "argument --quant: quant must be one of"),
    (["--quant", ","], "argument --quant"),
    (["--batch", "0"], "argument --batch"),
    (["--prompt-len", "-1"], "argument --prompt-len"),
    (["--out", "{dir}"], "argument --out: {dir} is a directory"),
])
def test_bench_quant_arguments_are_one_line_errors(monkeypatch, capsys, run_dir, places, argv,
                                                   message):
    monkeypatch.setattr(bench_quant.loading, "load", must_not_run("loading.load"))
    code, line = exit_and_line(capsys, bench_quant.main,
                                "--run", str(run_dir), *(a.format(**vars(places)) for a in argv))
    assert code == 2
    assert message.format(**vars(places)) in line, line


@pytest.mark.parametrize(("argv", "message"), [
    (["--prompt-len", "16"], "--prompt-len 16 leaves no room for a new token"),
    (["--batch", "4"], "--batch 4: the run's validation split has only 2 windows"),
])
def test_bench_quant_checks_the_run_before_compiling(monkeypatch, capsys, run_dir, argv,
                                                     message):
    loaded = SimpleNamespace(config=ModelConfig(vocab_size=64, max_seq_len=16), params={},
                             step=1)
    monkeypatch.setattr(bench_quant.loading, "load", lambda *a, **k: loaded)
    monkeypatch.setattr(bench_quant, "held_out_windows",
                        lambda *a, **k: np.zeros((2, 16), np.int32))
    monkeypatch.setattr(bench_quant.decode, "prepare", must_not_run("decode.prepare"))
    code, line = exit_and_line(capsys, bench_quant.main, "--run", str(run_dir), "--batch", "1",
                                "--prompt-len", "4", *argv)
    assert code == 2
    assert message in line, line


# bench data --------------------------------------------------------------------------------------

@pytest.fixture
def bench_tmp(monkeypatch, tmp_path) -> Path:
    """The folder ``tempfile`` makes temporary directories in, for this test alone."""
    directory = tmp_path / "tmp"
    directory.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(directory))
    return directory


@pytest.mark.parametrize(("argv", "message"), [
    (["--workers", "0"], "argument --workers: must be an integer >= 2, got '0'"),
    (["--workers", "-1"], "argument --workers"),
    (["--mb", "0"], "argument --mb: must be a finite number of MB > 0"),
    (["--mb", "inf"], "argument --mb"),
    (["--shard-mb", "nan"], "argument --shard-mb"),
    (["--shard-mb", "1e308"], "argument --shard-mb"),
    (["--tokenizer", "{missing}"], "argument --tokenizer: {missing}: no such file"),
    (["--dir", "{file}"], "argument --dir: {file} is a file, not a directory"),
])
def test_bench_data_arguments_are_checked_before_the_corpus(monkeypatch, capsys, bench_tmp,
                                                            places, argv, message):
    monkeypatch.setattr(bench_data, "make_corpus", must_not_run("make_corpus"))
    monkeypatch.setattr(bench_data.subprocess, "run", must_not_run("the build"))
    code, line = exit_and_line(capsys, bench_data.main,
                                "--mb", "0.01", *(a.format(**vars(places)) for a in argv))
    assert code == 2
    assert message.format(**vars(places)) in line, line
    assert list(bench_tmp.iterdir()) == []


def _small_corpus(directory: Path, megabytes: float) -> int:
    (directory / "part-00.jsonl").write_text('{"text": "a b c"}\n')
    return 18


@pytest.mark.parametrize("failure", ["corpus raises", "build fails", "interrupted"])
def test_bench_data_removes_its_temporary_folder_on_failure(monkeypatch, capsys, bench_tmp,
                                                           places, failure):
    made = []

    def corpus(directory: Path, megabytes: float) -> int:
        made.append(directory.parent)
        assert directory.parent.parent == bench_tmp  # the temporary folder exists by now
        if failure == "corpus raises":
            raise OSError(28, "No space left on device")
        return _small_corpus(directory, megabytes)

    def build(argv, **kwargs):
        if failure == "interrupted":
            raise KeyboardInterrupt
        return subprocess.CompletedProcess(argv, 3, "", "error: the build failed")

    monkeypatch.setattr(bench_data, "make_corpus", corpus)
    monkeypatch.setattr(bench_data.subprocess, "run", build)
    argv = ["--mb", "0.01", "--tokenizer", places.file]
    if failure == "build fails":
        assert bench_data.main(argv) == 3
        assert "the build failed" in capsys.readouterr().err
    else:
        with pytest.raises((OSError, KeyboardInterrupt)):
            bench_data.main(argv)
    assert made and list(bench_tmp.iterdir()) == []


def test_bench_data_keeps_a_given_work_dir(monkeypatch, tmp_path, places):
    monkeypatch.setattr(bench_data, "make_corpus", _small_corpus)
    monkeypatch.setattr(bench_data.subprocess, "run", lambda argv, **kw: subprocess
                        .CompletedProcess(argv, 3, "", "boom"))
    work = tmp_path / "work"
    assert bench_data.main(["--dir", str(work), "--tokenizer", places.file]) == 3
    assert (work / "corpus" / "part-00.jsonl").is_file()


def test_argument_types_accept_what_they_document():
    """The good values still parse (what the checks above refuse is only the bad ones)."""
    from transformer_jax.bench import args

    assert args.int_range("3,3") == (3, 3)
    assert args.positive_float(allow_inf=True)("inf") == float("inf")
    assert args.int_list(0)("0, 2") == [0, 2]
    assert args.quant_schemes("int8,int4:32,nf4") == ["int8", "int4:32", "nf4"]
    assert args.model_config("tiny") == "tiny"
    with pytest.raises(argparse.ArgumentTypeError, match="must be a finite number > 0"):
        args.positive_float()("inf")
    with socket.socket() as listening:  # a port something accepts connections on
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        url = f"http://127.0.0.1:{listening.getsockname()[1]}"
        assert args.server_url(url) == url
