"""Multi-process training through jax.distributed: two local processes with 4 simulated CPU
devices each (gloo collectives) against one process (on one device), plus a shared checkpoint.

Every process is a subprocess running ``tests/multihost_worker.py``; this pytest process keeps
its single device, on which it trains the LoRA run the processes load, and the reference: the
processes' steps, then their checkpoint restored (``multihost_worker.check``).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import jax
import multihost_worker as worker
import numpy as np
import pytest

from transformer_jax.checkpoint.manager import CHECKSUMS_FILE, CheckpointManager, verify_checksums
from transformer_jax.parallel import distributed
from transformer_jax.parallel import sharding as sh

N_PROCESSES, DEVICES_PER_PROCESS = 2, 4


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _lora_run(root: Path) -> Path:
    """A two-step LoRA run of a tiny one-layer model, for the processes to init_from: in this
    process (its single device), through the library's ``training.run`` as ``train.py`` calls
    it, without its loss plot or a validation split (nothing here looks at them)."""
    from transformer_jax.train import run as training
    from transformer_jax.train.config import build_configs

    rng = np.random.default_rng(0)
    corpus = root / "corpus.txt"
    corpus.write_text("".join(" ".join(rng.choice(["ab", "cd", "ef", "gh"], 6)) + "\n"
                              for _ in range(200)))
    run_dir = root / "lora_run"
    model, train, data = build_configs("tiny", [
        "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.d_ff=64",
        "model.max_seq_len=32", "train.seq_len=16", "train.batch_size=8", "train.steps=2",
        "train.lr=0.05", "train.lora_rank=2", "train.sample_tokens=0",
        "data.tokenizer=char", "data.val_fraction=0", "train.peak_flops=1e9", f"data.path={corpus}",
        f"data.cache_dir={root / 'cache'}", f"train.run_dir={run_dir}"])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(training, "_plot", lambda run_dir, times: None)
        training.run(model, train, data, progress=False)
    return run_dir


def _shard_build(root: Path) -> Path:
    """A small shard build (jsonl documents, a word-level tokenizer) for the processes."""
    from helpers import write_word_docs

    from transformer_jax.data import build
    from transformer_jax.tokenizer import load_tokenizer

    docs, tok = write_word_docs(root, 120)
    build.build([str(docs)], root / "shards", load_tokenizer(tok), progress=False,
                options=build.BuildOptions(shard_bytes=1500))
    return root / "shards"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("multihost")
    ckpt = root / "ckpt"
    lora_run = _lora_run(root)
    shards = _shard_build(root)
    coordinator = f"127.0.0.1:{_free_port()}"
    procs = [subprocess.Popen(
        [sys.executable, worker.__file__, "train", "--coordinator", coordinator,
         "--num-processes", str(N_PROCESSES), "--process-id", str(i), "--ckpt", str(ckpt),
         "--init-from", str(lora_run), "--shards", str(shards)],
        cwd=worker.ROOT, env=worker.worker_env(DEVICES_PER_PROCESS), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True) for i in range(N_PROCESSES)]
    results = []
    try:
        for i, proc in enumerate(procs):
            out, err = proc.communicate(timeout=300)
            if proc.returncode:
                pytest.fail(f"process {i} failed:\n{err[-4000:]}")
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    check = worker.check(ckpt)  # here, on this process's one device
    return {"processes": results, "single": check, "ckpt": ckpt, "lora_run": lora_run,
            "shards": shards,
            "init_from": dict(np.load(root / "init_from.npz"))}


def test_processes_see_one_global_mesh(runs):
    for i, r in enumerate(runs["processes"]):
        assert r["process"] == i
        assert r["local_devices"] == DEVICES_PER_PROCESS
        assert r["global_devices"] == N_PROCESSES * DEVICES_PER_PROCESS
        assert r["main"] == (i == 0)
        # A flag raised on the last process only (think SIGTERM) is seen by all of them.
        assert r["any_last"] is True and r["any_none"] is False


def test_each_process_loads_only_its_batch_rows(runs):
    # Mesh (2, 2, 2): the data axis spans the processes, so each loads half the batch; with
    # (1, 1, 8) the batch is replicated and both load all of it.
    for i, r in enumerate(runs["processes"]):
        assert r["batch_shard"] == [i, N_PROCESSES]
        assert r["tp_batch_shard"] == [0, 1]


def test_each_process_reads_its_rows_of_the_same_global_shard_batches(runs):
    # Two real processes, each reading only its half: together the one-process global batch
    # (packed and concat), step by step.
    from transformer_jax.data import shards

    mixture = shards.Mixture.parse(str(runs["shards"]), "")
    for packing in shards.PACKING:
        one = shards.ShardBatches(mixture, worker.SEQ, worker.BATCH, packing, seed=0)
        for step in range(3):
            parts = [np.asarray(r["shard_rows"][packing][step]) for r in runs["processes"]]
            assert all(len(p) == worker.BATCH // N_PROCESSES for p in parts)
            assert np.array_equal(np.concatenate(parts), one.get(step)["inputs"]), packing


def test_two_processes_reach_the_single_process_losses(runs):
    single = runs["single"]["losses"]
    assert len(single) >= 2
    for r in runs["processes"]:
        assert r["losses"] == pytest.approx(single, rel=1e-6, abs=1e-6)


def test_shared_checkpoint_restores_in_one_process(runs):
    single = runs["single"]
    assert single["restored_specs_match"]
    assert single["saved_losses"] == runs["processes"][0]["losses"]
    assert any(p.startswith("params/") for p in single["diff"])
    for path, diff in single["diff"].items():
        # Same bounds as the mesh-vs-single-device test (see test_sharding.py).
        limit = 1e-7 if "/mu/" in path else 1e-9 if "/nu/" in path else 1e-5
        assert diff < limit, (path, diff)


def test_init_from_a_lora_run_places_its_merged_params_across_processes(runs):
    # Each process merges the adapters into the base on its host and places its devices'
    # shards; gathered, they are exactly what one process merges.
    from transformer_jax.checkpoint import loading

    loaded = loading.load(runs["lora_run"], with_tokenizer=False)
    merged = loaded.params
    assert loaded.meta["lora"]["rank"] == 2
    want = worker._flat(jax.tree.map(np.asarray, merged))
    got = runs["init_from"]
    assert got.keys() == want.keys()
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    base = CheckpointManager(runs["lora_run"] / "checkpoints", async_save=False)
    params, _ = base.restore_params()
    q = "blocks_0/attn/q_proj"
    assert not np.array_equal(np.asarray(params["base"]["blocks_0"]["attn"]["q_proj"]), got[q])


def test_shared_checkpoint_is_summed_once(runs):
    # One process (the primary) writes the checksums; none of the writers' temporary files
    # is left behind or listed, and the sums match the files.
    (step_dir,) = [d for d in runs["ckpt"].iterdir() if d.name.isdigit()]
    sums = json.loads((step_dir / CHECKSUMS_FILE).read_text())
    assert sums and not [n for n in sums if n.endswith(".tmp")]
    assert not list(step_dir.rglob("*.tmp"))
    verify_checksums(step_dir)


# ------------------------------------------------------------------ in-process, one device


def _clear_env(monkeypatch):
    for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
                "SLURM_JOB_ID", "SLURM_NTASKS", "OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


def test_single_process_needs_no_initialisation(monkeypatch):
    _clear_env(monkeypatch)
    assert distributed.maybe_initialize() is False
    assert distributed.maybe_initialize(num_processes=1, process_id=0) is False
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    assert distributed.maybe_initialize() is False
    assert distributed.is_main_process()


@pytest.mark.parametrize("kwargs, env, message", [
    (dict(num_processes=2, process_id=0), {}, "needs coordinator_address"),
    (dict(coordinator_address="127.0.0.1:1234", num_processes=2), {}, "process_id=None"),
    (dict(coordinator_address="127.0.0.1:1234", process_id=1), {}, "num_processes"),
    (dict(coordinator_address="127.0.0.1:1234", num_processes=2, process_id=2), {},
     r"process_id must be in \[0, 2\), got 2"),
    (dict(num_processes=1, process_id=3), {}, "must be 0 with one process"),
    ({}, {"JAX_NUM_PROCESSES": "two"}, "JAX_NUM_PROCESSES must be an integer"),
    ({}, {"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}, "JAX_COORDINATOR_ADDRESS"),
])
def test_incomplete_distributed_settings_are_clear_errors(monkeypatch, kwargs, env, message):
    _clear_env(monkeypatch)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=message):
        distributed.maybe_initialize(**kwargs)


def test_single_process_batch_is_the_whole_global_batch():
    mesh = sh.make_mesh(sh.MeshConfig())
    sharding = sh.batch_sharding(mesh)
    assert distributed.process_batch_shard(sharding, 6) == (0, 1)
    local = {"inputs": np.arange(12, dtype=np.int32).reshape(6, 2)}
    arrays = distributed.global_batch(local, sharding, 6)
    assert arrays["inputs"].shape == (6, 2) and arrays["inputs"].sharding == sharding
    np.testing.assert_array_equal(np.asarray(arrays["inputs"]), local["inputs"])
