"""``transformer-jax compile --save`` and ``train.compiled_step``: a run that loads the saved
train step trains exactly as one that compiles its own, a run it was not compiled for is refused
in one line, and a step compiled for a TPU topology is saved (loading it needs that TPU)."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from transformer_jax.cli import compile as compile_cli
from transformer_jax.train import executable
from transformer_jax.train import run as training
from transformer_jax.train.config import build_configs

TINY = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1",
        "model.d_ff=64", "model.max_seq_len=32", "train.seq_len=16", "train.batch_size=4",
        "train.steps=3", "train.warmup_steps=1", "train.log_every=1", "train.eval_every=0",
        "train.eval_batches=1", "train.sample_tokens=0", "train.ckpt_every=3",
        "data.tokenizer=char", "data.val_fraction=0.1"]


def _losses(run_dir) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r["split"] == "train"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A corpus, the overrides of a tiny run on it, and that run's losses and vocabulary,
    trained the usual way (its step compiled by the run)."""
    tmp = tmp_path_factory.mktemp("compiled_step")
    rng = np.random.default_rng(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "ran"]
    (tmp / "corpus.txt").write_text("".join(" ".join(rng.choice(words, 6)) + ".\n"
                                            for _ in range(300)))
    overrides = [*TINY, f"data.path={tmp / 'corpus.txt'}", f"data.cache_dir={tmp / 'cache'}"]
    _train(overrides, tmp / "usual")
    vocab = json.loads((tmp / "usual" / "config.json").read_text())["model"]["vocab_size"]
    return tmp, overrides, _losses(tmp / "usual"), vocab


def _train(overrides, run_dir):
    model, tc, data = build_configs("tiny", [*overrides, f"train.run_dir={run_dir}"])
    return training.run(model, tc, data, progress=False, memory_check=False)


def test_a_run_with_the_saved_step_gives_the_losses_of_one_that_compiles_it(base, capsys,
                                                                           monkeypatch):
    tmp, overrides, losses, vocab = base
    path = tmp / "step.bin"
    # This host's devices (no --topology), over the run's mesh; the process's XLA flags as
    # they are (--no-fast-math: fast math is for a process whose backend has not started).
    # Twice: the first compile leaves the program in the run's persistent compilation cache
    # (conftest.py), where the second would find it; an XLA:CPU executable loaded from that
    # cache serializes without its code, so --save must compile afresh.
    for _ in range(2):
        assert compile_cli.main(["--save", str(path), "--no-fast-math", *overrides,
                                 f"model.vocab_size={vocab}"]) == 0
        assert f"train.compiled_step={path}" in capsys.readouterr().out
    calls = []
    load = executable.load

    def counting_load(*args):
        step = load(*args)
        return lambda state, batch: calls.append(1) or step(state, batch)

    monkeypatch.setattr(executable, "load", counting_load)
    # A checkpoint at step 2 too (a run-only key: the step is the same program).
    loaded = [*overrides, f"train.compiled_step={path}", "train.ckpt_every=2"]
    _train(loaded, tmp / "loaded")
    assert len(calls) == 3  # every step ran the loaded program
    assert _losses(tmp / "loaded") == losses  # bit for bit
    # Resumed from step 2 (the last checkpoint lost), the loaded step gives step 3 again.
    shutil.rmtree(tmp / "loaded" / "checkpoints" / "3")
    summary = _train(loaded, tmp / "loaded")
    assert (summary.start_step, summary.train_loss, len(calls)) == (2, losses[-1], 4)


@pytest.mark.parametrize("change, message", [
    (["train.batch_size=8"], "was compiled for another config: train.batch_size 4 there, "
                             "8 here$"),
    (["train.lr=0.01", "model.d_ff=32"], "another config: model.d_ff 64 there, 32 here; "
                                         "train.lr 0.003 there, 0.01 here$"),
    (["train.objective=dpo"], "holds the sft train step"),
])
def test_a_run_it_was_not_compiled_for_is_refused_before_any_data(base, change, message):
    tmp, overrides, _, vocab = base
    path = tmp / "refused.bin"
    if not path.exists():
        compile_cli.compile_report("tiny", [*overrides, f"model.vocab_size={vocab}"], None,
                                   save=str(path))
    run_dir = tmp / "refused"
    with pytest.raises(ValueError, match=message) as e:
        _train([*overrides, *change, f"train.compiled_step={path}"], run_dir)
    assert "\n" not in str(e.value)
    assert not run_dir.exists() or not any(run_dir.iterdir())  # refused before it wrote any
    model, tc, _ = build_configs("tiny", [*overrides, f"model.vocab_size={vocab}"])
    n = jax.device_count()
    mesh = Mesh(np.array(jax.devices()).reshape(1, n, 1), ("data", "fsdp", "tensor"))
    executable.check_header(path, model, tc, Mesh(
        np.array(jax.devices()).reshape(n, 1, 1), ("data", "fsdp", "tensor")))  # the run's
    if n > 1:
        with pytest.raises(ValueError, match="compiled for another mesh: mesh"):
            executable.check_header(path, model, tc, mesh)
    with pytest.raises(ValueError, match=rf"another mesh: mesh {{'data': {n}, 'fsdp': 1, "
                       rf"'tensor': 1}} there, {{'data': {n}, 'fsdp': 1, 'expert': 1}} here; set "
                       "train.mesh to the compile's$"):
        executable.check_header(path, model, tc, Mesh(np.array(jax.devices()).reshape(n, 1, 1),
                                                      ("data", "fsdp", "expert")))


def test_a_step_compiled_for_another_vocabulary_is_refused_with_the_fix(base):
    tmp, overrides, _, vocab = base
    path = tmp / "vocab.bin"
    compile_cli.compile_report("tiny", overrides, None, save=str(path))  # the preset's vocab
    with pytest.raises(ValueError, match=rf"model.vocab_size 2048 there, {vocab} here \(a run "
                       "takes its tokenizer's vocab_size: pass that model.vocab_size"):
        _train([*overrides, f"train.compiled_step={path}"], tmp / "vocab")
    assert not list((tmp / "vocab").glob("checkpoints/*"))  # refused before any step
    with pytest.raises(ValueError, match="is not a train step written by `transformer-jax "
                       "compile --save`"):
        _train([*overrides, f"train.compiled_step={tmp / 'corpus.txt'}"], tmp / "other")


def test_a_step_compiled_for_a_tpu_topology_is_saved_and_refused_here(base, tmp_path, capsys,
                                                                     monkeypatch):
    pytest.importorskip("libtpu")
    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    _, overrides, _, _ = base
    path = tmp_path / "v5e.bin"
    assert compile_cli.main(["--topology", "v5e:2x2", "--save", str(path), *overrides,
                             "model.vocab_size=64", "model.attention_impl=xla"]) == 0
    assert f"train.compiled_step={path}" in capsys.readouterr().out
    header = executable.read_header(path)
    assert (header["platform"], header["device_kind"], header["devices"]) == (
        "tpu", "TPU v5 lite", 4)
    assert header["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1}
    assert header["inputs"]["[0][1]['inputs']"] == "int32[4, 16]"
    assert path.stat().st_size > len(executable.MAGIC) + 1000  # the executable follows
    model, tc, _ = build_configs("tiny", [*overrides, "model.vocab_size=64",
                                          "model.attention_impl=xla"])
    from transformer_jax.parallel.mesh import MeshConfig, make_mesh

    with pytest.raises(ValueError, match="compiled for other devices: device_kind 'TPU v5 "
                       f"lite' there, 'cpu' here; devices 4 there, {jax.device_count()} here"):
        executable.check_header(path, model, tc, make_mesh(MeshConfig.parse("-1,1,1")))


def test_the_step_may_be_read_from_object_storage(tmp_path, monkeypatch):
    import fsspec

    monkeypatch.setenv("TRANSFORMER_JAX_CACHE", str(tmp_path / "cache"))
    fs = fsspec.filesystem("memory")
    fs.pipe("/compiled-step-test/step.bin", executable.MAGIC + b'{"devices": 4}\n' + b"\x80")
    try:
        assert executable.read_header("memory://compiled-step-test/step.bin") == {"devices": 4}
    finally:
        fs.rm("/compiled-step-test", recursive=True)
