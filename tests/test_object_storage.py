"""Runs on object storage, end to end, against a GCS emulator on loopback.

``tests/gcs_emulator.py`` serves a bucket ``bkt`` on 127.0.0.1; gcsfs (file operations, through
``STORAGE_EMULATOR_HOST``) and tensorstore (orbax's arrays, through ``TENSORSTORE_GCS_HTTP_URL``)
reach it as they would reach GCS. One module fixture does what a pod user does: builds shards
into the bucket with two workers, trains two ``jax.distributed`` processes from them with the run
directory (checkpoints included) in the bucket, is killed halfway through a save (left as what a
kill leaves in a bucket: a step directory without orbax's commit file), resumes on one process,
exports to the bucket and generates from it. The one-process resumes (from the bucket, and the
local reference) run in this pytest process through the library's ``training.run``, the call
``train.py`` makes; only the two-process run needs processes of its own.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import logged, with_fast_flags, write_word_docs

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RUN = "gs://bkt/run"
MODEL = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.d_ff=64",
         "model.max_seq_len=32"]
TRAIN = ["train.seq_len=16", "train.batch_size=8", "train.lr=0.01", "train.eval_batches=1",
         "train.sample_tokens=0", "train.ckpt_every=2", "train.eval_every=2",
         "data.path=gs://bkt/shards", "train.peak_flops=1e9"]  # MFU's peak given, not measured


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def bucket(tmp_path_factory):
    """The emulator, and this process's environment pointed at it (restored afterwards)."""
    port = _free_port()
    log = tmp_path_factory.mktemp("emulator") / "emulator.log"  # it logs every request
    with open(log, "w") as out:
        emulator = subprocess.Popen([sys.executable, str(HERE / "gcs_emulator.py"), "--port",
                                     str(port)], stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert emulator.poll() is None, log.read_text()[-2000:]
            assert time.monotonic() < deadline, "the GCS emulator did not start"
            time.sleep(0.1)
    url = f"http://127.0.0.1:{port}"
    env = {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url,
           "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test",
           # gcsfs asks a bucket for its layout (hierarchical namespace), which the emulator
           # does not serve.
           "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
           "TRANSFORMER_JAX_CACHE": str(tmp_path_factory.mktemp("cache"))}
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        yield env
    emulator.terminate()
    emulator.wait(timeout=10)


def _train(args: list[str], env: dict, cwd: Path, processes: int = 1) -> list[str]:
    """``train.py`` on ``processes`` jax.distributed processes (one CPU device each); their
    stderr, each process's own file (a pipe left unread would block a process)."""
    full_env = dict(os.environ, **env, PYTHONPATH=str(ROOT),
                    XLA_FLAGS=with_fast_flags("--xla_force_host_platform_device_count=1"))
    command = [sys.executable, str(ROOT / "train.py"), "--no-progress", "--cpu-devices", "1",
               *MODEL, *TRAIN, *args]
    coordinator = f"127.0.0.1:{_free_port()}"
    logs = [cwd / f"train-{time.monotonic_ns()}-{i}.log" for i in range(processes)]
    procs = []
    for i, log in enumerate(logs):
        extra = ([] if processes == 1 else ["--coordinator-address", coordinator,
                                            "--num-processes", str(processes),
                                            "--process-id", str(i)])
        with open(log, "w") as out:
            procs.append(subprocess.Popen(command + extra, cwd=cwd, env=full_env,
                                          stdout=subprocess.DEVNULL, stderr=out))
    try:
        for proc, log in zip(procs, logs, strict=True):
            assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return [log.read_text() for log in logs]


def _train_here(args: list[str]) -> str:
    """The one-process ``train.py`` run of ``args`` in this process (its single CPU device), as
    ``train.py`` makes it: ``build_configs`` then ``training.run`` (without redrawing the loss
    plot, which the two-process run drew and nothing here looks at again); its log lines."""
    from transformer_jax.train import run as training
    from transformer_jax.train.config import build_configs

    model, train, data = build_configs("tiny", [*MODEL, *TRAIN, *args])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(training, "_plot", lambda run_dir, times: None)
        return logged(lambda: training.run(model, train, data, progress=False))[1]


def _step_params(checkpoints, step: int):
    from transformer_jax.checkpoint.manager import CheckpointManager

    with CheckpointManager(checkpoints, read_only=True) as reader:
        params, _ = reader.restore_params(None, step)
    return params


@pytest.fixture(scope="module")
def pod(bucket, tmp_path_factory):
    from etils import epath

    from transformer_jax import storage
    from transformer_jax.checkpoint.files import disk_steps
    from transformer_jax.data import build
    from transformer_jax.tokenizer import load_tokenizer

    work = tmp_path_factory.mktemp("pod")
    docs, tok = write_word_docs(work, 300)
    meta = build.build([str(docs)], "gs://bkt/shards", load_tokenizer(tok), workers=2,
                       progress=False, options=build.BuildOptions(shard_bytes=3000,
                                                                  val_fraction=0.3))
    two = _train(["train.steps=4", f"train.run_dir={RUN}"], bucket, work, processes=2)
    checkpoints = epath.Path(RUN) / "checkpoints"
    after_two = {"steps": disk_steps(checkpoints),
                 "names": sorted(p.name for p in epath.Path(RUN).iterdir()),
                 "metrics": (epath.Path(RUN) / "metrics.jsonl").read_text()}
    # What the bucket holds now, as a local run directory: the reference resumes from it.
    reference = work / "reference"
    shutil.copytree(storage.local_copy(RUN, purpose="reference"), reference)
    # A kill during the save of step 6 leaves its objects without orbax's commit file.
    fs, _ = storage.filesystem(RUN)
    fs.copy("bkt/run/checkpoints/4/meta", "bkt/run/checkpoints/6/meta", recursive=True)
    assert not (checkpoints / "6" / "commit_success.txt").exists()
    one = _train_here(["train.steps=6", f"train.run_dir={RUN}"])
    _train_here(["train.steps=6", f"train.run_dir={reference}"])
    return {"work": work, "meta": meta, "two": two, "after_two": after_two, "one": one,
            "reference": reference, "checkpoints": checkpoints}


def test_a_build_into_a_bucket_is_read_back_whole(pod):
    from etils import epath

    from transformer_jax import storage
    from transformer_jax.data import shards

    shards_dir = epath.Path("gs://bkt/shards")
    assert shards.is_build("gs://bkt/shards")
    names = {p.name for p in shards_dir.iterdir()}
    assert {"metadata.json", "tokenizer"} <= names
    assert len(pod["meta"]["shards"]) > 1  # several shards, built by the two workers
    assert json.loads((shards_dir / "metadata.json").read_text()) == {
        k: v for k, v in pod["meta"].items() if k not in ("build_tokens", "build_seconds")}
    copy = storage.local_copy("gs://bkt/shards", purpose="data")
    for rel, info in storage._remote_files("gs://bkt/shards").items():
        assert (copy / rel).stat().st_size == info["size"]


def test_two_processes_train_from_the_bucket_with_their_checkpoints_in_it(pod):
    for log in pod["two"]:
        assert "(2 processes)" in log and "gs://bkt/shards" in log
    after = pod["after_two"]
    assert after["steps"] == [2, 4]
    # The run's small files reached the bucket from the main process's mirror.
    assert {"checkpoints", "config.json", "metrics.jsonl", "summary.json", "tokenizer",
            "loss.png", "tb"} <= set(after["names"])
    evals = [json.loads(line) for line in after["metrics"].splitlines()]
    assert [r["step"] for r in evals if r.get("split") == "val"] == [2, 4]


def test_a_resume_on_one_process_skips_the_killed_save_and_equals_a_local_resume(pod):
    from etils import epath

    from transformer_jax.checkpoint.files import disk_steps

    log = pod["one"]
    assert "resumed from gs://bkt/run/checkpoints/4 (step 4)" in log
    assert "removed the unfinished save 6" in log
    assert disk_steps(pod["checkpoints"]) == [2, 4, 6]
    bucket_params = _step_params(pod["checkpoints"], 6)
    local_params = _step_params(pod["reference"] / "checkpoints", 6)
    for a, b in zip(jax.tree.leaves(bucket_params), jax.tree.leaves(local_params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    rows = [json.loads(line) for line in
            (epath.Path(RUN) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r.get("split") == "val"] == [2, 4, 6]  # none twice
    summary = json.loads((epath.Path(RUN) / "summary.json").read_text())
    assert summary["run_dir"] == RUN and summary["final_step"] == 6
    assert summary["checkpoint"] == f"{RUN}/checkpoints/6"


def test_export_and_generate_from_the_bucket(pod, capsys):
    import importlib

    from etils import epath

    from transformer_jax.cli import export as hf_export

    generate = importlib.import_module("transformer_jax.cli.generate")
    assert hf_export.main(["--checkpoint", RUN, "--out", "gs://bkt/hf"]) in (0, None)
    names = {p.name for p in epath.Path("gs://bkt/hf").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names

    def tokens(checkpoint) -> dict:
        capsys.readouterr()
        generate.main(["--checkpoint", str(checkpoint), "--prompt-ids", "3,4,5",
                       "--max-new-tokens", "6", "--json"])
        out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        return {k: v for k, v in out.items() if k != "seconds"}

    from_run = tokens(RUN)
    assert from_run == tokens(pod["reference"])
    assert tokens("gs://bkt/hf") == from_run
    # An export never writes over a run's own files, in a bucket as on disk.
    with pytest.raises(FileExistsError, match="training run"):
        hf_export.export(RUN, RUN)


def test_a_run_in_a_missing_bucket_fails_in_one_line_before_training(bucket):
    from transformer_jax.train import run as training
    from transformer_jax.train.config import build_configs

    model, train, data = build_configs("tiny", [*MODEL, "train.steps=1", "train.seq_len=16",
                                                "train.batch_size=2",
                                                "train.run_dir=gs://no-such-bucket/run"])
    with pytest.raises(FileNotFoundError, match="the bucket no-such-bucket does not exist"):
        training.run(model, train, data, progress=False)


def _hf_dir(path: Path, seed: int) -> Path:
    """A tiny HF checkpoint (no tokenizer) whose weights depend on ``seed``, shapes not."""
    from helpers import TINY

    from transformer_jax import hf
    from transformer_jax.model.transformer import abstract_params

    rng = np.random.default_rng(seed)
    params = jax.tree.map(lambda s: rng.normal(0, 0.2, s.shape).astype(s.dtype),
                          abstract_params(TINY))
    hf.save(TINY, params, path)
    return path


def test_a_bucket_lists_the_versions_the_cache_is_keyed_by(bucket, tmp_path):
    from transformer_jax import storage
    from transformer_jax.storage import versions

    local = tmp_path / "files"
    local.mkdir()
    (local / "sub").mkdir(parents=True)
    (local / "a.bin").write_bytes(b"aaaa")
    (local / "sub" / "b.bin").write_bytes(b"bbbb")
    assert storage.push(local, "gs://bkt/versions") == 2
    listed = storage._remote_files("gs://bkt/versions")
    for entry in listed.values():  # from ls (a.bin) and from find (sub/b.bin)
        assert entry["generation"] and entry["crc32c"] and entry["md5Hash"]
    assert storage.push(local, "gs://bkt/versions") == 0  # the bucket's CRC32C is the file's
    copy = storage.local_copy("gs://bkt/versions")
    records = versions.read_records(copy)
    assert set(records) == {"a.bin", "sub/b.bin"}  # keyed by the objects' versions
    assert json.loads(records["a.bin"][0])["generation"] == listed["a.bin"]["generation"]
    single = storage.local_copy("gs://bkt/versions/sub/b.bin")  # one file, from fs.info
    assert single.read_bytes() == b"bbbb"
    single_record = versions.read_records(single.parent)["b.bin"]
    assert json.loads(single_record[0])["generation"] == listed["sub/b.bin"]["generation"]


def test_an_export_over_an_export_is_read_back_new_not_from_the_cache(bucket, tmp_path):
    """Export A to the bucket, read it, export B (same shapes) over it, read it: B."""
    from transformer_jax.checkpoint import loading
    from transformer_jax.cli import export as hf_export

    url = "gs://bkt/hf/stale"

    def weights(checkpoint) -> list[np.ndarray]:
        params = loading.load(str(checkpoint), with_tokenizer=False).params
        return [np.asarray(leaf) for leaf in jax.tree.leaves(params)]

    run_a, run_b = _hf_dir(tmp_path / "a", 1), _hf_dir(tmp_path / "b", 2)
    assert hf_export.main(["--checkpoint", str(run_a), "--out", url, "--no-tokenizer"]) == 0
    for got, want in zip(weights(url), weights(run_a), strict=True):
        np.testing.assert_array_equal(got, want)
    assert hf_export.main(["--checkpoint", str(run_b), "--out", url, "--no-tokenizer",
                           "--overwrite"]) == 0
    for got, want in zip(weights(url), weights(run_b), strict=True):
        np.testing.assert_array_equal(got, want)


def test_an_export_to_a_missing_bucket_fails_in_one_line_before_writing(bucket, tmp_path,
                                                                        capsys):
    from transformer_jax import storage
    from transformer_jax.cli import export as hf_export

    url = "gs://nobucket/hf"
    checkpoint = _hf_dir(tmp_path / "a", 1)
    capsys.readouterr()
    assert hf_export.main(["--checkpoint", str(checkpoint), "--out", url,
                           "--no-tokenizer"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "the bucket nobucket does not exist" in err, err
    assert not storage.staging_dir(url, "export").exists()  # nothing written locally
    # An object where the directory would be is refused before writing as well.
    (tmp_path / "obj").write_bytes(b"x")
    storage.filesystem("gs://bkt/an-object")[0].put_file(str(tmp_path / "obj"),
                                                         "bkt/an-object")
    with pytest.raises(FileExistsError, match="is a file, not a directory"):
        hf_export.export(checkpoint, "gs://bkt/an-object", use_tokenizer=False)
    assert not storage.staging_dir("gs://bkt/an-object", "export").exists()
