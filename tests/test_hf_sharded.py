"""``hf.load(path, mesh=...)``: weights read shard by shard straight onto a device mesh.

Tiny HF models (Llama with GQA, untied; Qwen2 with q/k/v biases, tied) are saved with
transformers' ``save_pretrained`` here; one subprocess with 8 simulated CPU devices (this file
run as a script) loads them over the meshes (data, fsdp, tensor) = (1, 8, 1) and (1, 2, 4), in
the unrolled and the scanned layout, and reports every param's sharding, whether its values equal
the single-device ``hf.load`` bit for bit, and the logits. A second subprocess measures the host
memory of loading a ~210 MiB float32 model sharded, against the model's size. Both run in ONE
subprocess (the memory measure first, in the fresh process; its imports paid once).

Needs the ``hf`` extra (torch, transformers, safetensors); skipped without it.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

MESHES = {"1,8,1": (1, 8, 1), "1,2,4": (1, 2, 4)}
B, T, V = 2, 12, 128
TOL = 1e-4
# The memory test's model: 16000 x 1024 tied embedding + 4 layers, about 210 MiB in float32
# (its fixed costs, ~25 MiB of resident set, stay well under its bounds' fractions of it).
BIG = dict(vocab_size=16000, d_model=1024, n_layers=4, n_heads=8, n_kv_heads=4, d_ff=2048,
           max_seq_len=256, tie_embeddings=True)


# ------------------------------------------------------------------------------ worker side


def _worker_parity(spec: dict) -> dict:
    """Loads each model over each mesh and layout; reports shardings, equality and logits."""
    import jax
    import jax.numpy as jnp

    from transformer_jax import hf
    from transformer_jax.model.transformer import Transformer
    from transformer_jax.parallel import sharding

    tokens = jnp.asarray(np.load(spec["tokens"]))
    out: dict = {}
    for name, path in spec["models"].items():
        for scan in (False, True):
            config0, single = hf.load(path, scan_layers=scan)
            flat_single = {jax.tree_util.keystr(p): np.asarray(x)
                           for p, x in jax.tree_util.tree_flatten_with_path(single)[0]}
            for mesh_name, sizes in MESHES.items():
                mesh = sharding.make_mesh(sharding.MeshConfig(*sizes))
                config, params = hf.load(path, mesh=mesh, scan_layers=scan)
                want = sharding.param_shardings(config, mesh)
                flat = jax.tree_util.tree_flatten_with_path(params)[0]
                want_flat = dict(
                    (jax.tree_util.keystr(p), s)
                    for p, s in jax.tree_util.tree_flatten_with_path(want)[0])
                wrong_sharding = [jax.tree_util.keystr(p) for p, x in flat
                                  if x.sharding != want_flat[jax.tree_util.keystr(p)]]
                differs = [jax.tree_util.keystr(p) for p, x in flat
                           if not np.array_equal(np.asarray(x),
                                                 flat_single[jax.tree_util.keystr(p)])
                           or x.dtype != flat_single[jax.tree_util.keystr(p)].dtype]
                split = [jax.tree_util.keystr(p) for p, x in flat
                         if x.addressable_shards[0].data.size < x.size]
                logits = jax.jit(lambda p, t, c=config: Transformer(c).apply(
                    {"params": p}, t).logits)(params, tokens)
                out[f"{name}/{'scan' if scan else 'unrolled'}/{mesh_name}"] = dict(
                    config_same=config == config0, n_params=len(flat),
                    wrong_sharding=wrong_sharding, differs=differs, split=split,
                    logits=np.asarray(logits).tolist())
    return out


def _worker_memory(spec: dict) -> dict:
    """Peak host memory of a sharded load (fsdp=8) of the big model, and of a plain one."""
    import gc
    import resource
    import tracemalloc

    import jax
    import jax.numpy as jnp

    from transformer_jax import hf
    from transformer_jax.parallel import sharding

    mesh = sharding.make_mesh(sharding.MeshConfig(1, 8, 1))
    jax.block_until_ready([jax.device_put(jnp.ones(4), d) for d in jax.devices()])

    def rss_mib() -> float:
        # The peak resident set (VmHWM), reset before each load by writing 5 to clear_refs;
        # ru_maxrss would also count the parent's memory at fork.
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    def reset_peak() -> None:
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass

    out = {"model_mib": spec["model_bytes"] / 2**20}
    for label, kwargs in (("sharded", dict(mesh=mesh)), ("plain", {})):
        gc.collect()
        reset_peak()
        rss0 = rss_mib()
        tracemalloc.start()
        _, params = hf.load(spec["path"], **kwargs)
        jax.block_until_ready(params)
        current, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        held = sum(s.data.nbytes for x in jax.tree.leaves(params) for s in x.addressable_shards)
        out[label] = dict(rss_before_mib=rss0, rss_peak_increase_mib=rss_mib() - rss0,
                          traced_peak_mib=peak / 2**20, traced_held_mib=current / 2**20,
                          device_held_mib=held / 2**20)
        del params
    return out


if __name__ == "__main__":
    spec = json.loads(Path(sys.argv[1]).read_text())  # {mode: its spec}, memory first
    result = {mode: {"parity": _worker_parity, "memory": _worker_memory}[mode](spec[mode])
              for mode in ("memory", "parity") if mode in spec}
    print(json.dumps(result))
    sys.exit(0)


# ------------------------------------------------------------------------------ pytest side

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import jax  # noqa: E402
import multihost_worker as worker  # noqa: E402
from helpers import random_hf_model  # noqa: E402

from transformer_jax import hf  # noqa: E402
from transformer_jax.model.config import ModelConfig  # noqa: E402
from transformer_jax.model.transformer import abstract_params  # noqa: E402

WORKER = Path(__file__)


def _run(spec: dict, tmp: Path, timeout: float = 300) -> dict:
    """The worker on ``spec`` ({mode: its spec}) in one subprocess: {mode: its result}."""
    spec_file = tmp / "spec.json"
    spec_file.write_text(json.dumps(spec))
    out = worker.run_python([str(WORKER), str(spec_file)], n_devices=8, timeout=timeout)
    return json.loads(out.strip().splitlines()[-1])


def _hf_model(kind: str, seed: int):
    """Tiny random transformers model: 8 query heads and 4 kv heads (splittable 4 and 8 ways)."""
    return random_hf_model(kind, seed, hidden_size=64, num_hidden_layers=2,
                           num_attention_heads=8, num_key_value_heads=4, intermediate_size=96,
                           vocab_size=V, max_position_embeddings=256,
                           tie_word_embeddings=kind == "qwen2")


def _big_model(path: Path) -> dict:
    """The memory test's model (``BIG``) written by ``hf.save``: the worker's memory spec."""
    config = ModelConfig(**BIG)
    # Random values repeated to fill each weight (their values do not matter to the memory;
    # drawing 100 M normals would cost seconds).
    block = (np.random.default_rng(0).standard_normal(1 << 16) * 0.02).astype(np.float32)
    params: dict = {}
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(abstract_params(config))[0]:
        node = params
        keys = [p.key for p in key_path]
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = np.resize(block, leaf.shape)
    model_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    hf.save(config, params, path)
    return {"path": str(path), "model_bytes": model_bytes}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """The worker's parity and memory results (one subprocess), and transformers' logits."""
    tmp = tmp_path_factory.mktemp("hf_sharded")
    tokens = np.random.default_rng(0).integers(0, V, (B, T)).astype(np.int32)
    np.save(tmp / "tokens.npy", tokens)
    models, expected = {}, {}
    for seed, kind in enumerate(("llama", "qwen2")):
        model = _hf_model(kind, seed)
        model.save_pretrained(tmp / kind, safe_serialization=True)
        models[kind] = str(tmp / kind)
        with torch.no_grad():
            expected[kind] = model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    spec = {"parity": {"tokens": str(tmp / "tokens.npy"), "models": models},
            "memory": _big_model(tmp / "big")}
    out = _run(spec, tmp)
    shutil.rmtree(tmp / "big")  # 210 MiB
    return out, expected


CASES = [f"{kind}/{layout}/{mesh}" for kind in ("llama", "qwen2")
         for layout in ("unrolled", "scan") for mesh in MESHES]


@pytest.mark.parametrize("case", CASES)
def test_sharded_load_matches_rules_values_and_transformers(results, case):
    out, expected = results
    r = out["parity"][case]
    assert r["config_same"]
    assert r["wrong_sharding"] == []  # every param has the sharding the rules give
    assert r["differs"] == []  # same values and dtype as the single-device load
    assert len(r["split"]) >= r["n_params"] // 2  # most params are split, not replicated
    logits = np.asarray(r["logits"])
    assert float(np.max(np.abs(logits - expected[case.split("/")[0]]))) < TOL


def test_sharded_load_host_memory_stays_well_under_the_model(results):
    r = results[0]["memory"]
    print(json.dumps(r, indent=1))
    model_mib = r["model_mib"]
    sharded = r["sharded"]
    # The host-side copies in flight (numpy blocks read from the file) stay a small fraction of
    # the model: a few shards, never a whole tensor (the embedding alone is 0.3 of the model)
    # as the plain load holds.
    in_flight = sharded["traced_peak_mib"] - sharded["traced_held_mib"]
    assert in_flight < 0.2 * model_mib
    assert in_flight < 0.5 * r["plain"]["traced_peak_mib"]
    # On CPU "devices" the shards themselves live in host memory: beyond them, the resident
    # set grows by well under the model's size (file pages are unmapped param by param).
    assert sharded["rss_peak_increase_mib"] - sharded["device_held_mib"] < 0.25 * model_mib
