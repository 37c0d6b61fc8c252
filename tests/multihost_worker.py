"""Subprocess side of the multi-device tests; never imported by the main pytest process's jax.

Each mode runs in a fresh process whose XLA_FLAGS (set by the parent test) give it simulated CPU
devices, and prints one JSON object on its last stdout line:

  meshes   8 devices: one reference single-device step, then the same steps under several
           meshes (and scanned/remat variants), reporting losses, state differences, shardings
           and per-device bytes. With --bench-memory ARGS (a JSON list) it first runs
           ``python -m transformer_jax.bench memory ARGS`` in this process, started with one
           device: the bench must ask for the 8 devices itself (and the meshes use them).
  train    one of several processes joined through jax.distributed: trains a few steps (of
           PROCESSES_CONFIG, one layer) on a mesh spanning all processes, then writes one
           orbax checkpoint collectively (and with --init-from loads a run's params as
           train.init_from does; with --shards reads its rows of a shard build's global
           batches, packed and concat).

``check`` (called in the pytest process, on its one device): trains the same steps, then
restores that checkpoint and compares.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

# Importing jax before jax.distributed.initialize is fine ("train" mode); touching a device
# is not, and nothing at import time here does.
import jax
import numpy as np
from helpers import with_fast_flags

from transformer_jax.checkpoint.manager import CheckpointManager
from transformer_jax.data import batches as data
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.transformer import stack_blocks, unstack_blocks
from transformer_jax.parallel import distributed
from transformer_jax.parallel import sharding as sh
from transformer_jax.train.config import TrainConfig
from transformer_jax.train.step import make_init_fn, make_train_step

CONFIG = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=8, n_kv_heads=8,
                     head_dim=8, d_ff=128, max_seq_len=32)
BATCH, SEQ, STEPS, LR = 16, 16, 3, 1e-3
# Constant learning rate from the first update; clipping, weight decay and its mask as in runs.
TRAIN = TrainConfig(steps=100, batch_size=BATCH, seq_len=SEQ, lr=LR, min_lr=LR, warmup_steps=0,
                    eps=1e-6)
# The train/check modes' model: one layer (every kind of parameter, sharded as in CONFIG, at
# about a third less compilation in each of their processes).
PROCESSES_CONFIG = CONFIG.replace(n_layers=1)
MESHES = {"dp": (8, 1, 1), "fsdp": (1, 8, 1), "tp": (1, 1, 8), "mixed": (2, 2, 2)}
# name -> (mesh, scan_layers, remat): every mesh, scanned and unrolled, every remat policy under
# sharding, in as few compilations as that takes.
RUNS = {
    "dp": (MESHES["dp"], False, "none"),
    "fsdp_full": (MESHES["fsdp"], False, "full"),
    "tp_scan_save_dots": (MESHES["tp"], True, "save_dots"),
    "mixed_scan": (MESHES["mixed"], True, "none"),
}
TOKENS = np.random.default_rng(0).integers(0, CONFIG.vocab_size, 4096).astype(np.int32)


ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------- parent (pytest) side


def worker_env(n_devices: int) -> dict[str, str]:
    """Environment of a subprocess with ``n_devices`` simulated CPU devices."""
    env = dict(os.environ)
    # Cheaper XLA CPU codegen: the tests check numerics and layouts, not kernel speed.
    env["XLA_FLAGS"] = with_fast_flags(f"--xla_force_host_platform_device_count={n_devices}")
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        env.pop(var, None)
    return env


def run_python(args: list[str], n_devices: int, timeout: float = 300) -> str:
    """Runs ``python ARGS`` in a subprocess with ``n_devices`` devices; returns its stdout."""
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=worker_env(n_devices),
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        raise RuntimeError(f"{args} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc.stdout


def run_worker(args: list[str], n_devices: int, timeout: float = 300) -> dict:
    """Runs this file in a subprocess (``args`` = mode and options) and returns its JSON."""
    return json.loads(run_python([__file__, *args], n_devices, timeout).strip().splitlines()[-1])


# ------------------------------------------------------------------------ model + train step


def train_fns(config: ModelConfig):
    """(init_state(rng) -> TrainState, train_step(state, batch) -> (state, metrics))."""
    return make_init_fn(config, TRAIN), make_train_step(config, TRAIN)


def host_batch(step: int, index: int = 0, count: int = 1) -> dict:
    return data.get_batch(TOKENS, 0, step, BATCH, SEQ, process_index=index, process_count=count)


# ------------------------------------------------------------------------------ helpers


def _flat(tree) -> dict[str, np.ndarray]:
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {sh._path_str(p): x for p, x in leaves}


def _max_diff(a, b) -> dict[str, float]:
    fa, fb = _flat(a), _flat(b)
    assert fa.keys() == fb.keys(), (sorted(fa), sorted(fb))
    return {k: float(np.max(np.abs(np.asarray(fa[k], np.float64) - np.asarray(fb[k], np.float64))))
            for k in fa if np.asarray(fa[k]).size}


def _stack_state(state, config):
    """Unrolled-layout state -> scanned layout (every parameter-shaped dict is stacked)."""
    def one(t):
        return stack_blocks(t, config) if _is_params(t, "blocks_0") else t

    return jax.tree.map(one, state, is_leaf=lambda t: _is_params(t, "blocks_0"))


def _unstack_state(state):
    def one(t):
        return unstack_blocks(t) if _is_params(t, "blocks") else t

    return jax.tree.map(one, state, is_leaf=lambda t: _is_params(t, "blocks"))


def _is_params(t, key: str) -> bool:
    return isinstance(t, dict) and key in t


def _specs(tree, part: str = "") -> dict[str, list]:
    """Mesh specs of the leaves whose path contains ``/part/``, keyed by the rest of the path."""
    out = {}
    for k, x in _flat(tree).items():
        if part and f"/{part}/" not in f"/{k}":
            continue
        key = k.split(f"{part}/", 1)[1] if part else k
        out[key] = [list(a) if isinstance(a, tuple) else a for a in x.sharding.spec]
    return out


def _device_bytes(tree) -> int:
    """Bytes the first device actually holds of a tree of jax.Arrays."""
    dev = jax.devices()[0]
    return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
               if s.device == dev)


def _run_steps(step_fn, state, put_batch):
    losses = []
    for i in range(STEPS):
        state, metrics = step_fn(state, put_batch(i))
        losses.append(float(metrics["loss"]))
    return state, losses


# ---------------------------------------------------------------------------------- modes


def bench_memory(argv: list[str]) -> dict:
    """``python -m transformer_jax.bench memory ARGV`` in this process (before anything has
    started JAX's backend): its exit status and what it printed."""
    import contextlib
    import io
    import traceback

    from transformer_jax.bench import __main__ as bench

    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            status = bench.main(["memory", *argv])
    except Exception:  # noqa: BLE001 - reported to the test, which names it
        return {"status": None, "printed": printed.getvalue(), "error": traceback.format_exc()}
    return {"status": status, "printed": printed.getvalue(), "error": None}


def lm_loss_diffs() -> dict:
    """``ops.lm_loss`` (chunked along T, per device under the mesh's batch axes) against the
    full [B, T, V] logits' loss on one device, written independently: the value and the
    gradients of x and the head (padding weights, z-loss, a ragged last chunk), on fsdp=4 (a
    [D, V] head) and data x fsdp x tensor = 2 x 2 x 2 (a tied [V, D] table)."""
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from transformer_jax.model.ops.layouts import OutFirst
    from transformer_jax.model.ops.lm_loss import lm_head_cross_entropy_sums

    b, t, d, v, chunk, z_loss = 8, 12, 16, 64, 5, 1e-2
    r = np.random.default_rng(0)
    x = r.normal(size=(b, t, d)).astype(np.float32)
    table = (r.normal(size=(v, d)) * 0.3).astype(np.float32)
    targets = r.integers(0, v, (b, t)).astype(np.int32)
    mask = (r.random((b, t)) < 0.7).astype(np.float32)

    def full(x, table, targets, mask):
        logits = jnp.einsum("BTD,VD->BTV", x, table)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        lse = jax.nn.logsumexp(logits, axis=-1)
        return jnp.sum(mask * ce) + z_loss * jnp.sum(mask * lse ** 2)

    def chunked(tied):
        def loss(x, table, targets, mask):
            head = OutFirst(table) if tied else table.T
            ce, z, _ = lm_head_cross_entropy_sums(x, head, targets, mask, chunk_size=chunk,
                                                  z_loss=z_loss)
            return ce + z
        return loss

    want = jax.device_get(jax.jit(jax.value_and_grad(full, argnums=(0, 1)))(
        x, table, targets, mask))
    out = {}
    for name, shape, tied in (("fsdp", (1, 4, 1), False), ("mixed", (2, 2, 2), True)):
        mesh = sh.make_mesh(sh.MeshConfig(*shape), jax.devices()[:math.prod(shape)])
        rows, w = NamedSharding(mesh, P(("data", "fsdp"))), NamedSharding(mesh, P("tensor", "fsdp"))
        fn = sh.jit_sharded(jax.value_and_grad(chunked(tied), argnums=(0, 1)), mesh,
                            (rows, w, rows, rows), (None, (rows, w)))
        args = (x, table, targets, mask)
        got = jax.device_get(fn(*args))
        out[name] = {"value": abs(float(got[0]) - float(want[0])) / abs(float(want[0])),
                     "grad_x": float(np.max(np.abs(got[1][0] - want[1][0]))),
                     "grad_head": float(np.max(np.abs(got[1][1] - want[1][1]))),
                     "per_device": "shard_map" in str(fn.trace(*args).jaxpr)}
    return out


def mode_meshes(memory_args: list[str] | None = None) -> dict:
    memory = bench_memory(memory_args) if memory_args is not None else None
    assert len(jax.devices()) == 8, (jax.devices(), memory)
    init_state, train_step = train_fns(CONFIG)
    rng = jax.random.key(0)
    ref_state0 = jax.device_get(jax.jit(init_state)(rng))
    batches = [host_batch(i) for i in range(STEPS)]

    # Reference: one device, plain jit, no sharding code involved.
    ref_step = jax.jit(train_step)
    ref_state, ref_losses = _run_steps(ref_step, jax.device_put(ref_state0, jax.devices()[0]),
                                       lambda i: batches[i])
    ref_state = jax.device_get(ref_state)
    out = {"ref_losses": ref_losses, "runs": {}, "bench_memory": memory,
           "lm_loss": lm_loss_diffs()}
    abstract = jax.eval_shape(init_state, rng)

    def run(name, config, shape, state0, to_ref=lambda s: s):
        mesh = sh.make_mesh(sh.MeshConfig(*shape), jax.devices()[:math.prod(shape)])
        _, step_fn = train_fns(config)
        s_shard = sh.state_shardings(jax.eval_shape(train_fns(config)[0], rng),
                                     sh.param_shardings(config, mesh))
        b_shard = sh.batch_sharding(mesh)
        state = jax.device_put(state0, s_shard)
        param_bytes = _device_bytes(state.params)
        step = sh.jit_train_step(step_fn, s_shard, b_shard)
        state, losses = _run_steps(step, state, lambda i: jax.device_put(batches[i], b_shard))
        out["runs"][name] = {
            "mesh": shape, "losses": losses, "param_bytes": param_bytes,
            "param_specs": _specs(state.params),
            "mu_specs": _specs(state.opt_state, "mu"),
            "nu_specs": _specs(state.opt_state, "nu"),
            "diff": _max_diff(to_ref(jax.device_get(state)), ref_state),
        }

    for name, (shape, scan, remat) in RUNS.items():
        config = CONFIG.replace(scan_layers=scan, remat=remat)
        if scan:
            run(name, config, shape, _stack_state(ref_state0, CONFIG),
                to_ref=_unstack_state)
        else:
            run(name, config, shape, ref_state0)

    # Sharded init: created in place on the mixed mesh, equal to the single-device init.
    mesh = sh.make_mesh(sh.MeshConfig(*MESHES["mixed"]))
    s_shard = sh.state_shardings(abstract, sh.param_shardings(CONFIG, mesh))
    state = sh.shard_init(init_state, s_shard)(rng)
    out["shard_init"] = {
        "diff": _max_diff(jax.device_get(state), ref_state0),
        "specs_match": all(x.sharding == s for x, s in zip(
            jax.tree.leaves(state), jax.tree.leaves(s_shard), strict=True)),
    }
    return out


def mode_train(args) -> dict:
    distributed.maybe_initialize(args.coordinator, args.num_processes, args.process_id,
                                 initialization_timeout=120)
    assert jax.process_count() == args.num_processes
    init_state, train_step = train_fns(PROCESSES_CONFIG)
    mesh = sh.make_mesh(sh.MeshConfig(*MESHES["mixed"]))
    s_shard = sh.state_shardings(jax.eval_shape(init_state, jax.random.key(0)),
                                 sh.param_shardings(PROCESSES_CONFIG, mesh))
    b_shard = sh.batch_sharding(mesh)
    index, count = distributed.process_batch_shard(b_shard, BATCH)
    tp_mesh = sh.make_mesh(sh.MeshConfig(1, 1, 8))
    tp_shard = distributed.process_batch_shard(sh.batch_sharding(tp_mesh), BATCH)

    state = sh.shard_init(init_state, s_shard)(jax.random.key(0))
    step = sh.jit_train_step(train_step, s_shard, b_shard)
    state, losses = _run_steps(step, state, lambda i: distributed.global_batch(
        host_batch(i, index, count), b_shard, BATCH))
    _save(Path(args.ckpt), state, losses)
    if args.init_from:
        _load_init_from(args.init_from, Path(args.ckpt).parent / "init_from.npz")
    shard_rows = _shard_rows(args.shards, index, count) if args.shards else None
    return {"process": jax.process_index(), "losses": losses, "batch_shard": [index, count],
            "shard_rows": shard_rows,
            "tp_batch_shard": list(tp_shard), "main": distributed.is_main_process(),
            "any_last": distributed.any_process(jax.process_index() == args.num_processes - 1),
            "any_none": distributed.any_process(False),
            "local_devices": jax.local_device_count(), "global_devices": jax.device_count()}


def _shard_rows(build: str, index: int, count: int) -> dict[str, list]:
    """This process's rows of a shard build's global batches of steps 0-2 (data.shards)."""
    from transformer_jax.data import shards

    mixture = shards.Mixture.parse(build, "")
    return {packing: [shards.ShardBatches(mixture, SEQ, BATCH, packing, 0, index, count)
                      .get(step)["inputs"].tolist() for step in range(3)]
            for packing in shards.PACKING}


def _load_init_from(path: str, out: Path) -> None:
    """``train.init_from``'s load of a run (a LoRA one: merged on each host, then placed) onto
    a mesh spanning the processes; process 0 writes the gathered params to ``out``."""
    from jax.experimental import multihost_utils

    from transformer_jax.checkpoint import loading

    source = loading.locate(path)  # files only: fine before or after jax.distributed starts
    mesh = sh.make_mesh(sh.MeshConfig(4, 2, 1))
    params = loading.load(source, mesh, with_tokenizer=False).params
    expected = sh.param_shardings(source.model, mesh)
    assert all(x.sharding == s for x, s in zip(jax.tree.leaves(params),
                                               jax.tree.leaves(expected), strict=True))
    gathered = _flat(multihost_utils.process_allgather(params, tiled=True))
    if jax.process_index() == 0:
        np.savez(out, **gathered)


def check(ckpt: Path) -> dict:
    """The train processes' steps in this process, on its devices (the pytest process's one:
    a checkpoint saved by two processes over 8 devices restores onto another mesh), then
    their checkpoint restored onto that mesh and compared."""
    init_state, train_step = train_fns(PROCESSES_CONFIG)
    mesh = sh.make_mesh(sh.MeshConfig())
    abstract = jax.eval_shape(init_state, jax.random.key(0))
    s_shard = sh.state_shardings(abstract, sh.param_shardings(PROCESSES_CONFIG, mesh))
    b_shard = sh.batch_sharding(mesh)
    state = sh.shard_init(init_state, s_shard)(jax.random.key(0))
    step = sh.jit_train_step(train_step, s_shard, b_shard)
    state, losses = _run_steps(step, state, lambda i: jax.device_put(host_batch(i), b_shard))
    restored, meta = _restore(ckpt, sh.with_shardings(abstract, s_shard))
    return {"losses": losses, "saved_losses": meta["losses"],
            "diff": _max_diff(jax.device_get(restored), jax.device_get(state)),
            "restored_specs_match": all(x.sharding == s for x, s in zip(
                jax.tree.leaves(restored), jax.tree.leaves(s_shard), strict=True))}


def _save(path: Path, state, losses: list[float]) -> None:
    # Every process calls save with its shards of the global arrays; orbax writes one
    # checkpoint (each process its own shards, process 0 the metadata).
    with CheckpointManager(path, keep=1, async_save=True) as ckpt:
        ckpt.save(int(state.step), state, meta={"losses": losses})


def _restore(path: Path, abstract_state):
    with CheckpointManager(path, keep=1) as ckpt:
        return ckpt.restore(abstract_state)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("meshes", "train"))
    parser.add_argument("--coordinator")
    parser.add_argument("--num-processes", type=int)
    parser.add_argument("--process-id", type=int)
    parser.add_argument("--ckpt")
    parser.add_argument("--init-from", help="train mode: also load this run's params as "
                        "train.init_from does")
    parser.add_argument("--shards", help="train mode: also read this shard build's rows")
    parser.add_argument("--bench-memory", type=json.loads, default=None,
                        help="meshes mode: first run bench memory with these arguments (JSON)")
    args = parser.parse_args(argv)
    if args.mode == "meshes":
        result = mode_meshes(args.bench_memory)
    else:
        result = mode_train(args)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
