"""``transformer_jax.loading``: what a checkpoint path is (``locate``: HF directory, run directory,
checkpoints directory, step directory; clear errors otherwise) and reading it (``load``: the saved
params exactly, a LoRA run merged as ``lora.merge``, a HF directory as ``hf.load``, onto a mesh,
in the other layer layout), read-only (a run on a read-only mount loads; nothing is written and
every checkpoint manager is closed).

Every checkpoint is made here: tiny models saved with ``CheckpointManager`` in the layout
training saves, and with ``hf.save``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import read_only
from helpers import FAST_XLA_FLAGS, random_params

from transformer_jax.checkpoint import loading
from transformer_jax.checkpoint import manager as checkpoint
from transformer_jax.checkpoint.manager import CheckpointError, CheckpointManager
from transformer_jax.model import lora
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.transformer import stack_blocks
from transformer_jax.parallel import sharding as sh
from transformer_jax.tokenizer import Tokenizer

pytest.importorskip("safetensors")
from transformer_jax import hf  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                     d_ff=48, max_seq_len=64, init_std=0.2)
TEXT = "the lazy dog jumps over the quick brown fox"
LORA = lora.LoraConfig(rank=2, alpha=4.0, targets=("q", "v", "down"))
ENV = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
           XLA_FLAGS=FAST_XLA_FLAGS)


def _flat(tree) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(p): np.asarray(x)
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def assert_same(a, b) -> None:
    """Same paths, dtypes and values."""
    fa, fb = _flat(a), _flat(b)
    assert fa.keys() == fb.keys()
    for name, x in fa.items():
        assert x.dtype == fb[name].dtype, name
        np.testing.assert_array_equal(x, fb[name], err_msg=name)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.model"
    return Tokenizer.train([f"{TEXT}. " * 20], path,
                           vocab_size=40, model_type="char")


def save_run(run_dir: Path, steps: dict[int, dict], tokenizer: Tokenizer | None,
             config: ModelConfig = CONFIG, lora_config: lora.LoraConfig | None = None) -> Path:
    """A run directory as training leaves it: checkpoints/<step> (params + meta), its copy of
    the tokenizer and its config.json."""
    meta = {"model": dataclasses.asdict(config), "tokenizer_dir": "tokenizer"}
    if lora_config is not None:
        meta["lora"] = lora_config.to_dict()
    with CheckpointManager(run_dir / "checkpoints", async_save=False, keep=10) as manager:
        for step, params in steps.items():
            manager.save(step, {"params": params, "step": jnp.int32(step)},
                         meta=dict(meta, step=step))
    if tokenizer is not None:
        tokenizer.save(run_dir / "tokenizer")
    (run_dir / "config.json").write_text(json.dumps({"model": meta["model"], "train": {},
                                                     "data": {}}))
    return run_dir


@pytest.fixture(scope="module")
def params() -> dict:
    # Random weights from the shapes (helpers.random_params): init_params op by op compiles a
    # program per op and shape.
    return {2: jax.device_put(random_params(CONFIG, 0)),
            4: jax.device_put(random_params(CONFIG, 1))}


@pytest.fixture(scope="module")
def run(tmp_path_factory, params, tokenizer) -> Path:
    return save_run(tmp_path_factory.mktemp("runs") / "run", params, tokenizer)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, params, tokenizer):
    base = params[4]
    adapters = jax.tree.map(lambda x: x + 0.05,  # as if trained: B != 0
                            lora.init_adapters(CONFIG, LORA, base, jax.random.key(3)))
    tree = {lora.BASE: lora.freeze_base(base, jnp.bfloat16), lora.ADAPTERS: adapters}
    path = save_run(tmp_path_factory.mktemp("runs") / "lora", {3: tree}, tokenizer,
                    lora_config=LORA)
    return path, tree


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, params, tokenizer) -> Path:
    path = tmp_path_factory.mktemp("hf") / "model"
    hf.save(CONFIG, params[2], path, tokenizer=tokenizer)
    return path


# locate ------------------------------------------------------------------------------------------

def test_locate_tells_each_kind_of_path(run, hf_dir):
    checkpoints = run / "checkpoints"
    for path, step in ((run, None), (checkpoints, None), (checkpoints / "2", 2)):
        source = loading.locate(path)
        assert (source.kind, source.path, source.step) == (loading.RUN, path, step)
        assert (source.run_dir, source.checkpoints) == (run, checkpoints)
        assert source.model == CONFIG
        assert source.meta["step"] == (4 if step is None else 2)
        assert source.tokenizer == run / "tokenizer"
    source = loading.locate(hf_dir)
    assert (source.kind, source.run_dir, source.checkpoints) == (loading.HF, None, None)
    assert source.model == CONFIG.replace(init_std=source.model.init_std)
    assert source.tokenizer == hf_dir


def test_locate_finds_the_recorded_tokenizer_of_a_bare_checkpoints_dir(tmp_path, params,
                                                                         tokenizer):
    with CheckpointManager(tmp_path / "ckpt", async_save=False) as manager:
        manager.save(1, {"params": params[2]}, meta={"model": dataclasses.asdict(CONFIG),
                                                     "tokenizer": str(tokenizer.path)})
    source = loading.locate(tmp_path / "ckpt")
    assert (source.checkpoints, source.run_dir) == (tmp_path / "ckpt", tmp_path)
    assert source.tokenizer == tokenizer.path
    tokenizer.path.rename(tokenizer.path.with_suffix(".gone"))
    try:
        assert loading.locate(tmp_path / "ckpt").tokenizer is None
    finally:
        tokenizer.path.with_suffix(".gone").rename(tokenizer.path)


def _bad_paths(root: Path, hf_dir: Path) -> dict[str, tuple[Path, type, str]]:
    (root / "file").write_text("x")
    (root / "empty").mkdir()
    (root / "no_weights").mkdir()
    (root / "no_weights" / "config.json").write_text((hf_dir / "config.json").read_text())
    (root / "no_steps" / "checkpoints").mkdir(parents=True)
    with CheckpointManager(root / "no_model" / "checkpoints", async_save=False) as manager:
        manager.save(1, {"params": {"w": jnp.zeros(2)}}, meta={"step": 1})
    (root / "gelu").mkdir()
    config = json.loads((hf_dir / "config.json").read_text())
    (root / "gelu" / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu_new"}))
    (root / "gelu" / "model.safetensors").write_bytes(b"")
    return {
        "missing": (root / "missing", FileNotFoundError, "does not exist"),
        "file": (root / "file", FileNotFoundError, "is a file; give a directory"),
        "empty": (root / "empty", FileNotFoundError, "holds neither a HF checkpoint"),
        "no_weights": (root / "no_weights", FileNotFoundError, "config.json but no weights"),
        "no_steps": (root / "no_steps", FileNotFoundError, r"no checkpoint \(weights\)"),
        "no_model": (root / "no_model", ValueError, r"has no meta\['model'\]"),
        "gelu": (root / "gelu", ValueError, "cannot be represented exactly: .*hidden_act"),
    }


def test_locate_errors_name_the_path_and_the_problem(tmp_path, hf_dir):
    for name, (path, error, message) in _bad_paths(tmp_path, hf_dir).items():
        with pytest.raises(error, match=f"^--checkpoint {name}:? .*{message}"):
            loading.locate(path, where=f"--checkpoint {name}")
        with pytest.raises(error, match=message):
            loading.locate(path)
    assert not (tmp_path / "missing").exists()


# One fresh process for the checks that need one (a process start is some 3 s of CPU): first
# locate on a run whose weights are gone (before anything starts a JAX backend), then, where a
# directory can be made read-only, every kind of checkpoint loaded from a read-only mount.
FRESH_SCRIPT = """
import json, sys
import jax._src.xla_bridge as xla_bridge
from transformer_jax.checkpoint import loading
GUTTED, READ_ONLY, PATHS, OUT = json.loads(sys.argv[1])
source = loading.locate(GUTTED)
print(json.dumps([source.kind, source.meta["step"], xla_bridge.backends_are_initialized()]))
sys.stdout.flush()
if READ_ONLY:
    import numpy as np, jax
    from transformer_jax.parallel import sharding as sh
    mesh = sh.make_mesh(sh.MeshConfig(1, 1, 1))
    for name, path in PATHS.items():
        for placed in (None, mesh):
            loaded = loading.load(path, placed)
            assert loaded.tokenizer is not None, name
        flat = {jax.tree_util.keystr(p): np.asarray(x) for p, x
                in jax.tree_util.tree_flatten_with_path(loaded.params)[0]}
        np.savez(OUT + "/" + name + ".npz", **flat)
    print("ok")
"""


@pytest.fixture(scope="module")
def fresh_process(tmp_path_factory, run, lora_run, hf_dir, params, tokenizer):
    """(the gutted run, the process's result, its output directory, whether it loaded from a
    read-only mount)."""
    root = tmp_path_factory.mktemp("fresh")
    gutted = save_run(root / "run", {5: params[2]}, tokenizer)
    for array_file in (gutted / "checkpoints" / "5" / "state").rglob("*"):
        if array_file.is_file() and not array_file.name.startswith("_"):
            array_file.write_bytes(b"")  # the weights are gone; the metadata stays
    out = root / "out"
    out.mkdir()
    paths = {"run": str(run), "lora": str(lora_run[0]), "step": str(run / "checkpoints" / "2"),
             "hf": str(hf_dir)}
    read_only_mount = read_only.mode() is not None
    argv = [sys.executable, "-c", FRESH_SCRIPT,
            json.dumps([str(gutted), read_only_mount, paths, str(out)])]
    if read_only_mount:
        done = read_only.run([run, lora_run[0], hf_dir], argv, env=ENV, cwd=ROOT, timeout=300)
    else:
        done = subprocess.run(argv, capture_output=True, text=True, env=ENV, cwd=ROOT,
                              timeout=120)
    return gutted, done, out, read_only_mount


def test_locate_reads_no_weights_and_starts_no_jax_backend(fresh_process):
    run, done, _, _ = fresh_process
    assert done.stdout.strip(), done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[0]) == ["run", 5, False]
    with pytest.raises(CheckpointError):
        loading.load(run)


# load --------------------------------------------------------------------------------------------

def test_load_of_a_run_gives_the_saved_params_and_its_tokenizer(run, params, tokenizer):
    loaded = loading.load(run)
    assert (loaded.config, loaded.step, loaded.meta["step"]) == (CONFIG, 4, 4)
    assert_same(loaded.params, params[4])
    assert loaded.tokenizer.encode(TEXT) == tokenizer.encode(TEXT)
    assert loaded.tokenizer_path == run / "tokenizer"
    older = loading.load(run / "checkpoints" / "2", with_tokenizer=False)
    assert older.step == 2 and older.tokenizer is None
    assert_same(older.params, params[2])
    assert_same(loading.load(run, step=2).params, params[2])


def _merged(tree) -> dict:
    """``lora.merge`` of a LoRA tree, every tensor in the model's param_dtype (float32)."""
    merged = lora.merge(tree[lora.BASE], tree[lora.ADAPTERS], LORA, dtype=jnp.float32)
    return jax.tree.map(lambda x: x.astype(jnp.float32), merged)


def test_load_of_a_lora_run_is_lora_merge(lora_run):
    path, tree = lora_run
    loaded = loading.load(path / "checkpoints")
    merged = _merged(tree)
    assert loaded.config == CONFIG and loaded.meta["lora"] == LORA.to_dict()
    assert_same(loaded.params, merged)  # float32 throughout, although the base is bfloat16
    raw = loading.load(path, merge_lora=False)
    assert_same(raw.params, tree)
    with pytest.raises(ValueError, match="merge_lora=False"):
        loading.load(path, sh.make_mesh(sh.MeshConfig(1, 1, 1)), merge_lora=False)


def test_load_of_a_hf_dir_is_hf_load(hf_dir, params, tokenizer):
    loaded = loading.load(hf_dir)
    config, want = hf.load(hf_dir)
    assert loaded.config == config
    assert_same(loaded.params, want)
    assert_same(loaded.params, params[2])
    assert loaded.tokenizer.encode(TEXT) == tokenizer.encode(TEXT)
    scanned = loading.load(hf_dir, scan_layers=True, dtype="bfloat16", with_tokenizer=False)
    assert (scanned.config.scan_layers, scanned.config.param_dtype) == (True, "bfloat16")
    assert_same(scanned.params, jax.tree.map(lambda x: x.astype(jnp.bfloat16),
                                             stack_blocks(params[2], CONFIG)))


def test_load_onto_a_mesh_in_either_layout(run, lora_run, params):
    mesh = sh.make_mesh(sh.MeshConfig(1, 1, 1))
    for path, want, scan in ((run, params[4], False), (run, params[4], True),
                             (lora_run[0], None, True)):
        loaded = loading.load(path, mesh, scan_layers=scan, dtype="bfloat16",
                              with_tokenizer=False)
        assert loaded.config == CONFIG.replace(scan_layers=scan, param_dtype="bfloat16",
                                               dtype="bfloat16")
        shardings = sh.param_shardings(loaded.config, mesh)
        assert jax.tree.leaves(jax.tree.map(lambda x, s: x.sharding == s, loaded.params,
                                            shardings)) == [True] * len(jax.tree.leaves(shardings))
        if want is not None:
            if scan:
                want = stack_blocks(want, CONFIG)
            assert_same(loaded.params, jax.tree.map(lambda x: x.astype(jnp.bfloat16), want))
    merged = loading.load(lora_run[0], with_tokenizer=False).params
    assert_same(loaded.params, jax.tree.map(lambda x: x.astype(jnp.bfloat16),
                                            stack_blocks(merged, CONFIG)))


# read-only ---------------------------------------------------------------------------------------

def _state(directory: Path) -> dict[str, tuple[int, int]]:
    """(mode, mtime) of every entry below a directory, the directory included."""
    return {str(p): (p.stat().st_mode, p.stat().st_mtime_ns)
            for p in [directory, *sorted(directory.rglob("*"))]}


def test_load_writes_nothing_and_closes_every_manager(tmp_path, params, tokenizer, lora_run,
                                                      monkeypatch):
    run = save_run(tmp_path / "run", {1: params[2]}, tokenizer)
    before = _state(run), _state(lora_run[0])
    opened, closed = [], []
    init, close = CheckpointManager.__init__, CheckpointManager.close

    def counting_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        opened.append(self)

    def counting_close(self):
        close(self)
        closed.append(self)

    monkeypatch.setattr(checkpoint.CheckpointManager, "__init__", counting_init)
    monkeypatch.setattr(checkpoint.CheckpointManager, "close", counting_close)
    mesh = sh.make_mesh(sh.MeshConfig(1, 1, 1))
    for path in (run, run / "checkpoints" / "1", lora_run[0]):
        loading.load(path)
        loading.load(path, mesh)
    assert len(opened) == 6 and {id(m) for m in opened} == {id(m) for m in closed}
    assert all(m.read_only for m in opened)
    assert (_state(run), _state(lora_run[0])) == before  # no write probe, no rename


def test_read_only_manager_creates_nothing_and_refuses_to_save(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        CheckpointManager(tmp_path / "none", read_only=True)
    assert not (tmp_path / "none").exists()
    (tmp_path / "ckpt").mkdir()
    with CheckpointManager(tmp_path / "ckpt", read_only=True) as reader:
        assert reader.all_steps() == []
        with pytest.raises(CheckpointError, match="read-only"):
            reader.save(1, {"w": jnp.zeros(2)})
    assert list((tmp_path / "ckpt").iterdir()) == []


def test_load_from_a_read_only_mount(fresh_process, lora_run, params):
    _, done, out, read_only_mount = fresh_process
    if not read_only_mount:
        pytest.skip("no way to make a directory read-only for root here (no namespaces)")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == "ok"
    merged = _merged(lora_run[1])
    for name, want in (("run", params[4]), ("lora", merged), ("step", params[2]),
                       ("hf", params[2])):
        got = dict(np.load(out / f"{name}.npz"))
        assert got.keys() == _flat(want).keys()
        for key, value in _flat(want).items():
            np.testing.assert_array_equal(got[key], value, err_msg=f"{name} {key}")
