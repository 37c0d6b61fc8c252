"""Faults a new user meets while running training: signals during the shutdown save, a rerun of a
finished run, a run too big for the machine, orbax's echoes of a full disk, leftovers of an
interrupted save, and resume checks that named the wrong thing."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import os
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import FAST_XLA_FLAGS, TINY_RUN_ARGS, logged
from orbax.checkpoint._src.handlers import json_checkpoint_handler

from transformer_jax.checkpoint.manager import CheckpointError, CheckpointManager
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.ops import attention as attn
from transformer_jax.train import memory as run_memory
from transformer_jax.train import run as training
from transformer_jax.train.config import DataConfig, TrainConfig
from transformer_jax.train.log import RunLog
from transformer_jax.train.resume import check_resume

ROOT = Path(__file__).resolve().parent.parent
MODEL = ModelConfig(vocab_size=32, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64,
                    max_seq_len=32)


# Shares compiled programs between the in-process runs of this module (conftest).
pytestmark = pytest.mark.usefixtures("shared_compilation_cache")


def write_corpus(path: Path) -> Path:
    rng = np.random.default_rng(0)
    words = ["def", "return", "x", "=", "+", "(", ")", "if", "else", "for", "in"]
    path.write_text("".join(" ".join(rng.choice(words, rng.integers(2, 9))) + "\n"
                            for _ in range(300)))
    return path


def configs(root: Path, **train) -> tuple[ModelConfig, TrainConfig, DataConfig]:
    corpus = root / "corpus.txt"
    if not corpus.exists():
        write_corpus(corpus)
    # One decay length whatever the steps: the runs of this module (50 steps, 2 then 4, 4)
    # share one compiled train step (the cache), the update not depending on train.steps.
    # MFU's peak given: no matmul measured (test_training measures one).
    tc = dict(steps=4, decay_steps=4, batch_size=4, seq_len=16, warmup_steps=1, eval_every=0,
              eval_batches=1, log_every=1, ckpt_every=2, run_dir=str(root / "run"),
              sample_tokens=0, peak_flops=1e9)
    tc.update(train)
    data = DataConfig(path=str(corpus), tokenizer="char", cache_dir=str(root / "cache"),
                      val_fraction=0.1)
    return MODEL, TrainConfig(**tc), data


def step_dirs(checkpoints: Path) -> list[str]:
    return sorted(p.name for p in checkpoints.iterdir())


# Signals -----------------------------------------------------------------------------------------

def test_a_second_signal_waits_for_the_shutdown_save(tmp_path, monkeypatch, caplog):
    """Ctrl-C, then Ctrl-C again while the checkpoint it asked for is being written: the save
    completes (and says so) instead of dying half-written."""
    model, tc, data = configs(tmp_path, steps=50)
    sent = []
    push = RunLog.push

    def push_and_interrupt(self, step, metrics):
        push(self, step, metrics)
        if step == 3 and not sent:
            sent.append("first")
            os.kill(os.getpid(), signal.SIGINT)

    save_fn = json_checkpoint_handler.JsonCheckpointHandler._save_fn

    async def interrupted_save(self, x, directory):
        if sent == ["first"]:  # the shutdown save: a second Ctrl-C while it is written
            sent.append("second")
            os.kill(os.getpid(), signal.SIGINT)
            await asyncio.sleep(0.3)
        return await save_fn(self, x, directory)

    monkeypatch.setattr(RunLog, "push", push_and_interrupt)
    monkeypatch.setattr(json_checkpoint_handler.JsonCheckpointHandler, "_save_fn",
                        interrupted_save)
    caplog.set_level(logging.WARNING, logger="transformer_jax")
    try:
        summary = training.run(model, tc, data, progress=False)
    except KeyboardInterrupt:
        pytest.fail("the second SIGINT interrupted the shutdown save")
    assert sent == ["first", "second"]
    assert summary.interrupted == "SIGINT" and summary.final_step == 3
    assert "saving, please wait; a third signal aborts" in caplog.text
    checkpoints = tmp_path / "run" / "checkpoints"
    assert step_dirs(checkpoints) == ["2", "3"]  # complete; no temporary directory
    with CheckpointManager(checkpoints) as ckpt:
        assert int(ckpt.restore(None)[0]["step"]) == 3


ABORT = """
import asyncio, os, runpy, signal, sys, time
from orbax.checkpoint._src.handlers import json_checkpoint_handler
from transformer_jax.train.log import RunLog, StopOnSignal
sent = []
handled = []
handle = StopOnSignal._handle
def counting_handle(self, signum, frame):
    handled.append(signum)
    return handle(self, signum, frame)
StopOnSignal._handle = counting_handle
push = RunLog.push
def push_and_interrupt(self, step, metrics):
    push(self, step, metrics)
    if step == 3 and not sent:
        sent.append(1)
        os.kill(os.getpid(), signal.SIGINT)
RunLog.push = push_and_interrupt
async def stuck_save(self, x, directory):
    if sent:  # the shutdown save: two more Ctrl-C while it hangs
        for _ in range(2):
            # Each one only after the last was handled: two signals sent before the main
            # thread runs its handler merge into one (as the kernel may do with any signal).
            seen = len(handled)
            os.kill(os.getpid(), signal.SIGINT)
            deadline = time.monotonic() + 30
            while len(handled) == seen and time.monotonic() < deadline:
                time.sleep(0.01)
        print(f"last signal at {time.time()}", file=sys.stderr, flush=True)
        time.sleep(600)  # longer than the test's timeout: only an abort ends the run
    path = directory / self._filename
    path.write_text(__import__("json").dumps(x))
json_checkpoint_handler.JsonCheckpointHandler._save_fn = stuck_save
sys.argv = ARGV
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.fixture(scope="module")
def aborted(tmp_path_factory):
    """One train.py run (checkpoint at step 2) whose shutdown save of step 3 gets two more
    SIGINTs while it hangs."""
    root = tmp_path_factory.mktemp("abort")
    corpus = write_corpus(root / "corpus.txt")
    argv = [str(ROOT / "train.py"), *TINY_RUN_ARGS, "train.steps=50", "train.peak_flops=1e9",
            f"data.path={corpus}",
            f"data.cache_dir={root / 'cache'}", f"train.run_dir={root / 'run'}"]
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=FAST_XLA_FLAGS,
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    try:
        done = subprocess.run([sys.executable, "-c", ABORT.replace("ARGV", repr(argv))],
                              env=env, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail("the run did not end in 240 s: the third SIGINT did not abort the save")
    ended = time.time()
    sent = re.findall(r"^last signal at ([\d.]+)$", done.stderr, re.M)
    return root, done, ended - float(sent[0]) if sent else None


def test_a_third_signal_aborts_in_one_line(aborted):
    root, done, seconds = aborted
    assert done.returncode == 130, done.stderr[-3000:]
    assert seconds is not None and seconds < 30  # from the third signal: no wait for the save
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    checkpoints = root / "run" / "checkpoints"
    assert errors == [f"error: aborted by a third SIGINT: the save of step 3 was abandoned; "
                      f"the newest checkpoint is {checkpoints / '2'}"]
    assert "saving, please wait; a third signal aborts" in done.stderr


def test_an_aborted_save_leaves_the_previous_checkpoint_and_no_debris(aborted, tmp_path):
    root, _, _ = aborted
    checkpoints = root / "run" / "checkpoints"
    assert step_dirs(checkpoints) == ["2"]
    with CheckpointManager(checkpoints) as ckpt:
        assert int(ckpt.restore(None)[0]["step"]) == 2


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """A run of 2 steps whose save of step 3 was killed half-way, run again to step 4, then run
    a third time: each run's summary and log, the summary file after the second and the third."""
    root = tmp_path_factory.mktemp("resumed")
    model, tc, data = configs(root)
    training.run(model, dataclasses.replace(tc, steps=2), data, progress=False)
    debris = root / "run" / "checkpoints" / "3.orbax-checkpoint-tmp-1234"
    (debris / "state").mkdir(parents=True)
    (debris / "state" / "x").write_bytes(b"partial")
    summary_file = root / "run" / "summary.json"
    second, second_log = logged(lambda: training.run(model, tc, data, progress=False))
    written = summary_file.read_text()
    third, third_log = logged(lambda: training.run(model, tc, data, progress=False))
    return root, (second, second_log, written), (third, third_log, summary_file.read_text())


def test_a_run_removes_an_interrupted_saves_leftovers_and_resumes(resumed):
    root, (summary, log, _), _ = resumed
    assert summary.start_step == 2 and summary.final_step == 4
    assert step_dirs(root / "run" / "checkpoints") == ["2", "4"]
    assert "removed the unfinished save 3.orbax-checkpoint-tmp-1234" in log


# A finished run ----------------------------------------------------------------------------------

def test_rerunning_a_finished_run_keeps_its_summary(resumed):
    """The finished run (the resumed one above) run again: nothing to do."""
    _, (first, _, written), (again, log, rewritten) = resumed
    assert first.train_loss is not None and first.val_loss is not None
    assert rewritten == written
    assert again.train_loss == first.train_loss and again.val_loss == first.val_loss
    assert again.final_step == 4
    lines = [line for line in log.splitlines() if "nothing to do" in line]
    assert len(lines) == 1 and "step 4 of train.steps=4" in lines[0]
    assert "compiled train step" not in log


# Memory ------------------------------------------------------------------------------------------

def test_a_run_too_big_for_the_machine_is_refused_before_the_data(tmp_path, monkeypatch):
    """llama2_7b on a 24 GiB host: one line, before tokenizing anything."""
    monkeypatch.setattr(run_memory, "_host_available", lambda: 24 * 2 ** 30)
    _, tc, data = configs(tmp_path, seq_len=512, batch_size=1)
    model = ModelConfig.preset("llama2_7b")
    with pytest.raises(ValueError) as info:
        training.run(model, tc, data, progress=False)
    message = str(info.value)
    assert "\n" not in message and "will not fit in memory" in message
    need = float(message.split("needs about ")[1].split(" GiB")[0])
    assert need > 3 * 4 * 6.7e9 / 2 ** 30  # float32 weights and Adam's two moments at least
    assert "24.0 GiB" in message and "--no-memory-check" in message
    assert not (tmp_path / "cache").exists()  # nothing was tokenized
    # The same run passes the check with the memory it needs.
    monkeypatch.setattr(run_memory, "_host_available", lambda: int(2 * need * 2 ** 30))
    from transformer_jax.parallel import sharding as sharding_lib
    from transformer_jax.train.checks import check_memory

    check_memory(model, tc, sharding_lib.make_mesh(sharding_lib.MeshConfig.parse(tc.mesh)))


def test_the_activation_estimate_follows_the_remat_policy_and_loss_chunks():
    model = ModelConfig.preset("tinyllama_1_1b").replace(dtype="bfloat16")
    tc = TrainConfig(batch_size=1, seq_len=2048, warmup_steps=0)
    mesh = {"data": 1, "fsdp": 1, "tensor": 1}
    none = run_memory.activation_bytes(model.replace(remat="none"), tc, mesh)
    full = run_memory.activation_bytes(model.replace(remat="full"), tc, mesh)
    chunked = run_memory.activation_bytes(model.replace(remat="full"),
                                          dataclasses.replace(tc, loss_chunk=256), mesh)
    assert none > 3 * full and chunked < full / 2
    # Within a factor of two of XLA's 1.13 GiB for this set-up (README, remat full).
    assert 0.5 < full / (1.13 * 2 ** 30) < 2


# The attention a run uses ------------------------------------------------------------------------

def test_the_log_names_the_attention_the_run_uses(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(attn, "_logged_choices", set())
    model, tc, data = configs(tmp_path, steps=2)
    caplog.set_level(logging.INFO, logger="transformer_jax")
    training.run(model.replace(attention_impl="chunked"), tc, data, progress=False)
    assert "'auto' picked" not in caplog.text  # nothing ran "auto"
    compiled = [r.getMessage() for r in caplog.records if "compiled train step" in r.getMessage()]
    assert len(compiled) == 1 and "attention 'chunked'" in compiled[0]


def test_initialising_parameters_picks_no_attention(monkeypatch, caplog):
    """The init's dummy forward (8 tokens) logged "'auto' picked 'xla'" for a HF checkpoint's
    model (whose attention_impl is "auto") in a run that uses another implementation."""
    from transformer_jax.model import transformer as model_lib
    from transformer_jax.train.step import make_init_fn

    monkeypatch.setattr(attn, "_logged_choices", set())
    caplog.set_level(logging.INFO, logger=attn.__name__)
    auto = MODEL.replace(attention_impl="auto")
    model_lib.logical_axes(auto)
    model_lib.abstract_params(auto)
    jax.eval_shape(make_init_fn(auto, TrainConfig(steps=2, warmup_steps=0)), jax.random.key(0))
    assert "picked" not in caplog.text


# A full disk -------------------------------------------------------------------------------------

def test_a_full_disk_echoes_nothing_after_its_one_error(tmp_path, monkeypatch, caplog):
    """A write fails while many others are in flight (files capped in size by RLIMIT_FSIZE,
    as a full disk does): orbax stops waiting for the rest, whose completions each raised an
    unraisable RuntimeError (Event loop is closed), printed as a traceback on stderr."""
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    rng = np.random.default_rng(0)  # (device_put: no program compiled to draw them)
    state = {f"w{i}": jax.device_put(rng.standard_normal((128, 256), np.float32))
             for i in range(40)}
    ckpt = CheckpointManager(tmp_path, keep=3)
    ckpt.save(1, state)
    ckpt.wait()
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64_000, limits[1]))
    try:
        with pytest.raises(CheckpointError, match=f"could not write checkpoint {tmp_path / '2'}"):
            ckpt.save(2, state)
            ckpt.wait()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, previous)
    ckpt.close()  # quiet: the failure was reported
    time.sleep(1.0)  # the stragglers complete
    gc.collect()
    assert not unraisable, [str(u.exc_value) for u in unraisable[:3]]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert step_dirs(tmp_path) == ["1"]


def test_unretrieved_writer_errors_stay_out_of_the_log(tmp_path, caplog):
    """asyncio's "Future exception was never retrieved" for an error of a failed save (a
    TensorStore status, or raised in orbax's code) is kept at DEBUG level; another's is shown."""
    CheckpointManager(tmp_path).save(1, {"w": jax.numpy.zeros(3)})  # installs the filters
    caplog.set_level(logging.DEBUG)
    try:
        exec(compile("raise OSError('disk')", "/lib/orbax/checkpoint/write.py", "exec"))
    except OSError as e:
        in_orbax = e
    for error, kept in ((ValueError("RESOURCE_EXHAUSTED: No space left on device"), True),
                        (in_orbax, True), (ValueError("not a writer's"), False)):
        caplog.clear()
        loop = asyncio.new_event_loop()
        future = loop.create_future()
        future.set_exception(error)
        del future
        gc.collect()
        loop.close()
        shown = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert not shown if kept else shown, (error, shown)
        assert any("never retrieved" in r.getMessage() for r in caplog.records), error


# Resume checks -----------------------------------------------------------------------------------

def _meta(**changes):
    train = dict(TrainConfig().__dict__)
    data = dict(DataConfig().__dict__)
    meta = {"model": {"d_model": 32}, "train": train, "data": data, "tokenizer": "t",
            "tokenizer_fingerprint": "tok", "data_fingerprint": "data"}
    for key, value in changes.items():
        section, name = key.split("__")
        if section in ("train", "data"):
            meta[section] = {**meta[section], name: value}
        else:
            meta[name] = value
    return meta


def test_resume_ignores_lora_targets_without_adapters(tmp_path):
    saved = _meta()
    check_resume(saved, _meta(train__lora_targets="q,v"), tmp_path)  # lora_rank=0: unused
    with pytest.raises(ValueError, match="train.lora_targets"):
        check_resume(_meta(train__lora_rank=8), _meta(train__lora_rank=8,
                                                      train__lora_targets="q,v"), tmp_path)


def test_resume_names_the_data_setting_that_changed(tmp_path):
    saved = _meta()
    current = _meta(data__val_fraction=0.2, top__data_fingerprint="other")
    with pytest.raises(ValueError) as info:
        check_resume(saved, current, tmp_path)
    message = str(info.value)
    assert "data.val_fraction: 0.05 in the checkpoint, 0.2 now" in message
    assert "train/validation split" in message and "another corpus" not in message
    assert "train.allow_new_data=true" in message


def test_a_third_signal_while_a_save_starts_is_raised_when_the_start_returns():
    from transformer_jax.train.log import SaveAborted, StopOnSignal

    stop = StopOnSignal()
    started = []
    with pytest.raises(SaveAborted, match="SIGTERM"):
        with stop.deferred():
            for _ in range(3):
                stop._handle(signal.SIGTERM, None)
            started.append("save() returned")  # not cut short inside the save's start
    assert started == ["save() returned"] and stop.signal == "SIGTERM"
    outside = StopOnSignal()
    outside._handle(signal.SIGINT, None)
    outside._handle(signal.SIGINT, None)
    with pytest.raises(SaveAborted):  # outside a save's start the third signal raises at once
        outside._handle(signal.SIGINT, None)
