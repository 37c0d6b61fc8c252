"""A run directory written by an earlier version (``tests/data/legacy_run``, commit 9e62d04, whose
saved model config still held ``weights_out_first``) resumes exactly where it stopped, and
exports to a HF directory holding its weights."""

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from transformer_jax import hf
from transformer_jax.checkpoint.manager import CheckpointManager
from transformer_jax.model.config import ModelConfig
from transformer_jax.train import run as training
from transformer_jax.train.config import build_configs

LEGACY = Path(__file__).parent / "data" / "legacy_run"
# The command that wrote it (its README), continued to 6 steps.
OVERRIDES = [
    "model.d_model=16", "model.n_layers=2", "model.n_heads=2", "model.d_ff=32",
    "model.max_seq_len=32", "train.batch_size=2", "train.seq_len=16", "train.warmup_steps=1",
    "train.ckpt_every=2", "train.eval_every=0", "train.eval_batches=1", "train.sample_tokens=0",
    "train.run_dir=run", "data.path=corpus.txt", "data.tokenizer=char", "data.cache_dir=cache",
    "data.val_fraction=0.1"]


@pytest.fixture
def legacy(tmp_path, monkeypatch):
    """A writable copy of the legacy run, as the working directory (its paths are relative)."""
    shutil.copytree(LEGACY, tmp_path / "legacy")
    monkeypatch.chdir(tmp_path / "legacy")
    return tmp_path / "legacy"


def _saved_params(run: Path, step: int = 4):
    with CheckpointManager(run / "checkpoints", async_save=False) as manager:
        params, meta = manager.restore_params(None, step)
    return params, meta


def test_the_fixture_holds_the_retired_key():
    """What makes it legacy: its saved model config names a key this version no longer has."""
    meta = json.loads((LEGACY / "run" / "checkpoints" / "4" / "meta" / "metadata").read_text())
    assert meta["model"]["weights_out_first"] is False
    assert "weights_out_first" not in ModelConfig().to_dict()


def test_a_legacy_run_resumes_where_it_stopped(legacy):
    before, _ = _saved_params(legacy / "run")
    model, train, data = build_configs("tiny", [*OVERRIDES, "train.steps=6"])
    summary = training.run(model, train, data, progress=False)
    assert summary.start_step == 4 and summary.final_step == 6
    after, _ = _saved_params(legacy / "run")
    jax.tree.map(np.testing.assert_array_equal, after, before)  # step 4 itself is untouched
    newest, meta = _saved_params(legacy / "run", 6)
    assert meta["step"] == 6 and "weights_out_first" not in meta["model"]
    assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(newest),
                                                        jax.tree.leaves(before), strict=True))


def test_a_legacy_run_exports_its_weights(legacy):
    from transformer_jax.cli.export import export

    out = export(legacy / "run", legacy / "hf", use_tokenizer=False)
    config, params = hf.load(out)
    saved, meta = _saved_params(legacy / "run")
    assert config.architecture == ModelConfig.from_dict(meta["model"]).architecture
    jax.tree.map(np.testing.assert_array_equal, params, saved)
