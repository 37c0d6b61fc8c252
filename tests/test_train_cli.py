"""End-to-end tests of train.py: override parsing, exact resume after kill -9, SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import SCRIPTS_DRIVER, with_fast_flags

from transformer_jax.checkpoint.manager import CheckpointManager
from transformer_jax.model.config import ModelConfig

ROOT = Path(__file__).resolve().parent.parent
from transformer_jax.cli import train  # noqa: E402  (the train command)

# One layer: less tracing and compiling in each of the module's five train.py processes.
TINY = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1",
        "model.d_ff=64", "model.max_seq_len=32", "model.vocab_size=64", "train.seq_len=16",
        "train.batch_size=4", "train.warmup_steps=2", "train.log_every=1",
        "train.eval_every=0", "train.eval_batches=1", "train.sample_tokens=0",
        "data.tokenizer=char", "data.val_fraction=0.1"]


# Override parsing --------------------------------------------------------------------------------

def test_overrides_are_typed_and_applied():
    model, tc, data = train.build_configs("tiny", ["model.n_layers=3", "train.lr=0.002",
                                                   "train.steps=7", "train.warmup_steps=2",
                                                   "data.path=a.txt,b/*.py",
                                                   "model.sliding_window=none"])
    assert model.n_layers == 3 and model.sliding_window is None
    assert tc.lr == 0.002 and tc.steps == 7
    assert data.patterns == ["a.txt", "b/*.py"]
    assert model.d_model == ModelConfig.preset("tiny").d_model  # untouched fields keep the preset


@pytest.mark.parametrize("override, message", [
    ("train.learning_rate=1", "unknown train option 'learning_rate'"),
    ("train.stpes=3", "did you mean 'steps'"),
    ("model.n_layer=2", "did you mean 'n_layers'"),
    ("modle.n_layers=2", "unknown section 'modle'.*did you mean 'model'"),
    ("n_layers=2", "needs a section prefix.*model.n_layers"),
    ("train.steps", "not of the form"),
    ("train.steps=ten", "steps expects an int, got 'ten'"),
    ("model.tie_embeddings=maybe", "expects a bool"),
    ("train.steps=0", "steps must be an int >= 1"),
    ("model.d_model=126", "divisible by n_heads"),
])
def test_bad_overrides_are_clear_errors(override, message):
    with pytest.raises(train.ConfigError, match=message):
        train.build_configs("tiny", [override])


def test_cli_reports_config_errors_without_a_traceback(capsys, tmp_path):
    assert train.main(["train.stpes=3"]) == 2
    err = capsys.readouterr().err
    assert "did you mean 'steps'" in err and "Traceback" not in err
    # Flags and overrides may be mixed in any order.
    assert train.main(["train.steps=3", "--no-progress", "train.stpes=3"]) == 2
    assert "did you mean 'steps'" in capsys.readouterr().err
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\nd_model = 64\n[training]\nsteps = 3\n")
    assert train.main(["--config", str(bad)]) == 2
    assert "unknown tables ['training']" in capsys.readouterr().err
    assert train.main(["--config", "tiyn"]) == 2
    assert "did you mean tiny" in capsys.readouterr().err


# Subprocess runs ---------------------------------------------------------------------------------
# Two processes: the run killed with -9 (a process of its own), then one SCRIPTS_DRIVER process
# that runs train.py as ``__main__`` for each of the other runs in turn (the resume of the killed
# run, the uninterrupted reference, the run stopped by SIGTERM, the batch refused for its
# devices): a process start (imports, backends) costs seconds, and these runs test resuming and
# signals.
# Every process here has the same 2 CPU devices (XLA_FLAGS), so the resumed run's devices are
# the killed run's.

@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A made-up corpus, and caches shared by every run of this module."""
    root = tmp_path_factory.mktemp("cli")
    rng = np.random.default_rng(0)
    words = ["def", "return", "x", "=", "+", "(", ")", "if", "else", "for", "in", "range"]
    lines = [" ".join(rng.choice(words, rng.integers(2, 9))) for _ in range(600)]
    (root / "corpus.txt").write_text("\n".join(lines) + "\n")
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(root / "xla"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PLATFORMS="cpu",
               # cheaper XLA:CPU code generation, 2 CPU devices in every process
               XLA_FLAGS=with_fast_flags("--xla_force_host_platform_device_count=2"))
    return root, env


# train.py's command (``transformer_jax.cli.train.main``) without the loss plot: drawing it
# (matplotlib) cost each run here about a second of CPU, and these runs test resuming and
# signals (the plot has its own tests; the batch test below runs train.py itself).
NO_PLOT = ("import sys; from transformer_jax.train import run; "
           "run._plot = lambda run_dir, times: None; "
           "from transformer_jax.cli.train import main; sys.exit(main())")

def command(root: Path, run_dir: Path, *extra: str, plot: bool = False) -> list[str]:
    entry = [str(ROOT / "train.py")] if plot else ["-c", NO_PLOT]
    # MFU's peak given: no matmul measured in each run (its measurement has its own tests).
    return [sys.executable, *entry, "--no-progress", *TINY, "train.peak_flops=1e9",
            f"data.path={root / 'corpus.txt'}", f"data.cache_dir={root / 'cache'}",
            f"train.run_dir={run_dir}", *extra]


def train_losses(run_dir: Path) -> list[tuple[int, float]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines) if r["split"] == "train"]


def final_state(run_dir: Path):
    with CheckpointManager(run_dir / "checkpoints", keep=3) as ckpt:
        return ckpt.latest_step(), ckpt.restore(None)[0]


def wait_for_checkpoint(run_dir: Path, proc: subprocess.Popen, timeout: float = 120) -> int:
    """Polls until a complete checkpoint exists; returns its step."""
    deadline = time.monotonic() + timeout
    ckpt_dir = run_dir / "checkpoints"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"train.py exited early ({proc.returncode})")
        if ckpt_dir.is_dir():
            steps = [int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit()]
            if steps:
                return max(steps)
        time.sleep(0.005)
    raise AssertionError("no checkpoint appeared")


N = 50  # steps of the kill -9 test's runs
# The first checkpoint (10) is 4 checkpoints before the end: the kill lands well before.
KILL_STEPS = [f"train.steps={N}", "train.ckpt_every=10", "train.keep_ckpts=2"]


@pytest.fixture(scope="module")
def runs(workspace):
    """The killed run's step when killed, and the SCRIPTS_DRIVER's results: "resumed" (the
    killed run run again), "straight" (its N steps uninterrupted), "sigterm" (stopped by SIGTERM
    after its first checkpoint), "devices" (a batch of 3 rows on 2 devices)."""
    root, env = workspace
    killed, log = root / "killed", root / "killed.err"
    with open(log, "w") as stderr:
        proc = subprocess.Popen(command(root, killed, *KILL_STEPS), env=env,
                                stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        try:
            wait_for_checkpoint(killed, proc)
        except AssertionError as e:
            raise AssertionError(f"{e}: {log.read_text()[-3000:]}") from None
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGKILL
    interrupted_at, _ = final_state(killed)

    # Also evaluates several batches every 10 steps. The decay length of the kill -9 test's
    # runs: the same compiled train step (the module's cache), the update not depending on
    # train.steps.
    sigterm = ["train.steps=100000", "train.decay_steps=50", "train.ckpt_every=25",
               "train.eval_every=10", "train.eval_batches=4"]
    jobs = [("resumed", None, command(root, killed, *KILL_STEPS)[1:]),
            ("straight", None, command(root, root / "straight", *KILL_STEPS)[1:]),
            ("sigterm", None, command(root, root / "sigterm", *sigterm)[1:]),
            ("devices", None,
             command(root, root / "devices", "train.batch_size=3", plot=True)[1:])]
    out, err = root / "driver.out", root / "driver.err"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        driver = subprocess.Popen([sys.executable, "-c", SCRIPTS_DRIVER], stdin=subprocess.PIPE,
                                  stdout=stdout, stderr=stderr, env=env, text=True)
    try:
        driver.stdin.write(json.dumps(jobs))
        driver.stdin.close()
        try:
            first = wait_for_checkpoint(root / "sigterm", driver, timeout=300)
        except AssertionError as e:
            raise AssertionError(f"{e}: {err.read_text()[-3000:]}") from None
        driver.send_signal(signal.SIGTERM)
        assert driver.wait(timeout=300) == 0, err.read_text()[-3000:]
    finally:
        driver.kill()
    results = json.loads(out.read_text().strip().splitlines()[-1])
    results["sigterm"]["first"] = first
    return root, interrupted_at, results


def test_resume_after_kill_9_is_bit_exact(runs):
    """N steps straight == kill -9 after a checkpoint + restart: same losses, same params."""
    root, interrupted_at, results = runs
    assert interrupted_at < N, "the run finished before it was killed; nothing was tested"
    for name in ("straight", "resumed"):
        assert results[name]["returncode"] == 0, results[name]["stderr"][-3000:]
    # "resumed from ... (step N)"
    assert f"(step {interrupted_at})" in results["resumed"]["stderr"]
    straight, killed = root / "straight", root / "killed"
    expected = train_losses(straight)
    assert [s for s, _ in expected] == list(range(1, N + 1))
    assert train_losses(killed) == expected  # floats compared exactly
    (step_a, state_a), (step_b, state_b) = final_state(straight), final_state(killed)
    assert step_a == step_b == N
    leaves_a, leaves_b = _flat(state_a), _flat(state_b)
    assert leaves_a.keys() == leaves_b.keys()
    for name in leaves_a:
        np.testing.assert_array_equal(leaves_a[name], leaves_b[name], err_msg=name)


def _flat(tree) -> dict[str, np.ndarray]:
    import jax

    return {jax.tree_util.keystr(path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_sigterm_saves_a_restorable_checkpoint(runs):
    root, _, results = runs
    done = results["sigterm"]
    assert done["returncode"] == 143, done["stderr"][-3000:]
    assert "SIGTERM" in done["stderr"] and "stopped by   SIGTERM" in done["stdout"]
    run_dir = root / "sigterm"
    summary = json.loads((run_dir / "summary.json").read_text())
    step, state = final_state(run_dir)
    assert step == summary["final_step"] >= done["first"]
    assert int(state["step"]) == step
    assert train_losses(run_dir)[-1][0] == step


def test_batch_not_divisible_by_device_count(runs):
    root, _, results = runs
    done = results["devices"]
    assert done["returncode"] == 2
    assert "batch_size=3" in done["stderr"] and "number of devices (2)" in done["stderr"]
    assert not (root / "devices" / "checkpoints").exists() or not any(
        (root / "devices" / "checkpoints").iterdir())
