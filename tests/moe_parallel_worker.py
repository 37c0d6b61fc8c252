"""Subprocess side of ``test_moe_parallel.py``: expert parallelism on simulated CPU devices.

Run as one of ``--num-processes`` processes (joined through ``jax.distributed`` over gloo when
more than one) that together hold 8 devices. Process 0 first runs the single-device reference
of each model of ``MODELS`` on its own first device (plain ``jax.jit``, no mesh, no sharding
code), then every process the same ``STEPS`` training steps under each mesh of ``MESHES``
(``parallel.sharding``'s sharded jit, as ``train.run`` does), the forward of a model whose
routers leave experts without tokens, and GPT-OSS's forward with the tokens not exchanged (a
decode's batch rule). Process 0 prints one JSON object on its last stdout line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

# Importing jax before jax.distributed.initialize is fine; touching a device is not.
import jax
import numpy as np
from helpers import random_params  # (and its GC thresholds, for this process too)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from transformer_jax.model.config import ModelConfig
from transformer_jax.model.fields import MoE
from transformer_jax.model.moe import CORRECTION_BIAS
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
# GPT-OSS's shape: q/k/v and o biases, a sink logit per head, a sliding window, the router's
# bias with top-k then softmax over the chosen (softmax, renormalised), biased experts and the
# clamped SwiGLU (gate slope 1.702, up offset 1): a limit of 1.5 clamps about a fifth of the
# first step's expert gates (from above) and two fifths of its ups (either side), so both sides
# of the clamp train. Its biases and sinks start N(0, 0.5) (``first_state``), so every one of
# them shapes the first step's loss. One (sliding, sparse) layer, as DeepSeek's: a full layer
# beside it made the mesh's step compile about 1.7 times as long, and a window is a mask
# (the sequence is not split here).
GPT_OSS = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                      head_dim=8, d_ff=48, max_seq_len=32, init_std=0.3, sliding_window=4,
                      qkv_bias=True, o_bias=True, attn_sinks=True, swiglu_limit=1.5,
                      swiglu_alpha=1.702, swiglu_up_offset=1.0,
                      moe=MoE(n_experts=E, top_k=K, d_ff=24, router_bias=True,
                              expert_bias=True))
MODELS = {"deepseek": CONFIG, "gpt_oss": GPT_OSS}
#: The spread of each model's first biases and sinks (``first_state``).
BIAS_STD = {"deepseek": 0.0, "gpt_oss": 0.5}
# Every step across the processes costs both of them gloo collectives (most of a step's time on
# a 2-core CPU): 6 steps train (the references' losses fall by 0.60 for DeepSeek at 4e-2 and
# 0.43 for GPT-OSS at 1e-2) and leave the meshes close to them (largest relative state
# difference 1e-4 for DeepSeek and 3e-5 for GPT-OSS, against the test's bound of 3e-3; the
# correction bias, moved by up to 0.04, equal). GPT-OSS's steps at 4e-2 are chaotic: of 3
# draws of its parameters one left the mesh 0.18 from one device (a clamp or a routing turned
# by float noise, then amplified); at 1e-2 all of 6 draws stayed within 6.4e-5.
B, T, STEPS = 8, 16, 6
TRAIN = TrainConfig(steps=100, batch_size=B, seq_len=T, lr=4e-2, min_lr=4e-2, warmup_steps=0,
                    eps=1e-6, moe_balance_loss=0.1, moe_bias_update_rate=1e-2)
TRAINS = {"deepseek": TRAIN, "gpt_oss": dataclasses.replace(TRAIN, lr=1e-2, min_lr=1e-2)}
#: name -> (model, mesh); every mesh spans 8 devices (across the processes when there are
#: several). The dispatch does not depend on how the experts were chosen or what the router,
#: attention and shared expert around it are, so each model runs on one mesh: DeepSeek's at
#: expert 8 (all_to_alls across the processes, one expert a device), GPT-OSS's at expert 2 x
#: fsdp 2 x tensor 2 (expert x fsdp and expert x tensor in one mesh, its expert biases split
#: over every axis: E over expert, F over tensor, D over fsdp). Expert x data is checked only in
#: this file's in-process tests: each compile costs both processes seconds.
MESHES = {
    "expert8": ("deepseek", sh.MeshConfig(data=1, expert=8)),
    "gpt_oss_expert2_fsdp2_tensor2": ("gpt_oss",
                                      sh.MeshConfig(data=1, fsdp=2, expert=2, tensor=2)),
}
#: The meshes the forward is checked on too.
FORWARD = ("expert8",)
#: The mesh GPT-OSS's forward is checked on with a batch rule that leaves the expert axis out
#: (a decode's: no exchange, each device its experts' share of every token, one psum).
SHARES = "gpt_oss_expert2_fsdp2_tensor2"
#: The forward check's routers send every token to experts 0, 1 or 6, 7 (by the sign of one
#: feature), so experts 2-5 (with 8 expert devices: devices 2 to 5) get no token.
EMPTY = (2, 3, 4, 5)
ROUTE_ROW = np.array([3.0, 2.0, 0.0, 0.0, 0.0, 0.0, -2.0, -3.0], np.float32)


def batches() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(STEPS):
        tokens = rng.integers(0, CONFIG.vocab_size, (B, T + 1), np.int32)  # GPT_OSS's vocab too
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
    """A (possibly multi-process) tree gathered whole on every process, by path: its global
    arrays replicated over their mesh by one program (``process_allgather`` leaf by leaf
    compiled a gather per leaf, some 40 of a state)."""
    spread = [x for x in jax.tree.leaves(tree)
              if isinstance(x, jax.Array) and not x.is_fully_addressable]
    if spread:
        whole = NamedSharding(spread[0].sharding.mesh, P())
        tree = jax.jit(lambda t: t, out_shardings=jax.tree.map(lambda _: whole, tree))(tree)
    leaves, _ = jax.tree_util.tree_flatten_with_path(jax.device_get(tree))
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


def first_state(config: ModelConfig, init, bias_std: float = 0.0):
    """The state training starts from: the model's parameters distributed as ``init_params``
    draws them (matrices N(0, init_std), the output projections' N(0, init_std / sqrt(2L)),
    norm gains 1), biases and sink logits N(0, bias_std) (0: as initialised; the correction
    bias always 0), the optimizer's state fresh. The draws are numpy's
    (``helpers.random_params``): no init program compiles, where a jitted ``init_params``
    costs each process seconds per model on a 2-core CPU."""
    out_std = config.init_std / (2 * config.n_layers) ** 0.5

    def one(path, x):  # x ~ N(0, 1)
        name = path[-1].key
        if name == "scale":
            return np.ones_like(x)
        if name.endswith("_bias") or name == "sinks":
            return x * (0.0 if name == CORRECTION_BIAS else bias_std)
        return x * (out_std if name in ("o_proj", "down") else config.init_std)

    params = jax.tree_util.tree_map_with_path(one, random_params(config, seed=2, std=1.0))
    return jax.device_get(jax.jit(init)(jax.random.key(0), params))


def shares_rules() -> tuple:
    """The expert mesh's rules with the batch split over data x fsdp only (a decode's)."""
    return tuple((name, ("data", "fsdp") if name == "batch" else axes)
                 for name, axes in sh.EXPERT_RULES)


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
    data = batches()
    one = jax.local_devices()[0]
    fns = {name: (make_init_fn(c, TRAINS[name]), make_train_step(c, TRAINS[name]))
           for name, c in MODELS.items()}
    states = {name: first_state(MODELS[name], init, BIAS_STD[name])
              for name, (init, _) in fns.items()}
    model = Transformer(CONFIG)
    params, tokens = routed_params(states["deepseek"].params), data[0]["inputs"]
    # Only process 0 reports, so only it runs the references (one device of its own, plain
    # jit, no mesh); the others wait for it at a barrier of the coordination service (which,
    # unlike a collective of the first sharded step, waits as long as it is told to).
    main_process = jax.process_index() == 0
    out = {"processes": jax.process_count(), "devices": jax.device_count(), "runs": {},
           "ref": {}}
    refs = {}
    ref_out = gpt_oss_logits = None
    if main_process:
        for name, (_, step) in fns.items():
            ref_state, out["ref"][name] = train(jax.device_put(states[name], one),
                                                jax.jit(step), lambda b: jax.device_put(b, one),
                                                data)
            refs[name] = host({"params": ref_state.params, "opt": ref_state.opt_state})
        out["ref_bias"] = refs["deepseek"]["params/blocks_0/moe/correction_bias"].tolist()
        ref_out = jax.device_get(jax.jit(lambda p, x: model.apply({"params": p}, x))(
            jax.device_put(params, one), jax.device_put(tokens, one)))
        out["ref_load"] = np.asarray(ref_out.moe["load"]).tolist()
        gpt_oss_logits = jax.device_get(jax.jit(
            lambda p, x: Transformer(GPT_OSS).apply({"params": p}, x).logits)(
                jax.device_put(states["gpt_oss"].params, one), jax.device_put(tokens, one)))
    if jax.process_count() > 1:
        from jax._src import distributed as jax_distributed

        jax_distributed.global_state.client.wait_at_barrier("reference", 600_000)
    for name, (model_name, mesh_config) in MESHES.items():
        config, (_, step), state0 = MODELS[model_name], fns[model_name], states[model_name]
        mesh = sh.make_mesh(mesh_config)
        p_shard = sh.param_shardings(config, mesh)
        s_shard = sh.state_shardings(state0, p_shard)
        b_shard = sh.batch_sharding(mesh)
        state = place(state0, s_shard)
        compiled = sh.jit_train_step(step, s_shard, b_shard).lower(
            state, place(data[0], b_shard)).compile()
        state, curves = train(state, compiled, lambda b, s=b_shard: place(b, s), data)
        run = {"model": model_name, "mesh": dict(mesh.shape), **curves,
               "diff": state_diff(state, refs.get(model_name)),
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
        if name == SHARES:
            rules = shares_rules()
            p_rules = sh.param_shardings(config, mesh, rules)
            b_rules = sh.batch_sharding(mesh, rules)
            fwd = sh.jit_sharded(lambda p, x, c=config: Transformer(c).apply(
                {"params": p}, x).logits, mesh, (p_rules, b_rules), b_rules, rules=rules)
            inputs = (place(state0.params, p_rules), place(tokens, b_rules))
            shares = fwd.lower(*inputs).compile()
            run["shares_all_to_all"] = shares.as_text().count("all-to-all(")
            logits = host(shares(*inputs))[""]
            if main_process:
                run["shares_logits_diff"] = float(np.max(np.abs(logits - gpt_oss_logits)))
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
