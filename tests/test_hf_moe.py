"""HuggingFace conversion of the mixtures of experts: Mixtral, Qwen2-MoE and Qwen3-MoE.

Each case's tiny random transformers model (float32, eager attention, GQA, an odd number of
experts, top-k 1, 2 or k = E, a shared expert or none, dense layers from ``mlp_only_layers`` or
``decoder_sparse_step``, windows) is built once per module and saved with ``save_pretrained``
(one tensor per expert, as every Hub checkpoint): ``hf.load`` must give its logits within 1e-4
with each experts implementation, the same router logits and top-k choices on every token of
every sparse layer, and ``hf.save`` of those params must be read by ``from_pretrained`` as the
same model. The stacked layout (``save_original_format=False``) must load as the same params.
Greedy generation is compared with transformers' ``generate`` on left-padded ragged prompts.

Needs the ``hf`` extra (torch, transformers, safetensors); skipped without it.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    FAST_COMPILE,
    HF_CLASSES,
    ragged_inputs,
    random_hf_model,
    torch_logits,
    write_chatml_tokenizer,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from transformer_jax import hf  # noqa: E402  (needs the optional extra checked above)
from transformer_jax.checkpoint import loading  # noqa: E402
from transformer_jax.decode import generation  # noqa: E402
from transformer_jax.model.config import ModelConfig  # noqa: E402
from transformer_jax.model.fields import MoE  # noqa: E402
from transformer_jax.model.ops import moe as moe_ops  # noqa: E402
from transformer_jax.model.transformer import Transformer  # noqa: E402
from transformer_jax.parallel import sharding  # noqa: E402

pytestmark = pytest.mark.usefixtures("fast_generate_compiles")

B, T, V, D, H = 2, 12, 97, 32, 8
WINDOW = 4  # shorter than T and than the generated sequences
TOL = 1e-4
SIZES = dict(vocab_size=V, hidden_size=D, intermediate_size=40, num_attention_heads=4,
             num_key_value_heads=2, head_dim=H, max_position_embeddings=1024)


@dataclasses.dataclass(frozen=True)
class Case:
    family: str  # the HF model type
    hf_kwargs: dict
    moe: MoE  # what the loaded config's moe must be
    expect: dict  # other ModelConfig fields the loaded config must have
    ablate: dict  # changing this must change the logits (the field is used)


CASES = {
    # Every layer sparse and local, k = 2 of 3, renormalised.
    "mixtral": Case("mixtral", dict(num_hidden_layers=2, num_local_experts=3,
                                    num_experts_per_tok=2, sliding_window=WINDOW),
                    MoE(n_experts=3, top_k=2, d_ff=40),
                    dict(sliding_window=WINDOW, layer_pattern=(), qkv_bias=False),
                    ablate=dict(renormalize=False)),
    # Layer 1 dense (mlp_only_layers), a gated shared expert, raw top-2 of 5 weights, biases.
    "qwen2_moe": Case("qwen2_moe", dict(num_hidden_layers=3, num_experts=5, num_experts_per_tok=2,
                                        moe_intermediate_size=16,
                                        shared_expert_intermediate_size=24, mlp_only_layers=[1]),
                      MoE(n_experts=5, top_k=2, d_ff=16, renormalize=False, shared_d_ff=24,
                          shared_gate=True, dense_layers=(1,)),
                      dict(qkv_bias=True, d_ff=40, sliding_window=None),
                      ablate=dict(renormalize=True)),
    # Every second layer sparse (decoder_sparse_step=2), top-1 renormalised (weight 1), layers
    # [local, global] by Qwen2MoeConfig's default layer_types, no biases.
    "qwen2_moe-step": Case("qwen2_moe", dict(
        num_hidden_layers=2, num_experts=3, num_experts_per_tok=1, moe_intermediate_size=16,
        shared_expert_intermediate_size=8, decoder_sparse_step=2, norm_topk_prob=True,
        qkv_bias=False, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
        MoE(n_experts=3, top_k=1, d_ff=16, shared_d_ff=8, shared_gate=True, sparse_step=2),
        dict(qkv_bias=False, layer_pattern=("local", "global"), sliding_window=WINDOW),
        ablate=dict(renormalize=False)),
    # k = E = 5 (every expert on every token), QK-norm, every layer local.
    "qwen3_moe": Case("qwen3_moe", dict(num_hidden_layers=2, num_experts=5, num_experts_per_tok=5,
                                        moe_intermediate_size=16, norm_topk_prob=True,
                                        use_sliding_window=True, sliding_window=WINDOW),
                      MoE(n_experts=5, top_k=5, d_ff=16),
                      dict(qk_norm="head", sliding_window=WINDOW, layer_pattern=()),
                      ablate=dict(top_k=4)),
}
#: Every layer sparse: these also load scanned.
SCANNABLE = ("mixtral", "qwen3_moe")

#: [B, T] tokens and positions; the second row starts at position 300 (past the window).
INPUTS = ragged_inputs(B, T, V)


def _max_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)))


@dataclasses.dataclass(frozen=True)
class Family:
    """One case's HF model and checkpoint, its outputs on ``INPUTS``, and ours from ``load``."""

    name: str
    case: Case
    model: object  # the transformers model
    path: object  # its save_pretrained directory
    logits: np.ndarray  # HF's [B, T, V]
    router_logits: tuple  # HF's, per sparse layer [B*T, E]
    config: ModelConfig  # hf.load's
    params: dict
    ours: object  # our forward's Output
    router_inputs: dict  # layer -> our FFN norm's output [B, T, D] in that forward


def _forward(config: ModelConfig, params, tokens: np.ndarray, positions: np.ndarray,
             capture: bool = False):
    """Our forward (jitted with the fast compile options), with ``capture`` the FFN norms'
    outputs too."""
    def run(params, tokens, positions):
        return Transformer(config).apply(
            {"params": params}, tokens, positions=positions, mutable=["intermediates"],
            capture_intermediates=lambda m, _: capture and m.name == "mlp_norm")

    return jax.jit(run, compiler_options=FAST_COMPILE)(params, jnp.asarray(tokens),
                                                        jnp.asarray(positions))


@pytest.fixture(scope="module", params=list(CASES))
def family(request, tmp_path_factory) -> Family:
    case = CASES[request.param]
    model = random_hf_model(case.family, **{**SIZES, **case.hf_kwargs})
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    tokens, positions = INPUTS
    with torch.no_grad():
        theirs = model(torch.tensor(tokens, dtype=torch.long),
                       position_ids=torch.tensor(positions, dtype=torch.long),
                       output_router_logits=True)
    config, params = hf.load(path)
    ours, state = _forward(config, params, *INPUTS, capture=True)
    inputs = {i: state["intermediates"][f"blocks_{i}"]["mlp_norm"]["__call__"][0]
              for i in config.sparse_layers}
    return Family(request.param, case, model, path, theirs.logits.float().numpy(),
                  theirs.router_logits, config, params, ours, inputs)


def test_logits_match_transformers(family):
    f, case = family, family.case
    assert f.config.moe == case.moe
    for field, value in case.expect.items():
        assert getattr(f.config, field) == value, field
    diff = _max_diff(np.asarray(f.ours.logits), f.logits)
    assert diff <= TOL, f"{f.name}: max abs diff {diff}"
    if case.ablate:
        ablated = f.config.replace(moe=dataclasses.replace(f.config.moe, **case.ablate))
        worse = _max_diff(np.asarray(_forward(ablated, f.params, *INPUTS)[0].logits), f.logits)
        assert worse > 100 * TOL, f"{f.name}: {case.ablate} does not matter ({worse})"


def test_router_logits_and_choices_match_transformers(family):
    """Per sparse layer: our router's logits on our own hidden states (the FFN norm's output,
    captured in our forward) against transformers' ``router_logits``; ``ops.moe.route``'s top-k
    experts against ``torch.topk`` of transformers' softmax, token by token; and the per-expert
    load our forward reports against the counts of transformers' choices."""
    f = family
    m = f.config.moe
    assert len(f.router_logits) == len(f.config.sparse_layers) == f.ours.moe["load"].shape[0]
    for j, (layer, hf_logits) in enumerate(zip(f.config.sparse_layers, f.router_logits,
                                               strict=True)):
        router = f.params[f"blocks_{layer}"]["moe"]["router"]
        logits = f.router_inputs[layer].reshape(B * T, D) @ router
        np.testing.assert_allclose(np.asarray(logits), hf_logits.numpy(), atol=TOL, rtol=0)
        ours = np.asarray(moe_ops.route(logits, m.top_k, m.renormalize).experts)
        chosen = torch.topk(torch.softmax(hf_logits, -1), m.top_k, dim=-1).indices.numpy()
        np.testing.assert_array_equal(ours, chosen, err_msg=f"{f.name} layer {layer}")
        np.testing.assert_array_equal(np.asarray(f.ours.moe["load"][j]),
                                      np.bincount(chosen.ravel(), minlength=m.n_experts))


@pytest.mark.parametrize("family", ["qwen2_moe"], indirect=True)
@pytest.mark.parametrize("impl", ["dense", "ragged", "gather", "tiled"])
def test_every_experts_impl_gives_the_logits(family, impl):
    """The conversion holds whichever way the experts are computed (shared expert, a dense
    layer, k = 2 of 5)."""
    f = family
    out, _ = _forward(f.config.replace(moe_impl=impl), f.params, *INPUTS)
    diff = _max_diff(np.asarray(out.logits), f.logits)
    assert diff <= TOL, f"{f.name} {impl}: max abs diff {diff}"


def test_save_is_read_by_transformers_as_the_same_model(family, tmp_path):
    """Our export, from the scanned layout where every layer is sparse: transformers reads the
    same tensors and gives our logits; it loads back as the same config and params."""
    f = family
    scan = f.name in SCANNABLE
    config, params = hf.load(f.path, scan_layers=scan)
    assert ("blocks" in params) == scan
    hf.save(config, params, tmp_path)
    saved = json.loads((tmp_path / hf.CONFIG_FILE).read_text())
    assert saved["model_type"] == f.case.family
    assert saved["architectures"] == [HF_CLASSES[f.case.family][1]]
    assert hf.config_from_hf(saved) == f.config

    reread = getattr(transformers, HF_CLASSES[f.case.family][1]).from_pretrained(
        tmp_path, attn_implementation="eager").eval()
    theirs, mine = f.model.state_dict(), reread.state_dict()
    assert theirs.keys() == mine.keys()
    for key in theirs:
        torch.testing.assert_close(mine[key], theirs[key], rtol=0, atol=0, msg=key)
    theirs_logits = torch_logits(reread, *INPUTS)
    np.testing.assert_allclose(theirs_logits, f.logits, rtol=0, atol=1e-6)
    np.testing.assert_allclose(theirs_logits, np.asarray(f.ours.logits), rtol=1e-5, atol=1e-5)
    config2, params2 = hf.load(tmp_path)
    assert config2 == f.config
    _assert_same_params(params2, f.params)


def _assert_same_params(a, b) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("family", ["qwen2_moe-step"], indirect=True)
def test_greedy_generation_equals_transformers(family):
    """Our generate (prefill + cached decode) against transformers' greedy generate on ragged,
    left-padded prompts, past the local layer's window, through the dense layer."""
    f = family
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, V, n).tolist() for n in (3, 7)]
    new = 6
    ours = generation.generate(f.config, f.params, prompts, max_new_tokens=new)
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = f.model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                               pad_token_id=0, eos_token_id=None)
    assert [out[i, width:].tolist() for i in range(len(prompts))] == ours.tokens, f.name


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"], indirect=True)
def test_stacked_experts_and_mesh_load_the_same_params(family, tmp_path):
    """transformers 5's stacked layout (``experts.gate_up_proj`` [E, 2F, D], ``down_proj``
    [E, D, F]) and the per-expert one give the same params, plain or onto a mesh (each shard
    read from the files), unrolled or (all layers sparse) scanned."""
    f = family
    f.model.save_pretrained(tmp_path, save_original_format=False)
    assert any(n.endswith("experts.gate_up_proj") for n in hf._weight_files(tmp_path))
    mesh = sharding.make_mesh(sharding.MeshConfig(1, 1, 1), jax.devices()[:1])
    for scan in (False, True) if f.name in SCANNABLE else (False,):
        plain = hf.load(f.path, scan_layers=scan)
        for source, on in ((tmp_path, None), (tmp_path, mesh), (f.path, mesh)):
            other = hf.load(source, scan_layers=scan, mesh=on)
            assert other[0] == plain[0]
            _assert_same_params(other[1], plain[1])


@pytest.mark.parametrize("family", ["mixtral"], indirect=True)
def test_mixtral_exports_as_qwen2_moe_without_shared_expert(family, tmp_path):
    """Qwen2-MoE holds Mixtral's function with a shared expert of width 0 (its empty tensors
    and unused gate written as zeros): transformers' Qwen2-MoE gives Mixtral's logits, and it
    loads back as the same config and params."""
    f = family
    hf.save(f.config, f.params, tmp_path, model_type="qwen2_moe")
    saved = json.loads((tmp_path / hf.CONFIG_FILE).read_text())
    assert saved["shared_expert_intermediate_size"] == 0 and saved["norm_topk_prob"] is True
    reread = transformers.Qwen2MoeForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager").eval()
    np.testing.assert_allclose(torch_logits(reread, *INPUTS), f.logits, rtol=1e-5, atol=1e-5)
    config2, params2 = hf.load(tmp_path)
    assert config2 == f.config
    _assert_same_params(params2, f.params)


@pytest.mark.parametrize("family", ["mixtral"], indirect=True)
def test_init_from_a_mixtral_checkpoint_gives_its_logits(family, tmp_path):
    """``train.init_from=DIR`` (``checkpoint.loading`` -> ``hf.load``) starts a fine-tune from the
    checkpoint's experts: the run's model is the checkpoint's, scanned, its params HF's logits."""
    from transformer_jax.train.config import build_configs

    f = family
    f.model.save_pretrained(tmp_path)
    write_chatml_tokenizer(tmp_path, ["a", "b", "c"], add_eos_token=False)
    config, train, _ = build_configs("finetune", [f"train.init_from={tmp_path}",
                                                  "model.scan_layers=true"])
    assert config.moe == f.case.moe and config.scan_layers
    mesh = sharding.make_mesh(sharding.MeshConfig(1, 1, 1), jax.devices()[:1])
    params = loading.load(train.init_from, mesh, scan_layers=config.scan_layers,
                          dtype=config.param_dtype, with_tokenizer=False).params
    assert params["blocks"]["moe"]["gate"].shape == (2, 3, D, 40)
    diff = _max_diff(np.asarray(_forward(config, params, *INPUTS)[0].logits), f.logits)
    assert diff <= TOL, diff


# ------------------------------------------------------------------------------------------------
# Config mapping alone


def _hf_config(family: str, **changes) -> dict:
    """A tiny ``config.json`` dict of ``family`` as transformers writes it, then ``changes``."""
    config = getattr(transformers, HF_CLASSES[family][0])(**SIZES, num_hidden_layers=2)
    return {**config.to_dict(), "architectures": [HF_CLASSES[family][1]], **changes}


@pytest.mark.parametrize("family_, changes, message", [
    ("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise"),
    ("qwen3_moe", dict(attention_bias=True), "attention_bias"),
    ("mixtral", dict(num_local_experts=3, num_experts_per_tok=4), "num_experts_per_tok"),
    ("qwen2_moe", dict(num_experts_per_tok=0), "num_experts_per_tok"),
    ("qwen2_moe", dict(decoder_sparse_step=0), "decoder_sparse_step"),
    ("qwen3_moe", dict(mlp_only_layers="0"), "mlp_only_layers"),
    ("qwen3_moe", dict(num_experts=4, num_local_experts=6), "num_local_experts"),
    ("qwen2_moe", dict(use_sliding_window=False,
                       layer_types=["sliding_attention", "full_attention"]), "use_sliding_window"),
    ("qwen3_moe", dict(use_sliding_window=True, sliding_window=None), "sliding_window"),
    ("qwen2_moe", dict(shared_expert_intermediate_size=-1), "shared_expert_intermediate_size"),
    ("qwen3_moe", dict(norm_topk_prob=None), "norm_topk_prob"),
    ("mixtral", dict(hidden_act="gelu_new"), "hidden_act"),
    ("mixtral", dict(rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}),
     "rope_scaling type 'yarn'"),
    ("qwen2_moe", dict(architectures=["Qwen3MoeForCausalLM"]), "architectures"),
])
def test_unrepresentable_configs_are_refused_naming_the_field(family_, changes, message):
    with pytest.raises(ValueError, match=message):
        hf.config_from_hf(_hf_config(family_, **changes))


def test_configs_read_as_transformers_builds_the_layers():
    """The sparse layers, widths and defaults, checked against transformers' own modules."""
    small = dict(num_experts=3, num_experts_per_tok=1, moe_intermediate_size=8)
    for family_, changes in [
        ("qwen2_moe", dict(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[0, 3, 9])),
        ("qwen3_moe", dict(num_hidden_layers=3, mlp_only_layers=[2, -1])),
        ("qwen3_moe", dict(num_hidden_layers=2, num_experts=0)),
        ("qwen2_moe", dict(num_hidden_layers=2, mlp_only_layers=[0, 1])),
    ]:
        hf_config = getattr(transformers, HF_CLASSES[family_][0])(**{**SIZES, **small, **changes})
        config = hf.config_from_hf({**hf_config.to_dict(),
                                    "architectures": [HF_CLASSES[family_][1]]})
        built = getattr(transformers, HF_CLASSES[family_][1])(hf_config)
        sparse = tuple(i for i, layer in enumerate(built.model.layers)
                       if hasattr(layer.mlp, "experts"))
        assert config.sparse_layers == sparse, (family_, changes)
        assert (config.moe is None) == (not sparse)
        assert hf.config_from_hf(json.loads(json.dumps(hf.config_to_hf(config)))) == config
    mixtral = hf.config_from_hf({k: v for k, v in _hf_config("mixtral").items()
                                 if k not in ("rope_parameters", "rms_norm_eps")})
    assert (mixtral.rope_base, mixtral.norm_eps) == (1e6, 1e-5)  # MixtralConfig's defaults
    qwen3 = hf.config_from_hf({**_hf_config("qwen3_moe"), "num_local_experts": 10})
    assert qwen3.moe.n_experts == 10  # the name transformers writes; num_experts is read too


def test_config_to_hf_picks_the_family_and_refuses_what_it_cannot_write():
    moe = MoE(n_experts=3, top_k=2, d_ff=16)
    base = ModelConfig(vocab_size=V, d_model=D, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=H,
                       d_ff=16, moe=moe)
    shared = base.replace(moe=dataclasses.replace(moe, shared_d_ff=8, shared_gate=True),
                          qkv_bias=True)
    qwen3 = base.replace(qk_norm="head", moe=dataclasses.replace(moe, dense_layers=(0,)))
    for config, model_type in [(base, "mixtral"), (shared, "qwen2_moe"), (qwen3, "qwen3_moe"),
                               (base.replace(moe=dataclasses.replace(moe, renormalize=False)),
                                "qwen2_moe")]:
        written = hf.config_to_hf(config)
        assert written["model_type"] == model_type
        assert hf.config_from_hf(json.loads(json.dumps(written))) == config, model_type

    dense = dataclasses.replace(moe, sparse_step=2)
    for config, model_type, message in [
        (shared.replace(qkv_bias=False), "mixtral", "shared_d_ff"),
        (base.replace(moe=dataclasses.replace(moe, renormalize=False)), "mixtral", "renormalize"),
        (base.replace(moe=dense), "mixtral", "moe.sparse_step=2"),
        (base.replace(moe=dataclasses.replace(moe, shared_d_ff=8)), "qwen2_moe", "shared_gate"),
        (shared.replace(qk_norm="head", qkv_bias=False), None, "shared_d_ff"),
        (base.replace(sliding_window=4, layer_pattern=("local", "global")), "mixtral",
         "layer_pattern"),
        (base.replace(qkv_bias=True), "mixtral", "qkv_bias"),
        (base, "qwen3", "have no moe"),
        (base, "llama", "have no moe"),
        (base.replace(moe=None, d_ff=16), "mixtral", "moe=None"),
        (base.replace(norm_position="sandwich"), None, "norm_position"),
    ]:
        with pytest.raises(ValueError, match=message):
            hf.config_to_hf(config, model_type)
