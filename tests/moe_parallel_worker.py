"""Subprocess side of ``test_moe_parallel.py``: expert parallelism on simulated CPU devices.

Run as one of ``--num-processes`` processes (joined through ``jax.distributed`` over gloo when
more than one) that together hold 8 devices. Process 0 first runs the single-device reference
on its own first device (plain ``jax.jit``, no mesh, no sharding code), then every process the same
``STEPS`` training steps under each mesh of ``MESHES`` (``parallel.sharding``'s sharded jit, as
``train.run`` does), and the forward of a model whose routers leave experts without tokens.
Process 0 prints one JSON object on its last stdout line.
"""

from __future__ import annotations

import argparse
import json
import sys

# Importing jax before jax.distributed.initialize is fine; touching a device is not.
import helpers  # noqa: F401  (its GC thresholds, for this process too)
import jax
import numpy as np
from jax.experimental import multihost_utils

from transformer_jax.model.config import ModelConfig
from transformer_jax.model.fields import MoE
from transformer_jax.model.transformer import Transformer
from transformer_jax.parallel import distributed
from transformer_jax.parallel import sharding as sh
from transformer_jax.train.config import TrainConfig
from transformer_jax.train.step import make_init_fn, make_train_step

E, K = 8, 2
# One (sparse) layer: every kind of parameter and both all_to_alls of a sparse layer, at half
# the compilation and half the collectives per step of two layers in both processes. The
# routing is DeepSeek-V3's (sigmoid scores, a correction bias updated by the balancing rule,
# 2 of 4 groups, a routed scale, an ungated shared expert): the dispatch does not depend on
# how the experts were chosen, so one routing covers both.
CONFIG = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                     head_dim=8, d_ff=48, max_seq_len=32, init_std=0.2,
                     moe=MoE(n_experts=E, top_k=K, d_ff=24, score="sigmoid",
                             correction_bias=True, n_groups=4, top_groups=2, routed_scale=1.5,
                             shared_d_ff=8))
# Every step across the processes costs both of them gloo collectives (most of a step's time on
# a 2-core CPU): 6 steps at 4e-2 train (the reference's loss falls by 0.56) and leave the meshes
# close to it (largest relative state difference 1e-4, against the test's bound of 3e-3; the
# correction bias, moved by up to 0.02, equal).
B, T, STEPS, LR = 8, 16, 6, 4e-2
TRAIN = TrainConfig(steps=100, batch_size=B, seq_len=T, lr=LR, min_lr=LR, warmup_steps=0,
                    eps=1e-6, moe_balance_loss=0.1, moe_bias_update_rate=1e-2)
#: name -> mesh; every one spans 8 devices (across the processes when there are several).
#: (expert x fsdp and expert x tensor are checked in one mesh, and expert x data only in this
#: file's in-process tests: each compile costs both processes seconds.)
MESHES = {
    "expert2_fsdp2_tensor2": sh.MeshConfig(data=1, fsdp=2, expert=2, tensor=2),
    "expert8": sh.MeshConfig(data=1, expert=8),
}
#: The meshes the forward is checked on too.
FORWARD = ("expert8",)
#: The forward check's routers send every token to experts 0, 1 or 6, 7 (by the sign of one
#: feature), so experts 2-5 (with 8 expert devices: devices 2 to 5) get no token.
EMPTY = (2, 3, 4, 5)
ROUTE_ROW = np.array([3.0, 2.0, 0.0, 0.0, 0.0, 0.0, -2.0, -3.0], np.float32)


def batches() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(STEPS):
        tokens = rng.integers(0, CONFIG.vocab_size, (B, T + 1), np.int32)
        out.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
    return out


def place(tree, shardings):
    """Host arrays -> global arrays of ``shardings`` (every process holds the whole tree)."""
    def one(x, s):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, s, lambda index: x[index])

    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda x: one(x, shardings), tree)
    return jax.tree.map(one, tree, shardings)


def host(tree) -> dict[str, np.ndarray]:
    """A (possibly multi-process) tree gathered whole on every process, by path."""
    def whole(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return multihost_utils.process_allgather(x, tiled=True)  # a global array's whole value
        return jax.device_get(x)

    leaves, _ = jax.tree_util.tree_flatten_with_path(jax.tree.map(whole, tree))
    return {sh._path_str(p): np.asarray(x, np.float64) for p, x in leaves}


def train(state, step_fn, put, data):
    """(final state, {"loss": [per step], "grad_norm": [per step]})."""
    curves = {"loss": [], "grad_norm": []}
    for batch in data:
        state, metrics = step_fn(state, put(batch))
        for name, values in curves.items():
            values.append(float(metrics[name]))
    return state, curves


def state_diff(state, ref: dict[str, np.ndarray] | None) -> dict[str, float]:
    """Max |a - b| over each parameter and Adam moment, divided by max |b| (1 if b is 0); {}
    without ``ref`` (a process that does not report still takes part in the gathers)."""
    out = {}
    whole = host({"params": state.params, "opt": state.opt_state})
    if ref is None:
        return out
    for path, x in whole.items():
        if "/mu/" in path or "/nu/" in path or path.startswith("params/"):
            scale = float(np.max(np.abs(ref[path]))) or 1.0
            out[path] = float(np.max(np.abs(x - ref[path]))) / scale
    return out


def routed_params(params):
    """Each sparse layer's router [D, E] zero but for feature 0's row ``ROUTE_ROW``."""
    def one(path, x):
        if jax.tree_util.keystr(path).endswith("['moe']['router']"):
            x = np.zeros_like(x)
            x[0] = ROUTE_ROW
        return x

    return jax.tree_util.tree_map_with_path(one, params)


def _spec(spec) -> list:
    return [list(a) if isinstance(a, tuple) else a for a in spec]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--coordinator")
    parser.add_argument("--num-processes", type=int, default=1)
    parser.add_argument("--process-id", type=int, default=0)
    args = parser.parse_args(argv)
    if args.num_processes > 1:
        distributed.maybe_initialize(args.coordinator, args.num_processes, args.process_id,
                                     initialization_timeout=120)
    assert jax.device_count() == 8, jax.devices()
    init, step = make_init_fn(CONFIG, TRAIN), make_train_step(CONFIG, TRAIN)
    key = jax.random.key(0)
    data = batches()
    one = jax.local_devices()[0]

    state0 = jax.device_get(jax.jit(init)(key))
    model = Transformer(CONFIG)
    params, tokens = routed_params(state0.params), data[0]["inputs"]
    # Only process 0 reports, so only it runs the reference (one device of its own, plain jit,
    # no mesh); the others wait for it at a barrier of the coordination service (which, unlike
    # a collective of the first sharded step, waits as long as it is told to).
    main_process = jax.process_index() == 0
    out = {"processes": jax.process_count(), "devices": jax.device_count(), "runs": {}}
    ref_state = ref_out = None
    if main_process:
        ref_state, out["ref"] = train(jax.device_put(state0, one), jax.jit(step),
                                      lambda b: jax.device_put(b, one), data)
        ref_state = host({"params": ref_state.params, "opt": ref_state.opt_state})
        out["ref_bias"] = ref_state["params/blocks_0/moe/correction_bias"].tolist()
        ref_out = jax.device_get(jax.jit(lambda p, x: model.apply({"params": p}, x))(
            jax.device_put(params, one), jax.device_put(tokens, one)))
        out["ref_load"] = np.asarray(ref_out.moe["load"]).tolist()
    if jax.process_count() > 1:
        from jax._src import distributed as jax_distributed

        jax_distributed.global_state.client.wait_at_barrier("reference", 600_000)
    abstract = jax.eval_shape(init, key)
    for name, mesh_config in MESHES.items():
        mesh = sh.make_mesh(mesh_config)
        p_shard = sh.param_shardings(CONFIG, mesh)
        s_shard = sh.state_shardings(abstract, p_shard)
        b_shard = sh.batch_sharding(mesh)
        state = place(state0, s_shard)
        compiled = sh.jit_train_step(step, s_shard, b_shard).lower(
            state, place(data[0], b_shard)).compile()
        state, curves = train(state, compiled, lambda b, s=b_shard: place(b, s), data)
        run = {"mesh": dict(mesh.shape), **curves, "diff": state_diff(state, ref_state),
               "all_to_all": compiled.as_text().count("all-to-all("),
               "batch_spec": _spec(b_shard.spec),
               "specs": {k.split("/", 1)[1]: _spec(v.spec) for k, v in _flat(p_shard).items()
                         if k.startswith("blocks_0/")}}
        if name in FORWARD:
            fwd = sh.jit_sharded(lambda p, x: model.apply({"params": p}, x).logits, mesh,
                                 (p_shard, b_shard), b_shard)
            logits = host(fwd(place(params, p_shard), place(tokens, b_shard)))[""]
            if main_process:
                run["logits_diff"] = float(np.max(np.abs(logits - ref_out.logits)))
        out["runs"][name] = run
    if jax.process_index() == 0:
        print(json.dumps(out))
    return 0


def _flat(tree) -> dict:
    leaves, _ = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    return {sh._path_str(p): x for p, x in leaves}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
