"""Tests for transformer_jax.checkpoint: round trips, keep-K, temporary dirs, errors."""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.checkpoint import CheckpointManager, ensure_writable_dir
from transformer_jax.config import ModelConfig
from transformer_jax.training import TrainConfig, make_init_fn, make_train_step

MODEL = ModelConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=16)
TRAIN = TrainConfig(steps=10, batch_size=4, seq_len=8, warmup_steps=1)


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
    init = jax.jit(make_init_fn(MODEL, TRAIN))
    step = jax.jit(make_train_step(MODEL, TRAIN), donate_argnums=0)
    state0 = init(jax.random.key(0))
    rng = np.random.default_rng(0)
    state = jax.tree.map(jnp.copy, state0)
    for _ in range(3):
        tokens = rng.integers(0, MODEL.vocab_size, (4, 9)).astype(np.int32)
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
