"""Expert parallelism: the ``expert`` mesh axis, its logical rules, and the mixture's tokens
dispatched to their experts' devices by all_to_all (``model/ops/moe_dispatch.py``).

The multi-device claims run in ONE launch of two processes with 4 simulated CPU devices each,
joined by ``jax.distributed`` over gloo (``tests/moe_parallel_worker.py``): process 0 trains
the single-device references on its own first device, then both the same steps on 8-device
meshes spanning both processes: a DeepSeek-shaped model with the expert axis at 8 (its
all_to_alls across the processes), and a GPT-OSS-shaped one (q/k/v and o biases, sinks, a
sliding window, the router's bias, biased experts, the clamped SwiGLU) at expert 2 x fsdp 2 x
tensor 2. The cheap claims (config, rules, what is traced, expert x data) run here on abstract
meshes.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import moe_parallel_worker as ep
import multihost_worker as worker
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P

from transformer_jax.model.fields import MoE
from transformer_jax.model.ops import moe_dispatch
from transformer_jax.model.transformer import Transformer, init_params
from transformer_jax.parallel import sharding as sh

N_PROCESSES, DEVICES_PER_PROCESS = 2, 4


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs() -> dict:
    coordinator = f"127.0.0.1:{_free_port()}"
    procs = [subprocess.Popen(
        [sys.executable, ep.__file__, "--coordinator", coordinator, "--num-processes",
         str(N_PROCESSES), "--process-id", str(i)],
        cwd=worker.ROOT, env=worker.worker_env(DEVICES_PER_PROCESS), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True) for i in range(N_PROCESSES)]
    outs = []
    try:
        for i, proc in enumerate(procs):
            out, err = proc.communicate(timeout=600)
            if proc.returncode:
                pytest.fail(f"process {i} failed:\n{err[-4000:]}")
            outs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return json.loads(outs[0].strip().splitlines()[-1])


def abstract_mesh(**sizes: int) -> AbstractMesh:
    config = sh.MeshConfig(**sizes)
    return AbstractMesh(config.sizes, config.axes, axis_types=(AxisType.Auto,) * len(config.axes))


# ------------------------------------------------------------ 2 processes x 4 devices (subprocess)


@pytest.mark.parametrize("name", list(ep.MESHES))
def test_expert_parallel_training_equals_one_device_at_every_step(runs, name):
    """``ep.STEPS`` real train steps (``make_train_step``, sharded jit): loss and gradient norm
    of every step as on one device, and the parameters and Adam moments at the end too (a wrong
    gradient factor, which Adam's normalisation would hide from the loss, shows in mu)."""
    run = runs["runs"][name]
    ref = runs["ref"][run["model"]]
    assert runs["processes"] == N_PROCESSES and runs["devices"] == 8
    assert len(run["loss"]) == ep.STEPS == len(ref["loss"])
    assert ref["loss"][-1] < ref["loss"][0] - 0.3  # it trains
    np.testing.assert_allclose(run["loss"], ref["loss"], rtol=0, atol=2e-4)
    np.testing.assert_allclose(run["grad_norm"], ref["grad_norm"], rtol=5e-4)
    assert any("/moe/" in k and "/mu/" in k for k in run["diff"]), "no expert moment compared"
    if run["model"] == "deepseek":
        # The correction bias, moved by the balancing update, is the reference's on every mesh.
        assert run["diff"]["params/blocks_0/moe/correction_bias"] == 0.0
        assert np.abs(runs["ref_bias"]).max() > 0.015
    else:  # every GPT-OSS bias and sink, and their moments, compared in both layers
        for layer in range(ep.GPT_OSS.n_layers):
            for leaf in ("attn/q_bias", "attn/o_bias", "attn/sinks", "moe/router_bias",
                         "moe/gate_bias", "moe/up_bias", "moe/down_bias"):
                for kind in ("params/", "opt/1/0/mu/"):
                    assert f"{kind}blocks_{layer}/{leaf}" in run["diff"], (kind, layer, leaf)
    worst = max(run["diff"].items(), key=lambda kv: kv[1])
    assert worst[1] < 3e-3, worst


def test_meshes_have_the_expert_axis_and_dispatch_by_all_to_all(runs):
    expected = {"expert8": (1, 1, 8, 1), "gpt_oss_expert2_fsdp2_tensor2": (1, 2, 2, 2)}
    assert set(runs["runs"]) == set(expected)
    for name, run in runs["runs"].items():
        assert tuple(run["mesh"]) == sh.EXPERT_MESH_AXES
        assert tuple(run["mesh"].values()) == expected[name]
        # Two exchanges each way per sparse layer and step, forward and backward.
        layers = len(ep.MODELS[run["model"]].sparse_layers)
        assert run["all_to_all"] >= 4 * layers, (name, run["all_to_all"])


def test_experts_and_their_biases_split_over_expert_and_the_rest_over_fsdp_and_expert(runs):
    """The experts and their biases split over expert (E), tensor (F) and fsdp (D); the
    attention's weights over fsdp x expert and tensor, its biases and sinks over their heads,
    the router's bias whole."""
    run = runs["runs"]["gpt_oss_expert2_fsdp2_tensor2"]
    assert run["model"] == "gpt_oss" and run["batch_spec"] == [["data", "fsdp", "expert"]]
    specs = run["specs"]
    assert specs["moe/gate"] == specs["moe/up"] == ["expert", "fsdp", "tensor"]
    assert specs["moe/down"] == ["expert", "tensor", "fsdp"]
    assert specs["moe/gate_bias"] == specs["moe/up_bias"] == ["expert", "tensor"]
    assert specs["moe/down_bias"] == ["expert", "fsdp"]
    assert specs["moe/router"] == [["fsdp", "expert"], None]
    assert specs["moe/router_bias"] == [None]
    assert specs["attn/q_proj"] == [["fsdp", "expert"], "tensor", None]
    assert specs["attn/o_proj"] == ["tensor", None, ["fsdp", "expert"]]
    assert specs["attn/q_bias"] == specs["attn/k_bias"] == ["tensor", None]
    assert specs["attn/sinks"] == ["tensor"]
    assert specs["attn/o_bias"] == [["fsdp", "expert"]]


def test_gpt_oss_forward_without_the_exchange_equals_one_device(runs):
    """A decode's batch rule (the expert axis left out): no all_to_all, each device its experts'
    share of every token (biases included, the down bias once over the tensor split), summed
    by one psum."""
    run = runs["runs"][ep.SHARES]
    assert run["shares_all_to_all"] == 0
    assert run["shares_logits_diff"] < 1e-5


@pytest.mark.parametrize("name", ep.FORWARD)
def test_forward_with_experts_that_receive_no_token_equals_one_device(runs, name):
    """The routers send every token to experts 0, 1, 6 or 7: with 8 expert devices, devices 2
    to 5 receive no token at all."""
    load = np.asarray(runs["ref_load"])
    assert load.shape == (ep.CONFIG.n_layers, ep.E)
    assert np.all(load[:, list(ep.EMPTY)] == 0)
    assert np.all(np.delete(load, list(ep.EMPTY), axis=1) > 0)
    assert runs["runs"][name]["logits_diff"] < 1e-5


# -------------------------------------------------------------------------- this process


def test_mesh_config_expert_axis():
    assert sh.MeshConfig().axes == sh.MESH_AXES  # no expert axis: the mesh of before
    assert sh.MeshConfig.parse("1,8,1") == sh.MeshConfig(1, 8, 1)
    config = sh.MeshConfig.parse("-1,1,1,4")
    assert config == sh.MeshConfig.parse("expert=4, data=-1") == sh.MeshConfig(expert=4)
    assert config.axes == ("data", "fsdp", "expert", "tensor")
    assert config.resolve(8) == (2, 1, 4, 1)
    assert config.describe() == "data=-1 x fsdp=1 x expert=4 x tensor=1"
    assert sh.MeshConfig.from_dict({"expert": 2, "fsdp": -1, "data": 1}).resolve(8) == (1, 4, 2, 1)
    mesh = sh.make_mesh(sh.MeshConfig())
    assert mesh.axis_names == sh.MESH_AXES


@pytest.mark.parametrize("text, message", [
    ("1,1,1,0", "mesh.expert must be a positive int"),
    ("1,1,1,-1", "mesh.expert must be a positive int"),
    ("exprt=2", "did you mean 'expert'"),
    ("expert=2,expert=4", "names an axis twice"),
    ("1,expert=2", "mixes named and plain sizes"),
    ("1,2", "three sizes data,fsdp,tensor (a fourth: expert)"),
    ("expert=x", "must be integer"),
])
def test_mesh_config_refuses_bad_expert_sizes(text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        sh.MeshConfig.parse(text)
    with pytest.raises(ValueError, match="needs 8 devices but 4"):
        sh.MeshConfig(data=1, expert=8).resolve(4)


def test_rules_without_an_expert_axis_are_those_of_before():
    plain = abstract_mesh(data=2, fsdp=2, tensor=2)
    assert sh.rules_for(plain) is sh.LOGICAL_RULES
    assert not any("expert" in sh._as_tuple(axes) for _, axes in sh.LOGICAL_RULES)
    assert sh.batch_sharding(plain).spec == P(("data", "fsdp"))
    assert sh.batch_devices(plain) == 4
    table = dict(sh.LOGICAL_RULES)
    assert (table["experts"], table["expert_embed"], table["expert_mlp"], table["router"]) == (
        None, "fsdp", "tensor", None)


def test_expert_rules_split_experts_and_use_the_axis_as_fsdp_elsewhere():
    mesh = abstract_mesh(data=2, expert=4)
    assert sh.rules_for(mesh) is sh.EXPERT_RULES
    table = dict(sh.EXPERT_RULES)
    assert table["experts"] == "expert" and table["expert_embed"] == "fsdp"
    assert table["expert_mlp"] == "tensor" and table["router"] is None
    assert table["batch"] == ("data", "fsdp", "expert") and table["embed"] == ("fsdp", "expert")
    assert table["latent_rank"] == table["embed"]  # latent attention's ranks split like embed
    changed = ("batch", "embed", "latent_rank", "experts")
    assert {k: v for k, v in table.items() if k not in changed} == {
        k: v for k, v in dict(sh.LOGICAL_RULES).items() if k not in changed}
    assert sh.batch_devices(mesh) == 8


MOE_MODEL = ep.CONFIG  # one layer


def _trace(config, mesh, rules):
    """The jaxpr of the forward traced under ``mesh`` and ``rules`` (as ``jit_sharded`` does)."""
    params = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    tokens = jax.ShapeDtypeStruct((8, 4), jnp.int32)

    def forward(p, x):
        with jax.sharding.use_abstract_mesh(mesh), nn.logical_axis_rules(rules):
            return Transformer(config).apply({"params": p}, x).logits

    return str(jax.make_jaxpr(forward)(params, tokens))


def test_sparse_ffn_dispatches_only_when_the_experts_are_split():
    expert = abstract_mesh(data=2, expert=4)
    assert "all_to_all" in _trace(MOE_MODEL, expert, sh.EXPERT_RULES)
    # No expert axis (or rules that leave the experts whole): no shard_map, no exchange.
    for mesh, rules in ((abstract_mesh(data=2, fsdp=2, tensor=2), sh.LOGICAL_RULES),
                        (expert, sh.LOGICAL_RULES)):
        text = _trace(MOE_MODEL, mesh, rules)
        assert "all_to_all" not in text and "shard_map" not in text


def test_expert_split_is_none_without_a_split_expert_axis():
    def split(mesh, experts="expert"):
        return moe_dispatch.expert_split(mesh, ("data", "fsdp"), experts, "fsdp", "tensor")

    assert split(AbstractMesh((), ())) is None
    assert split(abstract_mesh(data=8)) is None  # the rules name an axis the mesh lacks
    assert split(abstract_mesh(data=8), experts=None) is None
    one = AbstractMesh((8, 1), ("data", "expert"), axis_types=(AxisType.Auto,) * 2)
    assert split(one) is None
    manual = AbstractMesh((2, 4), ("data", "expert"), axis_types=(AxisType.Auto,
                                                                  AxisType.Manual))
    assert split(manual) is None  # already inside a shard_map over it
    # The batch split over the expert axis too (training's rules): tokens are exchanged.
    got = moe_dispatch.expert_split(abstract_mesh(data=2, expert=4), ("data", "fsdp", "expert"),
                                    "expert", "fsdp", "tensor")
    assert (got.tokens, got.experts, got.embed, got.mlp, got.exchange) == (
        ("data", "fsdp", "expert"), ("expert",), ("fsdp",), ("tensor",), True)
    assert (got.n_shards, got.token_shards) == (4, 8)
    # A batch rule without the expert axis (a decode's): each device its experts' share.
    got = split(abstract_mesh(data=2, expert=4))
    assert (got.tokens, got.exchange, got.n_shards, got.token_shards) == (
        ("data", "fsdp"), False, 4, 2)


def test_experts_not_divisible_by_the_expert_axis_name_the_field():
    config = MOE_MODEL.replace(moe=MoE(n_experts=6, top_k=2, d_ff=24))
    with pytest.raises(ValueError, match=r"moe.n_experts=6 is not divisible by the 4 devices"):
        _trace(config, abstract_mesh(data=2, expert=4), sh.EXPERT_RULES)
    with pytest.raises(ValueError, match=r"dimension 0 \(experts\) has size 6.*expert=4"):
        sh.param_shardings(config, abstract_mesh(data=2, expert=4))
