"""Tests for transformer_jax.checkpoint: round trips, keep-K, temporary dirs, errors, damaged
checkpoints, a full disk, partial restores and a reader racing a live run."""

from __future__ import annotations

import errno
import logging
import shutil
import threading
import time
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from orbax.checkpoint._src.handlers import json_checkpoint_handler

from transformer_jax.checkpoint.manager import (
    CheckpointError,
    CheckpointManager,
    CheckpointMismatchError,
    DamagedCheckpointError,
    ensure_writable_dir,
)


def assert_trees_equal(a, b) -> None:
    """Bitwise equality of two pytrees of arrays (same structure)."""
    chex_leaves = jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    assert chex_leaves, (jax.tree_util.tree_structure(a), jax.tree_util.tree_structure(b))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def states():
    """A freshly initialised state and the state after 3 train steps (Adam moments non-zero)."""
    from transformer_jax.model.config import ModelConfig
    from transformer_jax.train.config import TrainConfig
    from transformer_jax.train.step import make_init_fn, make_train_step

    MODEL = ModelConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=2, d_ff=64,
                        max_seq_len=16)
    TRAIN = TrainConfig(steps=10, batch_size=4, seq_len=8, warmup_steps=1)
    init = jax.jit(make_init_fn(MODEL, TRAIN))
    step = jax.jit(make_train_step(MODEL, TRAIN), donate_argnums=0)
    state0 = init(jax.random.key(0))
    rng = np.random.default_rng(0)
    state = jax.tree.map(jnp.copy, state0)
    for _ in range(3):
        tokens = rng.integers(0, 40, (4, 9)).astype(np.int32)
        state, _ = step(state, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
    return init, state0, state, step


def test_round_trip_is_bit_exact(tmp_path, states):
    init, _, state, _ = states
    with CheckpointManager(tmp_path / "ckpt", keep=2) as ckpt:
        assert ckpt.latest_step() is None
        ckpt.save(3, state, meta={"note": "hello", "loss": 1.25})
        ckpt.wait()
        assert ckpt.all_steps() == [3]
        restored, meta = ckpt.restore(jax.eval_shape(init, jax.random.key(0)))
    assert meta == {"note": "hello", "loss": 1.25}
    assert int(restored.step) == 3
    assert_trees_equal(restored, state)


def test_keeps_last_k_and_restores_any_kept_step(tmp_path, states):
    init, state0, state, _ = states
    abstract = jax.eval_shape(init, jax.random.key(0))
    with CheckpointManager(tmp_path, keep=2) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, state if step == 3 else state0)
        ckpt.wait()
        assert ckpt.all_steps() == [2, 3]
        assert ckpt.save(3, state) is False  # already saved: nothing to do
        old, _ = ckpt.restore(abstract, step=2)
        assert_trees_equal(old, state0)
        with pytest.raises(FileNotFoundError, match="step 1"):
            ckpt.restore(abstract, step=1)


def test_incomplete_temporary_checkpoint_is_ignored(tmp_path, states):
    """A step directory still being written when the process died is never picked up."""
    init, _, state, _ = states
    with CheckpointManager(tmp_path, keep=3) as ckpt:
        ckpt.save(2, state)
    # What orbax leaves behind when a save of step 5 is killed mid-write: a temporary
    # directory with some of the files (here a copy of step 2's, then truncated).
    for name in ("5.orbax-checkpoint-tmp-1712345678", "6.orbax-checkpoint-tmp"):
        partial = tmp_path / name
        shutil.copytree(tmp_path / "2", partial)
        (partial / "commit_success.txt").unlink(missing_ok=True)
        for f in partial.rglob("*"):
            if f.is_file() and f.stat().st_size > 8:
                f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with CheckpointManager(tmp_path, keep=3) as ckpt:
        assert ckpt.all_steps() == [2]
        restored, _ = ckpt.restore(jax.eval_shape(init, jax.random.key(0)))
    assert_trees_equal(restored, state)


def test_async_save_is_safe_with_donated_buffers(tmp_path, states):
    """The next (donating) train step may run while the save is still being written."""
    init, _, state, step = states
    expected = jax.device_get(state)
    copy = jax.tree.map(jnp.copy, state)
    tokens = np.zeros((4, 9), np.int32)
    with CheckpointManager(tmp_path, keep=3) as ckpt:
        ckpt.save(3, copy)
        for _ in range(3):
            copy, _ = step(copy, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
        jax.block_until_ready(copy)
    with CheckpointManager(tmp_path, keep=3) as ckpt:
        restored, _ = ckpt.restore(jax.eval_shape(init, jax.random.key(0)))
    assert_trees_equal(restored, expected)


def test_restore_without_checkpoint_is_a_clear_error(tmp_path, states):
    init = states[0]
    with CheckpointManager(tmp_path, keep=1) as ckpt, pytest.raises(FileNotFoundError,
                                                                     match="no complete"):
        ckpt.restore(jax.eval_shape(init, jax.random.key(0)))


def test_unwritable_directory_is_a_clear_error(tmp_path):
    # Root may write anywhere, so make the path impossible instead: a parent is a file.
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(PermissionError, match="not writable"):
        CheckpointManager(blocker / "ckpt", keep=1)
    with pytest.raises(PermissionError, match="run dir"):
        ensure_writable_dir(blocker / "run", "run dir")
    with pytest.raises(ValueError, match="keep"):
        CheckpointManager(tmp_path / "ok", keep=0)


# Tiny states for the tests below: every leaf holds the step, so a restored state says which
# checkpoint it came from.

def tiny_state(step: int) -> dict:
    return {"params": {"w": jnp.full((4, 3), float(step)), "b": jnp.full((3,), -float(step))},
            "opt": {"mu": jnp.full((4, 3), 0.5 * step)}, "step": jnp.int32(step)}


TINY = jax.eval_shape(lambda: tiny_state(0))


def save_steps(directory: Path, steps, keep: int = 5) -> None:
    with CheckpointManager(directory, keep=keep) as ckpt:
        for step in steps:
            ckpt.save(step, tiny_state(step), meta={"step": step, "model": {"d_model": 3}})


def test_restores_the_newest_of_several_steps_or_the_one_asked_for(tmp_path):
    save_steps(tmp_path, (10, 20, 30))
    with CheckpointManager(tmp_path, keep=5) as ckpt:
        assert ckpt.all_steps() == [10, 20, 30]
        state, meta = ckpt.restore(TINY)
        assert meta["step"] == 30
        assert_trees_equal(state, tiny_state(30))
        state, meta = ckpt.restore(TINY, step=20)
        assert meta["step"] == 20
        assert_trees_equal(state, tiny_state(20))
        raw, _ = ckpt.restore(None, step=10)  # the saved tree as it is
        np.testing.assert_array_equal(raw["params"]["w"], np.full((4, 3), 10.0))


def _data_file(step_dir: Path) -> Path:
    """The largest file of array data (OCDBT data files are in ``d/`` directories)."""
    return max(_data_files(step_dir), key=lambda f: f.stat().st_size)


def _data_files(step_dir: Path) -> list[Path]:
    return [f for f in (step_dir / "state").rglob("*") if f.is_file() and f.parent.name == "d"]


def _truncate(step_dir: Path) -> None:
    for f in _data_files(step_dir):  # cut every data file short
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _flip_bit(step_dir: Path) -> None:
    f = _data_file(step_dir)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x10  # orbax itself reads this back without complaint
    f.write_bytes(bytes(data))


DAMAGE = {
    "truncated data file": _truncate,
    "bit-flipped data file": _flip_bit,
    "missing _METADATA": lambda d: (d / "state" / "_METADATA").unlink(),
    "garbage _METADATA": lambda d: (d / "state" / "_METADATA").write_text("{garbage"),
    "garbage meta": lambda d: (d / "meta" / "metadata").write_text("\x00\x01 not json"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_latest_checkpoint_is_set_aside_and_the_previous_restored(tmp_path, caplog,
                                                                          damage):
    save_steps(tmp_path, (1, 2, 3))
    DAMAGE[damage](tmp_path / "3")
    files_before = sorted(str(f.relative_to(tmp_path / "3")) for f in (tmp_path / "3").rglob("*"))
    with caplog.at_level(logging.WARNING, logger="transformer_jax.checkpoint.manager"), \
            CheckpointManager(tmp_path, keep=5) as ckpt:
        state, meta = ckpt.restore(TINY)
    assert meta["step"] == 2
    assert_trees_equal(state, tiny_state(2))
    # One line names the damaged checkpoint and why; one says what was restored instead.
    messages = [r.getMessage() for r in caplog.records
                if r.name == "transformer_jax.checkpoint.manager"]
    assert len(messages) == 2 and all("\n" not in m for m in messages), messages
    assert f"{tmp_path / '3'} is damaged" in messages[0] and "3.damaged-1" in messages[0]
    assert str(tmp_path / "2") in messages[1]
    assert not any(r.exc_info for r in caplog.records)
    # Set aside, not deleted, and no longer a step.
    aside = tmp_path / "3.damaged-1"
    assert sorted(str(f.relative_to(aside)) for f in aside.rglob("*")) == files_before
    with CheckpointManager(tmp_path, keep=5) as ckpt:
        assert ckpt.all_steps() == [1, 2]


def test_damaged_explicit_step_is_a_one_line_error(tmp_path):
    save_steps(tmp_path, (1, 2))
    _truncate(tmp_path / "2")
    with CheckpointManager(tmp_path, keep=5) as ckpt:
        with pytest.raises(DamagedCheckpointError) as info:
            ckpt.restore(TINY, step=2)
        # Before the checksums, orbax's own read error is caught the same way.
        (tmp_path / "1" / "CHECKSUMS.json").unlink()
        _truncate(tmp_path / "1")
        with pytest.raises(DamagedCheckpointError, match=r"checkpoint .*1 is damaged") as info1:
            ckpt.restore(TINY, step=1)
    for e in (info.value, info1.value):
        assert "\n" not in str(e) and len(str(e)) < 400, str(e)
        assert e.__cause__ is None and (e.__context__ is None or e.__suppress_context__)
    assert (tmp_path / "2").is_dir()  # an explicit step is never moved


def test_no_intact_checkpoint_is_one_error_naming_the_directory(tmp_path, caplog):
    save_steps(tmp_path, (1, 2))
    _flip_bit(tmp_path / "1")
    (tmp_path / "2" / "state" / "_METADATA").unlink()
    with CheckpointManager(tmp_path, keep=5) as ckpt, pytest.raises(
            CheckpointError, match=f"no intact checkpoint in {tmp_path}: step 2: .*; step 1: "):
        ckpt.restore(TINY)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1.damaged-1", "2.damaged-1"]


def test_uncommitted_directories_are_never_picked(tmp_path):
    save_steps(tmp_path, (1,))
    # A newer save that never committed, under orbax's temporary names.
    for name in ("7.orbax-checkpoint-tmp", "8.orbax-checkpoint-tmp-1712345678"):
        shutil.copytree(tmp_path / "1", tmp_path / name)
    with CheckpointManager(tmp_path, keep=5) as ckpt:
        state, meta = ckpt.restore(TINY)
        assert meta["step"] == 1 and ckpt.read_meta()["step"] == 1
    assert (tmp_path / "7.orbax-checkpoint-tmp").is_dir()


def test_another_model_is_named_before_any_array_is_read(tmp_path):
    save_steps(tmp_path, (1,))
    with CheckpointManager(tmp_path, keep=5) as ckpt:
        assert ckpt.read_meta() == {"step": 1, "model": {"d_model": 3}}
        assert ckpt.read_meta(1) == ckpt.read_meta()
        other = {**TINY, "params": {"w": jax.ShapeDtypeStruct((4, 5), jnp.float32),
                                    "c": jax.ShapeDtypeStruct((3,), jnp.float32)}}
        with pytest.raises(CheckpointMismatchError) as info:
            ckpt.restore(other)
    message = str(info.value)
    assert "\n" not in message and len(message) < 600
    assert "params/w is [4, 3] in the checkpoint, [4, 5] requested" in message
    assert "params/c is not in the checkpoint" in message
    assert "params/b [3] is saved but not requested" in message
    assert (tmp_path / "1").is_dir()  # a mismatch is not damage: nothing is moved


def test_resuming_with_another_model_names_the_differences(tmp_path, states):
    from transformer_jax.model.config import ModelConfig
    from transformer_jax.train.config import TrainConfig
    from transformer_jax.train.step import make_init_fn

    _, _, state, _ = states
    with CheckpointManager(tmp_path, keep=2) as ckpt:
        ckpt.save(3, state, meta={"model": {"d_model": 32, "n_layers": 2}})
    wider = ModelConfig(vocab_size=40, d_model=48, n_layers=3, n_heads=2, d_ff=64,
                        max_seq_len=16)
    init = make_init_fn(wider, TrainConfig(steps=10, batch_size=4, seq_len=8, warmup_steps=1))
    with CheckpointManager(tmp_path, keep=2) as ckpt:
        assert ckpt.read_meta()["model"] == {"d_model": 32, "n_layers": 2}
        with pytest.raises(CheckpointMismatchError) as info:
            ckpt.restore(jax.eval_shape(init, jax.random.key(0)))
    message = str(info.value)
    assert "\n" not in message and len(message) < 1500, message
    assert "in the checkpoint" in message and "more" in message
    assert len(info.value.differences) > 8
    assert (tmp_path / "3").is_dir()


def test_restore_params_reads_only_the_params(tmp_path):
    save_steps(tmp_path, (1, 2))
    with CheckpointManager(tmp_path, keep=5) as ckpt:
        params, meta = ckpt.restore_params()
        assert meta["step"] == 2
        assert_trees_equal(params, tiny_state(2)["params"])
        params, _ = ckpt.restore_params(TINY["params"], step=1)
        assert_trees_equal(params, tiny_state(1)["params"])
        with pytest.raises(CheckpointMismatchError, match=r"params/w is \[4, 3\] in the "):
            ckpt.restore_params({"w": jax.ShapeDtypeStruct((2, 2), jnp.float32),
                                 "b": TINY["params"]["b"]}, step=1)


def test_full_disk_is_one_error_and_keeps_the_earlier_checkpoints(tmp_path, caplog):
    async def no_space(self, x, directory):
        raise OSError(errno.ENOSPC, "No space left on device", str(directory))

    ckpt = CheckpointManager(tmp_path, keep=1)
    ckpt.save(1, tiny_state(1), meta={"step": 1})
    ckpt.wait()
    with caplog.at_level(logging.DEBUG, logger="absl"), \
            mock.patch.object(json_checkpoint_handler.JsonCheckpointHandler, "_save_fn",
                              no_space), \
            pytest.raises(CheckpointError) as info:
        ckpt.save(2, tiny_state(2), meta={"step": 2})
        ckpt.wait()
    assert str(info.value) == f"could not write checkpoint {tmp_path / '2'}: " \
                              "No space left on device"
    assert info.value.__cause__ is None and info.value.__suppress_context__
    with pytest.raises(CheckpointError, match="No space left"):
        ckpt.wait()  # the same error again, not a new traceback
    ckpt.close()  # quiet: the failure was reported
    # orbax's tracebacks of the background threads stay out of the log.
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR and r.exc_info]
    # The earlier checkpoint is kept (keep=1 did not rotate it away) and nothing partial is left.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1"]
    with CheckpointManager(tmp_path, keep=1) as fresh:
        state, meta = fresh.restore(TINY)
    assert meta["step"] == 1
    assert_trees_equal(state, tiny_state(1))


def test_reading_the_latest_of_a_live_run_that_rotates_checkpoints(tmp_path):
    """A trainer saving with keep=1 in a loop while another manager reads the latest."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def trainer() -> None:
        try:
            with CheckpointManager(tmp_path, keep=1) as ckpt:
                step = 1
                while not stop.is_set():
                    ckpt.save(step, tiny_state(step), meta={"step": step})
                    step += 1
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    thread = threading.Thread(target=trainer, daemon=True)
    thread.start()
    reads, seen = 0, set()
    try:
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and not errors:
            if not any(p.name.isdigit() for p in tmp_path.iterdir()):
                continue
            with CheckpointManager(tmp_path, keep=1) as reader:
                if reads % 2:
                    params, meta = reader.restore_params(TINY["params"])
                    assert_trees_equal(params, tiny_state(meta["step"])["params"])
                else:
                    state, meta = reader.restore(TINY, quarantine=False)
                    assert_trees_equal(state, tiny_state(meta["step"]))
            reads += 1
            seen.add(meta["step"])
    finally:
        stop.set()
        thread.join(timeout=30)
    assert not errors, errors
    assert reads >= 4 and len(seen) >= 2, (reads, seen)
    assert not any("damaged" in p.name for p in tmp_path.iterdir())
