"""Every training command of README.md and docs/*.md runs as written (with a tiny model, a tiny
corpus and a few steps appended), and every entry point's ``--help`` works.

A training command is a line of a fenced code block that starts ``transformer-jax train`` or
``python train.py``: the same program (``train.py`` is the alias of ``transformer-jax train``),
so both are run as ``python ROOT/train.py ARGS``. The commands that set nothing of their
process (its devices, the hosts beside it) but a mesh of 8 devices run one after another in one
process of 8 CPU devices, as on an 8-core host (``SCRIPTS_DRIVER``: ``train.py`` executed as
``__main__`` for each, in its own directory), which each of them would set up alike there; the
others run in processes of their own."""

from __future__ import annotations

import json
import math
import os
import runpy
import shlex
import socket
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from helpers import FAST_XLA_FLAGS, SCRIPTS_DRIVER, with_fast_flags

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# How a training command starts, in the documents' two spellings.
TRAIN_PREFIXES = (("transformer-jax", "train"), ("tjax", "train"), ("python", "train.py"))

# Appended to each documented command: later overrides win, so the command's own model size,
# data and step count are replaced by CI-sized ones (a step count the command gives is kept
# when it is small, e.g. to reach its profile_steps). One decay length whatever the steps: the
# update does not depend on train.steps, so the commands of one preset share compiled programs.
# MFU's peak given: no 1024x1024 matmul measured in each process (test_training measures one).
TINY = ["--no-progress", "model.d_model=32", "model.n_layers=1", "model.n_heads=2",
        "model.n_kv_heads=1", "model.d_ff=64", "model.max_seq_len=32", "train.seq_len=16",
        "train.batch_size=8", "train.eval_batches=1", "train.sample_tokens=4",
        "train.log_every=5", "data.tokenizer=char", "data.val_fraction=0.1",
        "train.decay_steps=4", "train.peak_flops=1e9"]
MAX_STEPS = 30


def train_args(line: str) -> list[str] | None:
    """The arguments of a training command line (comment stripped), None for another line."""
    line = line.split("  #")[0].strip()
    if not line.startswith(tuple(" ".join(prefix) for prefix in TRAIN_PREFIXES)):
        return None
    words = shlex.split(line)
    for prefix in TRAIN_PREFIXES:
        if tuple(words[:len(prefix)]) == prefix:
            return words[len(prefix):]
    return None


def documented_train_commands() -> dict[str, tuple[str, ...]]:
    """``"file: line" -> arguments`` of every training command in the documents' code blocks;
    one entry per distinct argument list (the README and the docs show some of the same)."""
    commands: dict[str, tuple[str, ...]] = {}
    seen: set[tuple[str, ...]] = set()
    for document in DOCUMENTS:
        fenced, held = False, ""
        for line in document.read_text().splitlines():
            if line.lstrip().startswith("```"):
                fenced, held = not fenced, ""
                continue
            if fenced and line.rstrip().endswith("\\"):  # continued on the next line
                held += line.rstrip()[:-1]
                continue
            line, held = held + line, ""
            args = train_args(line) if fenced else None
            if args is None or "--help" in args or tuple(args) in seen:
                continue
            seen.add(tuple(args))
            commands[f"{document.relative_to(ROOT)}: {line.split('  #')[0].strip()}"] = tuple(args)
    return commands


ALL_COMMANDS = documented_train_commands()
# Commands on a bucket (gs://BUCKET/...) need the GCS emulator and shards in it: their shape is
# run by test_object_storage (checked below). Fine-tuning commands start from a pretrained
# checkpoint (train.init_from=path/to/hf_model), which test_finetune and test_preference run.
# The rest run here as written.
BUCKET_COMMANDS = {k: v for k, v in ALL_COMMANDS.items() if any("gs://" in a for a in v)}
FINETUNE_COMMANDS = {k: v for k, v in ALL_COMMANDS.items()
                     if k not in BUCKET_COMMANDS and any(a.startswith("train.init_from=")
                                                         for a in v)}
# Commands that load a step compiled for a pod (train.compiled_step=..., written by `compile
# --save` there) need that file: test_compiled_step runs their shape on this host's devices.
COMPILED_COMMANDS = {k: v for k, v in ALL_COMMANDS.items()
                     if any(a.startswith("train.compiled_step=") for a in v)}
COMMANDS = {k: v for k, v in ALL_COMMANDS.items()
            if k not in BUCKET_COMMANDS and k not in FINETUNE_COMMANDS
            and k not in COMPILED_COMMANDS}
# What sets up a train.py process: its options other than --config (devices, hosts, fast math)
# and the keys that choose its CPU devices (one per core dividing the micro-batch, a mesh).
PROCESS_KEYS = ("train.mesh=", "train.batch_size=", "train.grad_accum=")


# The shared process's CPU devices: an 8-core host's, where a command that sets nothing of its
# process picks them all (one per core dividing its micro-batch) and a mesh of 8 fits them.
SHARED_DEVICES = 8


def sets_up_its_process(args: tuple[str, ...]) -> bool:
    """Whether ``args`` set up a process other than the shared one (a mesh of its devices is
    the shared process's set-up)."""
    def shared_mesh(a: str) -> bool:
        sizes = a.removeprefix("train.mesh=").split(",")
        return (a.startswith("train.mesh=") and all(n.isdigit() for n in sizes)
                and math.prod(map(int, sizes)) == SHARED_DEVICES)

    return any((a.startswith("--") and a != "--config")
               or (a.startswith(PROCESS_KEYS) and not shared_mesh(a)) for a in args)


# Run in one process, one after another (each would set up its process alike); a process each
# for the rest.
SHARED = [k for k, v in COMMANDS.items() if not sets_up_its_process(v)]


def test_the_documents_have_train_commands():
    assert len(COMMANDS) >= 7, list(COMMANDS)
    assert ("train.steps=50", "train.run_dir=runs/quick", "model.n_layers=2") in COMMANDS.values()
    readme = [k for k in COMMANDS if k.startswith("README.md: ")]
    assert "README.md: transformer-jax train train.steps=50 train.run_dir=runs/quick " \
           "model.n_layers=2" in readme
    # The commands the multi-device and multi-host branches below exist for.
    assert any("train.mesh=1,8,1" in v for v in COMMANDS.values())
    assert any("--coordinator-address" in v for v in COMMANDS.values())
    # The multi-device command runs in the shared process of 8 devices, the multi-host one in
    # processes of its own.
    assert any("train.mesh=1,8,1" in COMMANDS[k] for k in SHARED)
    assert SHARED and not any("--coordinator-address" in COMMANDS[k] for k in SHARED)
    assert any(sets_up_its_process(v) for v in (("train.mesh=1,4,1",), ("train.mesh=-1,8,1",),
                                                 ("train.batch_size=4",)))
    assert COMPILED_COMMANDS  # docs/pods.md's, a continued line
    assert FINETUNE_COMMANDS and all(v[:2] in (("--config", "finetune"), ("--config", "dpo"),
                                               ("--config", "grpo"))
                                     for v in FINETUNE_COMMANDS.values())


def test_the_documented_bucket_commands_are_the_object_storage_tests():
    import test_object_storage as storage_test

    assert BUCKET_COMMANDS
    tested = {a.split("=", 1)[0] for a in (*storage_test.TRAIN,
                                           f"train.run_dir={storage_test.RUN}")
              if "=gs://" in a}
    for command, args in BUCKET_COMMANDS.items():
        # gs://BUCKET/x/y -> the keys set to a bucket path; the storage test sets the same ones.
        keys = {a.split("=", 1)[0] for a in args if "=gs://" in a}
        assert keys and keys <= tested, command


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("readme")
    rng = np.random.default_rng(0)
    words = ["def", "return", "x", "=", "+", "(", ")", "if", "else", "for", "in"]
    (root / "corpus.txt").write_text("".join(" ".join(rng.choice(words, rng.integers(2, 9)))
                                             + "\n" for _ in range(300)))
    # Cheaper XLA:CPU code generation (helpers.FAST_XLA_FLAGS): these runs check that
    # each command works, not how fast its steps are.
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(root / "xla"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PLATFORMS="cpu",
               XLA_FLAGS=FAST_XLA_FLAGS)
    return root, env


def ci_sized(args: tuple[str, ...], root: Path) -> list[str]:
    """The documented command's arguments plus the tiny overrides."""
    steps = [int(a.split("=", 1)[1]) for a in args if a.startswith("train.steps=")]
    extra = [] if steps and steps[-1] <= MAX_STEPS else ["train.steps=4"]
    return [sys.executable, str(ROOT / "train.py"), *args, *TINY, *extra,
            f"data.path={root / 'corpus.txt'}", f"data.cache_dir={root / 'cache'}"]


@pytest.fixture(scope="module")
def shared_runs(workspace, tmp_path_factory) -> dict[str, dict]:
    """The ``SHARED`` commands run by ``SCRIPTS_DRIVER`` in one process: name -> its result."""
    from transformer_jax.train.config import build_configs

    root, env = workspace
    # Each would pick the 8 CPU devices in a process of its own on an 8-core host (one per core
    # dividing the micro-batch), or names a mesh of them.
    micro = {build_configs(*_preset(ci_sized(COMMANDS[k], root)[2:]))[1].micro_batch_size
             for k in SHARED}
    assert all(m % SHARED_DEVICES == 0 for m in micro), micro
    jobs = [(k, str(tmp_path_factory.mktemp("cmd")), ci_sized(COMMANDS[k], root)[1:])
            for k in SHARED]
    env = dict(env, XLA_FLAGS=with_fast_flags(
        f"--xla_force_host_platform_device_count={SHARED_DEVICES}"))
    done = subprocess.run([sys.executable, "-c", SCRIPTS_DRIVER], input=json.dumps(jobs), env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _preset(args: list[str]) -> tuple[str, list[str]]:
    """(preset, overrides) of train.py's arguments (options: --config and flags only)."""
    preset = args[args.index("--config") + 1] if "--config" in args else "tiny"
    return preset, [a for i, a in enumerate(args)
                    if not a.startswith("--") and (i == 0 or args[i - 1] != "--config")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("command", COMMANDS)
def test_documented_train_command_runs(command, workspace, tmp_path, request):
    root, env = workspace
    args = COMMANDS[command]
    if command in SHARED:
        done = request.getfixturevalue("shared_runs")[command]
        assert done["returncode"] == 0, f"{command}\n{done['stderr'][-3000:]}"
        assert "summary" in done["stdout"]
        assert f"over {SHARED_DEVICES} devices" in done["stderr"]  # "mesh {...} over 8 devices"
        return
    argv = ci_sized(args, root)
    if "--coordinator-address" in args:  # host 0 of 2: start host 1 beside it
        port = str(_free_port())
        argv = [a.replace("127.0.0.1:1234", f"127.0.0.1:{port}") for a in argv]
        other = [a if a != "0" or argv[i - 1] != "--process-id" else "1"
                 for i, a in enumerate(argv)]
        env = dict(env, XLA_FLAGS=with_fast_flags("--xla_force_host_platform_device_count=1"))
        # Same working directory: the hosts share the run directory, as hosts share a disk.
        helper = subprocess.Popen(other, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True)
    else:
        helper = None
    try:
        done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)
        if helper is not None:
            assert helper.wait(timeout=120) == 0, helper.stderr.read()[-3000:]
    finally:
        if helper is not None:
            helper.kill()
    assert done.returncode == 0, f"{command}\n{done.stderr[-3000:]}"
    assert "summary" in done.stdout


@pytest.mark.parametrize("entry_point", [
    ["train.py"], ["-m", "transformer_jax.generate"], ["-m", "transformer_jax.bench"],
    ["-m", "transformer_jax.plot"], ["-m", "transformer_jax.cli"],
    ["-m", "transformer_jax.cli", "train"]], ids=" ".join)
def test_help_of_every_entry_point(entry_point, monkeypatch, capsys):
    """Each entry point run as ``python ENTRY --help`` runs it (``runpy``, in this process:
    the same module executed as ``__main__``, without a process start per entry point)."""
    if entry_point[0] == "-m":
        module, *rest = entry_point[1:]
        monkeypatch.setattr(sys, "argv", [module, *rest, "--help"])
        run = lambda: runpy.run_module(module, run_name="__main__", alter_sys=True)  # noqa: E731
    else:
        monkeypatch.setattr(sys, "argv", [entry_point[0], "--help"])
        run = lambda: runpy.run_path(str(ROOT / entry_point[0]), run_name="__main__")  # noqa: E731
    with pytest.raises(SystemExit) as exited:
        run()
    assert exited.value.code in (0, None)
    done = types.SimpleNamespace(stdout=capsys.readouterr().out)
    assert done.stdout.strip()
    if entry_point in (["train.py"], ["-m", "transformer_jax.cli", "train"]):
        assert "shakespeare_char" in done.stdout  # the presets
        assert "train.warmup_steps: int = -1" in done.stdout  # key: type = default
        assert "min(100" in done.stdout  # and its meaning, from the docstring
        for section in ("model.", "train.", "data."):
            assert f"  {section}" in done.stdout
    elif entry_point == ["-m", "transformer_jax.cli"]:
        from transformer_jax.cli import COMMANDS as SUBCOMMANDS

        for name in ("train", "generate", "serve", "evaluate", "export", "data", "bench",
                     "plot"):
            assert name in SUBCOMMANDS
            assert f"\n  {name} " in done.stdout, name  # the subcommand and what it does
    elif "transformer_jax.bench" in entry_point:
        for kind in ("train", "decode", "memory"):
            assert f"\n  {kind}\n" in done.stdout
    elif "transformer_jax.generate" in entry_point:
        text = " ".join(done.stdout.split())
        assert text.count("(default:") >= 15 and "(default: None)" not in text
        assert "(default: 64)" in text
    elif "transformer_jax.plot" in entry_point:
        assert "RUN_DIR" in done.stdout and "--out" in done.stdout
