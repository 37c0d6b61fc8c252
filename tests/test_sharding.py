"""Mesh, logical rules and sharded training steps.

The multi-device claims run in ONE subprocess with 8 simulated CPU devices
(``tests/multihost_worker.py meshes``), because this pytest process must keep its single device
for the other test files; that process starts with one device and first runs the memory bench's
CLI, which must ask for the 8 itself. The cheap claims (config validation, error messages, rule
mapping, optimizer-state shardings) run here against abstract meshes.
"""

from __future__ import annotations

import json
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import multihost_worker as worker
import optax
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from transformer_jax.model.config import ModelConfig
from transformer_jax.model.fields import MLA, MoE
from transformer_jax.model.transformer import (
    abstract_params,
    init_params,
    logical_axes,
    param_count,
)
from transformer_jax.parallel import sharding as sh


def abstract_mesh(data: int, fsdp: int, tensor: int) -> AbstractMesh:
    return AbstractMesh((data, fsdp, tensor), sh.MESH_AXES, axis_types=(AxisType.Auto,) * 3)


# --------------------------------------------------------------- 8 simulated devices (subprocess)

# The mesh part of each parameter's sharding, restated from the rules: model width over
# fsdp; heads, kv heads, FFN width and vocab over tensor; head_dim and norm scales whole.
EXPECTED_SPECS = {
    "embed/embedding": ("tensor", "fsdp"),
    "attn/q_proj": ("fsdp", "tensor", None),
    "attn/k_proj": ("fsdp", "tensor", None),
    "attn/v_proj": ("fsdp", "tensor", None),
    "attn/o_proj": ("tensor", None, "fsdp"),
    "mlp/gate": ("fsdp", "tensor"),
    "mlp/up": ("fsdp", "tensor"),
    "mlp/down": ("tensor", "fsdp"),
    "attn_norm/scale": (None,),
    "mlp_norm/scale": (None,),
    "final_norm/scale": (None,),
    "lm_head": ("fsdp", "tensor"),
}
# Unrolled: dp and fsdp (weights split); scanned: tp and mixed (the mixed mesh's unrolled
# layout is checked by the sharded init below, on that mesh).
RUNS = ("dp", "fsdp_full", "tp_scan_save_dots", "mixed_scan")


# The memory bench's model: small, scanned, remat="full" (a TOML file of these fields).
MEMORY_MODEL = ModelConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                           d_ff=128, max_seq_len=64, scan_layers=True, remat="full")
MEMORY_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff",
                 "max_seq_len", "scan_layers", "remat")


@pytest.fixture(scope="module")
def meshes(tmp_path_factory) -> dict:
    """The worker's meshes mode, after ``bench memory`` (``memory_report`` the path of its
    JSON report): one process, started with one device, for both."""
    tmp = tmp_path_factory.mktemp("memory")
    toml = tmp / "small.toml"
    toml.write_text("[model]\n" + "".join(
        f"{k} = {json.dumps(getattr(MEMORY_MODEL, k))}\n" for k in MEMORY_FIELDS))
    report = tmp / "report.json"
    memory_args = ["--config", str(toml), "--mesh", "2,2,2", "--batch", "8", "--seq", "64",
                   "--json", str(report)]
    result = worker.run_worker(["meshes", "--bench-memory", json.dumps(memory_args)],
                               n_devices=1)
    return {**result, "memory_report": report}


@pytest.mark.parametrize("run", RUNS)
def test_sharded_step_matches_single_device(meshes, run):
    """Two real train steps (train_step.make_train_step) under a mesh vs on one device."""
    result = meshes["runs"][run]
    assert result["losses"] == pytest.approx(meshes["ref_losses"], rel=1e-6, abs=1e-6)
    assert any(p.startswith("params/") for p in result["diff"]), "no parameter was compared"
    for path, diff in result["diff"].items():
        if "/mu/" in path:  # first moment, about a tenth of the gradients (~1e-3 .. 1e-1)
            assert diff < 1e-7, (path, diff)
        elif "/nu/" in path:  # second moment, a twentieth of the squared gradients
            assert diff < 1e-9, (path, diff)
        else:
            # Parameters move by ~lr = 1e-3 per step: a sharding bug shows as ~1e-3. Float32
            # reduction order differs between meshes; Adam's division by sqrt(nu) + eps magnifies
            # it on near-zero gradients, which is why the worker's eps is 1e-6, not 1e-8.
            assert diff < 1e-5, (path, diff)


@pytest.mark.parametrize("run", RUNS)
def test_parameters_are_sharded_by_the_rules(meshes, run):
    result = meshes["runs"][run]
    scanned = worker.RUNS[run][1]
    config = worker.CONFIG.replace(scan_layers=scanned)
    names = {sh._path_str(p) for p, _ in
             jax.tree_util.tree_flatten_with_path(abstract_params(config))[0]}
    for specs in (result["param_specs"], result["mu_specs"], result["nu_specs"]):
        assert set(specs) == names
        for path, spec in specs.items():
            key = next(k for k in EXPECTED_SPECS if path.endswith(k))
            expected = list(EXPECTED_SPECS[key])
            if scanned and path.startswith("blocks/"):
                expected = [None] + expected  # the stacked layers axis stays whole
            assert [tuple(s) if isinstance(s, list) else s for s in spec] == expected, path


def test_per_device_parameter_bytes_shrink_by_fsdp_and_tensor(meshes):
    c = worker.CONFIG
    total = 4 * param_count(c)
    norms = 4 * (2 * c.n_layers + 1) * c.d_model  # replicated everywhere
    for run in RUNS:
        data, fsdp, tensor = meshes["runs"][run]["mesh"]
        expected = norms + (total - norms) // (fsdp * tensor)
        assert meshes["runs"][run]["param_bytes"] == expected, run
    assert meshes["runs"]["dp"]["param_bytes"] == total


@pytest.mark.parametrize("mesh", ["fsdp", "mixed"])
def test_chunked_lm_loss_under_a_mesh_equals_the_full_loss(meshes, mesh):
    """``train.loss_chunk``'s loss per device (its rows, chunked along T) vs the full logits on
    one device: value, and the gradients of x and the head (``multihost_worker.lm_loss_diffs``)."""
    r = meshes["lm_loss"][mesh]
    assert r["per_device"]  # the batch axes split B: the shard_map path was the one checked
    assert r["value"] < 1e-6
    assert r["grad_x"] < 1e-5 and r["grad_head"] < 1e-5, r


def test_shard_init_creates_the_single_device_values_in_place(meshes):
    assert meshes["shard_init"]["specs_match"]
    assert max(meshes["shard_init"]["diff"].values()) == 0.0


# ------------------------------------------------------------------------------ in-process


def test_mesh_config_resolves_the_rest():
    assert sh.MeshConfig().resolve(8) == (8, 1, 1)
    assert sh.MeshConfig(data=2, fsdp=-1, tensor=2).resolve(8) == (2, 2, 2)
    assert sh.MeshConfig.parse("1, 8,1") == sh.MeshConfig(1, 8, 1)
    assert sh.MeshConfig.from_dict({"fsdp": -1, "data": 1}).resolve(4) == (1, 4, 1)


@given(data=st.sampled_from([-1, 1, 2, 3, 4]), fsdp=st.sampled_from([-1, 1, 2, 4]),
       tensor=st.sampled_from([1, 2, 8]), n=st.integers(1, 64))
def test_mesh_config_uses_every_device_or_refuses(data, fsdp, tensor, n):
    if data == fsdp == -1:
        with pytest.raises(ValueError, match="at most one"):
            sh.MeshConfig(data, fsdp, tensor)
        return
    config = sh.MeshConfig(data, fsdp, tensor)
    try:
        sizes = config.resolve(n)
    except ValueError as e:
        assert str(n) in str(e) and config.describe() in str(e)
        return
    assert math.prod(sizes) == n
    assert all(s == c for s, c in zip(sizes, config.sizes, strict=True) if c != -1)


def test_mesh_that_does_not_fit_names_mesh_and_device_count():
    with pytest.raises(ValueError, match=r"data=2 x fsdp=2 x tensor=2 needs 8 devices but 1"):
        sh.make_mesh(sh.MeshConfig(2, 2, 2))
    with pytest.raises(ValueError, match=r"fsdp=3 .* does not fit 8 devices"):
        sh.MeshConfig(-1, 3, 1).resolve(8)
    mesh = sh.make_mesh(sh.MeshConfig())
    assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 1}


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "2"])
def test_mesh_config_rejects_bad_sizes(bad):
    with pytest.raises(ValueError, match="mesh.fsdp"):
        sh.MeshConfig(fsdp=bad)
    with pytest.raises(ValueError, match="three"):
        sh.MeshConfig.parse("1,2")


def test_indivisible_dimension_names_parameter_dim_size_and_axis():
    gqa = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=8, n_kv_heads=2, d_ff=128)
    with pytest.raises(ValueError, match=r"k_proj dimension 1 \(kv_heads\) has size 2.*"
                                         r"mesh axis tensor=4"):
        sh.param_shardings(gqa, abstract_mesh(1, 1, 4))
    odd = gqa.replace(vocab_size=250)
    with pytest.raises(ValueError, match=r"embedding dimension 0 \(vocab\) has size 250.*"
                                         r"tensor=4"):
        sh.param_shardings(odd.replace(n_kv_heads=4), abstract_mesh(1, 1, 4))
    with pytest.raises(ValueError, match=r"dimension 0 \(embed\) has size 64.*fsdp=3"):
        sh.param_shardings(gqa, abstract_mesh(1, 3, 1))


def test_logical_rules_map_every_parameter_axis_and_refuse_reuse():
    specs = jax.tree.leaves(logical_axes(ModelConfig(scan_layers=True, qkv_bias=True)),
                            is_leaf=lambda x: isinstance(x, P))
    logical = {name for spec in specs for name in spec if name}
    assert logical <= {name for name, _ in sh.LOGICAL_RULES}
    assert sh.logical_to_mesh_spec(sh.RESIDUAL_AXES) == P(("data", "fsdp"), None, None)
    with pytest.raises(ValueError, match="no sharding rule for logical axis 'nope'"):
        sh.logical_to_mesh_spec(("nope",))
    with pytest.raises(ValueError, match="mesh axis 'tensor' is used by both"):
        sh.logical_to_mesh_spec(("heads", "mlp"))


# A DeepSeek-shaped stack in miniature: latent attention with a query rank, a dense layer
# then a sparse one (experts, a shared expert, the correction bias), scanned.
LATENT_MIXTURE = ModelConfig(
    vocab_size=64, d_model=64, n_layers=2, n_heads=4, d_ff=128, max_seq_len=32,
    scan_layers=True, mla=MLA(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                              v_head_dim=8, q_lora_rank=32),
    moe=MoE(4, 2, 32, shared_d_ff=32, score="sigmoid", correction_bias=True,
            dense_layers=(0,)))


@pytest.mark.parametrize("fsdp,expert", [(4, 1), (2, 2)])
def test_no_matrix_of_a_latent_mixture_is_whole_on_a_device(fsdp, expert):
    """Every matrix (two or more axes besides the stacked layers') holds 1/(fsdp x expert) of
    itself per device: none is replicated over the data-parallel devices, whose copies (and
    their gradients and Adam moments) would be a whole per-layer share on every chip (the
    latent up-projections q_b_proj and kv_b_proj had no axis on those devices)."""
    shape = (1, fsdp, expert, 1) if expert > 1 else (1, fsdp, 1)
    axes = sh.EXPERT_MESH_AXES if expert > 1 else sh.MESH_AXES
    mesh = AbstractMesh(shape, axes, axis_types=(AxisType.Auto,) * len(shape))
    params = abstract_params(LATENT_MIXTURE)
    shardings = sh.param_shardings(LATENT_MIXTURE, mesh)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    matrices = 0
    for (path, x), s in zip(flat, jax.tree.leaves(shardings), strict=True):
        name = sh._path_str(path)
        whole = x.shape[1:] if name.startswith("scan_") else x.shape
        if len(whole) < 2:
            continue
        matrices += 1
        assert math.prod(s.shard_shape(x.shape)) * fsdp * expert == math.prod(x.shape), name
    assert matrices >= 15  # the attention's 6, router, experts' 3, shared 3, dense 3, embed


def test_optimizer_state_mirrors_parameter_shardings():
    config = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=8, d_ff=128)
    p_shard = sh.param_shardings(config, abstract_mesh(2, 2, 2))
    no_decay = lambda params: jax.tree.map(lambda x: x.ndim > 1, params)  # noqa: E731
    opt = optax.MultiSteps(optax.chain(optax.clip_by_global_norm(1.0),
                                       optax.adamw(1e-3, mask=no_decay)), every_k_schedule=2)

    def init(rng):
        params = init_params(config, rng)
        return {"params": params, "opt_state": opt.init(params), "rng": rng}

    abstract = jax.eval_shape(init, jax.random.key(0))
    s_shard = sh.state_shardings(abstract, p_shard)
    flat_params = dict(jax.tree_util.tree_flatten_with_path(p_shard)[0])
    mirrored = 0
    for path, sharding in jax.tree_util.tree_flatten_with_path(s_shard)[0]:
        leaf_path = sh._path_str(path)
        owner = [p for p in flat_params if leaf_path.endswith(sh._path_str(p))]
        if owner:
            assert sharding == flat_params[owner[0]], leaf_path
            mirrored += 1
        else:
            assert sharding.spec == P(), leaf_path
    n_params = len(flat_params)
    # params, mu, nu and MultiSteps' accumulated gradients mirror the parameters.
    assert mirrored == 4 * n_params


def test_param_count_matches_shardings_tree():
    config = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=8, d_ff=128)
    shardings = sh.param_shardings(config, abstract_mesh(1, 2, 2))
    assert jax.tree.structure(shardings) == jax.tree.structure(abstract_params(config))
    norms = (2 * config.n_layers + 1) * config.d_model
    assert sh.per_device_bytes(abstract_params(config), shardings) == 4 * (
        (param_count(config) - norms) // (2 * 2) + norms)


def test_jit_train_step_resolves_logical_constraints_inside_the_step():
    mesh = sh.make_mesh(sh.MeshConfig())

    def step(state, batch):
        x = nn.with_logical_constraint(batch["x"] * state["w"], sh.RESIDUAL_AXES)
        return {"w": state["w"] + x.mean()}, {"loss": x.sum()}

    state = {"w": jnp.ones(())}
    s_shard = {"w": sh.replicated(mesh)}
    jitted = sh.jit_train_step(step, s_shard, sh.batch_sharding(mesh))
    batch = {"x": jnp.ones((2, 3, 4))}
    text = jitted.lower(state, batch).as_text()
    assert 'sharding_constraint' in text and '{"data", "fsdp"}' in text
    new_state, metrics = jitted(state, batch)
    assert float(metrics["loss"]) == 24.0 and float(new_state["w"]) == 2.0
    assert isinstance(new_state["w"].sharding, NamedSharding)
    # Outside the step the rules are not in force: the model's constraints are no-ops.
    assert nn.with_logical_constraint(batch["x"], sh.RESIDUAL_AXES) is batch["x"]


# ------------------------------------------------------------------------- memory benchmark


def _hand_param_count(c: ModelConfig) -> tuple[int, int]:
    """(all parameters, norm scales) from the LLaMA formulas."""
    attn = c.d_model * (c.n_heads + 2 * c.n_kv_heads) * c.head_dim + c.n_heads * c.head_dim * (
        c.d_model)
    ffn = 3 * c.d_model * c.d_ff
    norms = (2 * c.n_layers + 1) * c.d_model
    embed = c.vocab_size * c.d_model * (1 if c.tie_embeddings else 2)
    return embed + c.n_layers * (attn + ffn) + norms, norms


@pytest.mark.parametrize("preset", ["llama2_7b", "mistral_7b", "llama3_8b"])
def test_memory_report_matches_hand_formula(preset):
    from transformer_jax.bench.memory import state_memory
    from transformer_jax.train.config import TrainConfig

    config = ModelConfig.preset(preset)
    total, norms = _hand_param_count(config)
    for sizes in [(8, 1, 1), (1, 8, 1), (1, 1, 8), (2, 2, 2), (1, 16, 4)]:
        _, fsdp, tensor = sizes
        report = state_memory(config, sizes, TrainConfig(batch_size=8, seq_len=128))
        # Every matrix splits over fsdp (its model-width axis) and tensor; norms are replicated.
        params = 4 * ((total - norms) // (fsdp * tensor) + norms)
        assert report["param_count"] == total
        assert report["params"] == params, sizes
        assert report["adam"] == 2 * params, sizes  # mu and nu, float32, sharded alike
        assert report["state"] - report["params"] - report["adam"] < 1024  # counters, rng


def test_memory_cli_compiles_on_simulated_devices(meshes):
    """The CLI (``bench``'s main) in a fresh process: 8 simulated devices, a compiled step,
    per-device numbers."""
    # Started with one device: the bench itself must ask for the 8 it needs.
    bench = meshes["bench_memory"]
    assert bench["error"] is None and bench["status"] == 0, bench
    assert "Adam mu+nu" in bench["printed"]
    report = json.loads(meshes["memory_report"].read_text())
    total, norms = _hand_param_count(MEMORY_MODEL)
    assert report["mesh"] == [2, 2, 2] and report["remat"] == "full"
    assert report["param_count"] == total
    assert report["params_bytes"] == 4 * ((total - norms) // 4 + norms)
    # XLA's per-device arguments are this device's state plus its rows of the batch
    # (inputs and targets: 8 / (data * fsdp) rows of 64 int32).
    batch_bytes = 2 * (8 // 4) * 64 * 4
    assert report["compiled"]["argument"] == report["state_bytes"] + batch_bytes
    assert report["compiled"]["temp"] > 0 and report["activations_bytes"] > 0
