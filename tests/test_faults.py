"""What a failing machine or a mistaken command meets: each fault reproduced on a tiny run, with
the one line it prints and a check that nothing was lost."""

from __future__ import annotations

import errno
import importlib
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from helpers import FAST_XLA_FLAGS, TINY_RUN_ARGS

from transformer_jax.checkpoint.manager import CheckpointManager
from transformer_jax.model.config import ModelConfig
from transformer_jax.train import run as training
from transformer_jax.train.config import DataConfig, TrainConfig

ROOT = Path(__file__).resolve().parent.parent
from transformer_jax.cli import train  # noqa: E402  (the train command)

generate_cli = importlib.import_module("transformer_jax.cli.generate")



def write_corpus(path: Path, seed: int = 0, words: tuple[str, ...] = (
        "def", "return", "x", "=", "+", "(", ")", "if", "else", "for", "in")) -> Path:
    rng = np.random.default_rng(seed)
    path.write_text("".join(" ".join(rng.choice(words, rng.integers(2, 9))) + "\n"
                            for _ in range(300)))
    return path


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A corpus, the environment of this module's train.py processes, and a 4-step run
    (checkpoints 2, 4) that each test copies, made in this process (``run_here``)."""
    root = tmp_path_factory.mktemp("faults")
    write_corpus(root / "corpus.txt")
    # The run-wide compilation cache (conftest), and cheaper XLA:CPU code generation.
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=FAST_XLA_FLAGS)
    run_here(root, root / "base", "train.steps=4")
    return root, env


def command(root: Path, run_dir: Path, *extra: str) -> list[str]:
    # One decay length whatever the steps (4, 6): the in-process runs share one compiled train
    # step (the run's cache), the update not depending on train.steps.
    return [sys.executable, str(ROOT / "train.py"), *TINY_RUN_ARGS,
            f"data.path={root / 'corpus.txt'}", f"data.cache_dir={root / 'cache'}",
            f"train.run_dir={run_dir}", "train.decay_steps=4", *extra]


def run_here(root: Path, run_dir: Path, *extra: str):
    """``command(root, run_dir, *extra)``'s run in this process, as train.py makes it
    (``build_configs`` then ``training.run``) but on this process's one device and without
    the loss plot: a train.py process costs its start and compiles (some 5 s of CPU) that this
    module's other in-process runs share. Where the command's own exit code and error line
    are the point, the tests below run train.py."""
    overrides = [a for a in command(root, run_dir, *extra)[2:] if not a.startswith("--")]
    model, train_config, data_config = train.build_configs("tiny", overrides)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(training, "_plot", lambda run_dir, times: None)
        return training.run(model, train_config, data_config, progress=False)


def copy_run(root: Path, name: str) -> Path:
    shutil.copytree(root / "base", root / name)
    return root / name


def tree_digest(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def error_line(stderr: str) -> str:
    """The one ``error:`` line of a failed command (and no traceback)."""
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def damage(step_dir: Path) -> None:
    """Flips bytes in the largest array file of a checkpoint (its checksum no longer matches)."""
    target = max((p for p in (step_dir / "state").rglob("*") if p.is_file()),
                 key=lambda p: p.stat().st_size)
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))


def test_damaged_latest_checkpoint_resumes_from_the_older_one(workspace, caplog):
    root, _ = workspace
    run_dir = copy_run(root, "damaged")
    damage(run_dir / "checkpoints" / "4")
    with caplog.at_level(logging.INFO, logger="transformer_jax"):
        run_here(root, run_dir, "train.steps=6")
    assert "checkpoints/4 is damaged" in caplog.text and "moved it to 4.damaged-" in caplog.text
    assert "(step 2)" in caplog.text  # "resumed from .../2 (step 2)"
    assert (run_dir / "checkpoints" / "4.damaged-1").is_dir()  # set aside, not deleted
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["start_step"] == 2 and summary["final_step"] == 6


def refusal(root: Path, run_dir: Path, *extra: str) -> str:
    """The one-line ValueError of ``training.run`` for ``command(root, run_dir, *extra)``'s
    configs, in this process: a resume is refused before anything is compiled or restored.
    train.py prints such an error as its one ``error:`` line and exits with 2
    (``test_resuming_on_another_corpus_needs_allow_new_data`` checks that on the command)."""
    overrides = [a for a in command(root, run_dir, *extra)[2:] if not a.startswith("--")]
    model, train_config, data_config = train.build_configs("tiny", overrides)
    with pytest.raises(ValueError) as info:
        training.run(model, train_config, data_config, progress=False)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def test_resuming_with_another_d_model_names_the_key(workspace):
    root, _ = workspace
    run_dir = copy_run(root, "wider")
    before = tree_digest(run_dir / "checkpoints")
    line = refusal(root, run_dir, "train.steps=6", "model.d_model=64")
    assert "model.d_model: 32 in the checkpoint, 64 now" in line
    assert "use another train.run_dir" in line and "orbax" not in line
    assert tree_digest(run_dir / "checkpoints") == before


def test_resuming_with_grad_clip_switched_off_is_refused(workspace):
    root, _ = workspace
    run_dir = copy_run(root, "noclip")
    line = refusal(root, run_dir, "train.steps=6", "train.grad_clip=0")
    assert "train.grad_clip: 1.0 in the checkpoint, 0.0 now" in line


def test_resuming_with_another_tokenizer_is_refused(workspace):
    root, _ = workspace
    run_dir = copy_run(root, "othertok")
    other = write_corpus(root / "letters.txt", words=("abc", "xyz", "qq", "w"))
    line = refusal(root, run_dir, "train.steps=6", f"data.path={other}",
                   "train.allow_new_data=true")
    assert "another tokenizer" in line and "fingerprint" in line
    assert [p.name for p in sorted((run_dir / "checkpoints").iterdir())] == ["2", "4"]


def test_resuming_on_another_corpus_needs_allow_new_data(workspace):
    root, env = workspace
    run_dir = copy_run(root, "newdata")
    shuffled = root / "shuffled.txt"
    lines = (root / "corpus.txt").read_text().splitlines(keepends=True)
    shuffled.write_text("".join(reversed(lines)))
    same_tokenizer = [f"data.path={shuffled}",
                      f"data.tokenizer={run_dir / 'tokenizer' / 'tokenizer.model'}"]
    done = subprocess.run(command(root, run_dir, "train.steps=6", *same_tokenizer), env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert "train.allow_new_data=true" in error_line(done.stderr)
    run_here(root, run_dir, "train.steps=6", *same_tokenizer, "train.allow_new_data=true")
    assert json.loads((run_dir / "summary.json").read_text())["start_step"] == 4


def test_full_disk_during_a_checkpoint_is_one_line_and_keeps_the_earlier_ones(workspace):
    root, env = workspace
    run_dir = root / "full"
    script = textwrap.dedent(f"""
        import errno, runpy, sys
        import orbax.checkpoint as ocp
        real = ocp.CheckpointManager.save
        def save(self, step, *args, **kwargs):
            if step == 4:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(self, step, *args, **kwargs)
        ocp.CheckpointManager.save = save
        sys.argv = {command(root, run_dir, "train.steps=6")[1:]!r}
        runpy.run_path(sys.argv[0], run_name="__main__")
    """)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]
    line = error_line(done.stderr)
    assert line == (f"error: could not write checkpoint {run_dir / 'checkpoints' / '4'}: "
                    f"{os.strerror(errno.ENOSPC)}")
    with CheckpointManager(run_dir / "checkpoints") as ckpt:
        assert ckpt.all_steps() == [2]
        assert int(ckpt.restore(None)[0]["step"]) == 2


def test_config_that_is_not_toml_names_the_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\nd_model = = 64\n")
    assert train.main(["--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"config file {bad} is not valid TOML" in err and "line 2" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("case", ["seq_len", "mesh"])
def test_config_checks_run_before_the_data_and_leave_no_checkpoints_dir(tmp_path, case):
    corpus = write_corpus(tmp_path / "corpus.txt")
    model = ModelConfig(vocab_size=32, d_model=32, n_layers=1, n_heads=2, d_ff=64,
                        max_seq_len=32)
    tc = dict(steps=2, batch_size=4, seq_len=16, run_dir=str(tmp_path / "run"))
    if case == "seq_len":
        tc["seq_len"], match = 64, "seq_len=64 is above the model's max_seq_len=32"
    else:
        tc["mesh"], match = "1,64,1", "64"
    data = DataConfig(path=str(corpus), tokenizer="char", cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=match):
        training.run(model, TrainConfig(**tc), data, progress=False)
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert not (tmp_path / "cache").exists()  # nothing was tokenized


def test_generate_reads_a_copied_run_without_its_tokenizer_cache(workspace, tmp_path, capsys):
    root, _ = workspace
    run_dir = shutil.copytree(root / "base", tmp_path / "elsewhere")
    meta = json.loads((run_dir / "config.json").read_text())
    recorded = Path(meta["tokenizer"])
    hidden = recorded.with_suffix(".hidden")
    recorded.rename(hidden)  # the data cache was cleared
    try:
        argv = ["--checkpoint", str(run_dir), "--prompt", "def", "--max-new-tokens", "3",
                "--json"]
        assert generate_cli.main(argv) == 0
    finally:
        hidden.rename(recorded)
    out = json.loads(capsys.readouterr().out)
    assert out["text"][0] is not None and 1 <= out["lengths"][0] <= 3


def test_generate_skips_a_damaged_newest_checkpoint_without_renaming_it(workspace, tmp_path,
                                                                        capsys):
    root, _ = workspace
    run_dir = shutil.copytree(root / "base", tmp_path / "live")
    damage(run_dir / "checkpoints" / "4")
    argv = ["--checkpoint", str(run_dir), "--prompt-ids", "1,2", "--max-new-tokens", "2",
            "--json"]
    assert generate_cli.main(argv) == 0
    assert json.loads(capsys.readouterr().out)["lengths"][0] <= 2
    assert (run_dir / "checkpoints" / "4").is_dir()  # a reader never renames


def test_generate_prompt_ids_with_an_empty_item_is_an_error(workspace, capsys):
    root, _ = workspace
    with pytest.raises(SystemExit) as exit_info:
        generate_cli.main(["--checkpoint", str(root / "base"), "--prompt-ids", "1,,2"])
    assert exit_info.value.code == 2
    assert "expects comma-separated ints such as 1,2,3, got '1,,2'" in capsys.readouterr().err


def test_generate_checkpoint_that_is_a_file_says_so(tmp_path, capsys):
    file = tmp_path / "model.safetensors"
    file.write_bytes(b"")
    assert generate_cli.main(["--checkpoint", str(file), "--prompt-ids", "1"]) == 1
    err = capsys.readouterr().err
    assert f"--checkpoint '{file}' is a file; give a directory" in err
