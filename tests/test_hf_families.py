"""HuggingFace conversion of Qwen3, Gemma 2, Gemma 3 (text), Phi-3 and OLMo 2, and YaRN.

Each family's tiny random transformers model (float32, eager attention, GQA, an odd vocabulary,
head_dim != hidden / heads, a window shorter than the batch) is built once per module and saved
with ``save_pretrained``: ``hf.load`` must give its logits within 1e-4, and ``hf.save`` of those
params must be read by ``from_pretrained`` as the same model (the same tensors, logits equal
ours within 1e-5). Greedy generation is compared with transformers' ``generate`` on left-padded
ragged prompts. Weights are drawn at unit scale so that soft-caps, windows and RoPE variants
change the logits visibly (each case also checks that dropping its feature does).

Needs the ``hf`` extra (torch, transformers, safetensors); skipped without it.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest
from helpers import HF_CLASSES, our_logits, ragged_inputs, random_hf_model, torch_logits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from transformer_jax import hf  # noqa: E402  (needs the optional extra checked above)
from transformer_jax.decode import generation  # noqa: E402
from transformer_jax.hf import convert, families  # noqa: E402
from transformer_jax.model.config import Architecture, ModelConfig, RopeScaling  # noqa: E402
from transformer_jax.model.fields import MLA, MoE  # noqa: E402

pytestmark = pytest.mark.usefixtures("fast_generate_compiles")

B, T, V, D, H = 2, 12, 97, 64, 24
WINDOW = 4  # shorter than T and than the generated sequences
TOL = 1e-4
SIZES = dict(vocab_size=V, hidden_size=D, intermediate_size=96, num_attention_heads=4,
             num_key_value_heads=2, head_dim=H, max_position_embeddings=1024)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
        "rope_theta": 10000.0}


@dataclasses.dataclass(frozen=True)
class Case:
    family: str  # the HF model type
    hf_kwargs: dict
    expect: dict  # ModelConfig fields the loaded config must have
    ablate: dict  # dropping this must change the logits (the feature is used)



CASES = {
    # Layers [global, local, local]: the pattern is the whole list.
    "qwen3": Case("qwen3", dict(num_hidden_layers=3, use_sliding_window=True,
                                sliding_window=WINDOW, max_window_layers=1),
                  dict(qk_norm="head", head_dim=H, sliding_window=WINDOW,
                       layer_pattern=("global", "local", "local"), tie_embeddings=False),
                  ablate=dict(layer_pattern=(), sliding_window=None)),
    "qwen3-yarn": Case("qwen3", dict(num_hidden_layers=2, rope_parameters=YARN,
                                     tie_word_embeddings=True),
                       dict(rope_scaling=RopeScaling("yarn", 4.0, original_max_len=128),
                            tie_embeddings=True),
                       ablate=dict(rope_scaling=None)),
    # Default layer_types: [local, global, local].
    "gemma2": Case("gemma2", dict(num_hidden_layers=3, sliding_window=WINDOW,
                                  query_pre_attn_scalar=20, attn_logit_softcapping=3.0,
                                  final_logit_softcapping=2.0),
                   dict(norm_position="sandwich", norm_offset=1.0, scale_embeddings=True,
                        ffn="geglu_tanh", attn_softcap=3.0, final_softcap=2.0,
                        attn_scale=20 ** -0.5, layer_pattern=("local", "global"),
                        sliding_window=WINDOW, tie_embeddings=True),
                   ablate=dict(attn_softcap=None)),
    # Every second layer global; local layers rotate with their own base, global ones scaled.
    "gemma3": Case("gemma3_text", dict(
        num_hidden_layers=4, sliding_window=WINDOW, sliding_window_pattern=2,
        query_pre_attn_scalar=H, rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}),
        dict(qk_norm="head", layer_pattern=("local", "global"), rope_base=1e6,
             rope_scaling=RopeScaling("linear", 2.0), local_rope_base=100.0,
             attn_softcap=None, final_softcap=None),
        ablate=dict(local_rope_base=None)),
    "phi3": Case("phi3", dict(num_hidden_layers=2, sliding_window=WINDOW, pad_token_id=0),
                 dict(sliding_window=WINDOW, layer_pattern=(), head_dim=H, qk_norm=None),
                 ablate=dict(sliding_window=None)),
    "olmo2": Case("olmo2", dict(num_hidden_layers=2, rope_parameters={
        "rope_type": "default", "rope_theta": 5e5}),
        dict(norm_position="post_branch", qk_norm="full", rope_base=5e5),
        ablate=dict(qk_norm=None)),
}


def _hf_model(family: str, seed: int = 0, **config):
    """A tiny random transformers model (``helpers.random_hf_model``) of this module's sizes."""
    return random_hf_model(family, seed, **{**SIZES, **config})


#: [B, T] tokens and positions; the second row starts at position 300 (past YaRN's original
#: length and the window).
INPUTS = ragged_inputs(B, T, V)


def _max_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)))


@pytest.fixture(scope="module", params=list(CASES))
def family(request, tmp_path_factory):
    """(case name, case, HF model, its checkpoint directory, its logits), once per case."""
    case = CASES[request.param]
    model = _hf_model(case.family, **case.hf_kwargs)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return request.param, case, model, path, torch_logits(model, *INPUTS)


def test_logits_match_transformers(family):
    name, case, _, path, expected = family
    config, params = hf.load(path)
    for field, value in case.expect.items():
        assert getattr(config, field) == value, field
    assert config.n_kv_heads == 2 and config.head_dim == H and config.vocab_size == V
    diff = _max_diff(our_logits(config, params, *INPUTS), expected)
    assert diff <= TOL, f"{name}: max abs diff {diff}"
    ablated = _max_diff(our_logits(config.replace(**case.ablate), params, *INPUTS), expected)
    assert ablated > 100 * TOL, f"{name}: {case.ablate} does not matter ({ablated})"


def test_save_is_read_by_transformers_as_the_same_model(family, tmp_path):
    name, case, model, path, expected = family
    scan = name in ("gemma3", "qwen3-yarn")  # layers that differ, scanned
    config, params = hf.load(path, scan_layers=scan)
    assert ("blocks" in params) == scan
    ours = our_logits(config, params, *INPUTS)
    model_type = "phi3" if case.family == "phi3" else None
    hf.save(config, params, tmp_path, model_type=model_type)
    saved = json.loads((tmp_path / hf.CONFIG_FILE).read_text())
    assert saved["model_type"] == case.family
    assert saved["architectures"] == [HF_CLASSES[case.family][1]]
    assert hf.config_from_hf(saved) == config.replace(scan_layers=False)

    reread = getattr(transformers, HF_CLASSES[case.family][1]).from_pretrained(
        tmp_path, attn_implementation="eager").eval()
    theirs, mine = model.state_dict(), reread.state_dict()
    assert theirs.keys() == mine.keys()
    for key in theirs:
        torch.testing.assert_close(mine[key], theirs[key], rtol=0, atol=0, msg=key)
    theirs_logits = torch_logits(reread, *INPUTS)
    np.testing.assert_allclose(theirs_logits, expected, rtol=0, atol=1e-6)
    # Two frameworks' float32 rounding: 1e-5 absolute plus 1e-5 relative (logits reach ~4).
    np.testing.assert_allclose(theirs_logits, ours, rtol=1e-5, atol=1e-5)
    # Read back by us: the same config and the same params bit for bit (so the same logits,
    # without a second forward: eagerly, a scanned one compiles its layers' program again).
    config2, params2 = hf.load(tmp_path, scan_layers=scan)
    assert config2 == config
    assert jax.tree.structure(params2) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(params2), jax.tree.leaves(params), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("family, scan", [("qwen3", False), ("gemma2", False), ("gemma3", True)],
                         indirect=["family"])
def test_greedy_generation_equals_transformers(family, scan):
    """Our generate (prefill + cached decode, Gemma 3's differing layers scanned) against
    transformers' greedy generate on ragged, left-padded prompts, past the window."""
    name, _, model, path, _ = family
    config, params = hf.load(path, scan_layers=scan)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, V, n).tolist() for n in (3, 7)]
    new = 6
    ours = generation.generate(config, params, prompts, max_new_tokens=new)
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
    assert [out[i, width:].tolist() for i in range(len(prompts))] == ours.tokens, name


@pytest.mark.parametrize("family", ["phi3"], indirect=True)
def test_fused_checkpoint_loads_onto_a_mesh_as_without(family):
    """The sharded load reads each param's rows of the fused tensors from the file."""
    from transformer_jax.parallel import sharding

    mesh = sharding.make_mesh(sharding.MeshConfig(1, 1, 1), jax.devices()[:1])
    for scan in (False, True):
        config, plain = hf.load(family[3], scan_layers=scan)
        _, sharded = hf.load(family[3], scan_layers=scan, mesh=mesh)
        assert jax.tree.structure(sharded) == jax.tree.structure(plain)
        for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(plain), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------------------------------------------------------------
# Config mapping alone


def _hf_config(family: str, **changes) -> dict:
    """A tiny ``config.json`` dict of ``family`` as transformers writes it, then ``changes``."""
    config = getattr(transformers, HF_CLASSES[family][0])(**SIZES, num_hidden_layers=2)
    return {**config.to_dict(), "architectures": [HF_CLASSES[family][1]], **changes}


@pytest.mark.parametrize("family_, changes, message", [
    ("phi3", dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                                   "short_factor": [1.0] * 8, "long_factor": [1.0] * 8,
                                   "original_max_position_embeddings": 512}),
     "rope_scaling.*longrope"),
    ("phi3", dict(partial_rotary_factor=0.5,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
     "partial_rotary_factor"),
    ("gemma3_text", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    ("gemma2", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    ("qwen3", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
     "rope_scaling type 'dynamic'"),
    ("gemma2", dict(layer_types=["sliding_attention", "chunked_attention"]),
     "layer_types.*chunked_attention"),
    ("gemma2", dict(layer_types=["sliding_attention"]), "layer_types"),
    ("gemma3_text", dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    ("gemma3_text", dict(rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}),
     "sliding_attention"),
    ("gemma2", dict(hidden_activation="gelu_new"), "hidden_activation"),
    ("qwen3", dict(attention_bias=True), "attention_bias"),
    ("olmo2", dict(quantization_config={"quant_method": "gptq"}), "quantization_config"),
    ("qwen3", dict(head_dim=None), "head_dim"),
    ("gemma2", dict(query_pre_attn_scalar=None), "query_pre_attn_scalar"),
])
def test_unrepresentable_configs_are_refused_naming_the_field(family_, changes, message):
    with pytest.raises(ValueError, match=message):
        hf.config_from_hf(_hf_config(family_, **changes))


def test_yarn_is_read_as_transformers_computes_it():
    """The YaRN fields, their transformers defaults, and the frequencies and attention factor
    transformers' own rope function computes from them."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from transformer_jax.model.ops.positions import rope_attention_factor, rope_frequencies

    for rope, want in [
        (YARN, RopeScaling("yarn", 4.0, original_max_len=128)),
        ({**YARN, "beta_fast": 16, "beta_slow": 2, "truncate": False, "mscale": 0.8,
          "mscale_all_dim": 0.5},
         RopeScaling("yarn", 4.0, original_max_len=128, beta_fast=16.0, beta_slow=2.0,
                     mscale=0.8, mscale_all_dim=0.5, truncate=False)),
        ({**YARN, "attention_factor": 1.5},
         RopeScaling("yarn", 4.0, original_max_len=128, attention_factor=1.5)),
    ]:
        for family_ in ("qwen3", "qwen2"):
            raw = _hf_config("qwen3", rope_parameters=rope)
            if family_ == "qwen2":
                raw = {**raw, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}
            config = hf.config_from_hf(raw)
            assert config.rope_scaling == want, (family_, rope)
            assert hf.config_from_hf(json.loads(json.dumps(hf.config_to_hf(config)))) == config
        theirs, factor = ROPE_INIT_FUNCTIONS["yarn"](transformers.Qwen3Config(
            **SIZES, num_hidden_layers=2, rope_parameters=dict(rope)))
        np.testing.assert_allclose(rope_frequencies(H, 1e4, want), theirs.numpy(), rtol=1e-6)
        assert rope_attention_factor(want) == pytest.approx(factor, rel=1e-12)


def test_config_to_hf_picks_the_family_and_refuses_what_it_cannot_write():
    base = ModelConfig(vocab_size=V, d_model=D, n_layers=4, n_heads=4, n_kv_heads=2,
                       head_dim=H, d_ff=96)
    qwen3 = base.replace(qk_norm="head")
    gemma2 = base.replace(norm_position="sandwich", norm_offset=1.0, scale_embeddings=True,
                          ffn="geglu_tanh", attn_softcap=50.0, final_softcap=30.0,
                          attn_scale=0.0625, sliding_window=8, layer_pattern=("local", "global"))
    gemma3 = gemma2.replace(qk_norm="head", attn_softcap=None, final_softcap=None,
                            rope_base=1e6, local_rope_base=1e4)
    olmo2 = base.replace(norm_position="post_branch", qk_norm="full")
    for config, model_type in [(qwen3, "qwen3"), (gemma2, "gemma2"), (gemma3, "gemma3_text"),
                               (olmo2, "olmo2"), (base, "llama")]:
        written = hf.config_to_hf(config)
        assert written["model_type"] == model_type
        assert hf.config_from_hf(json.loads(json.dumps(written))) == config, model_type
    assert hf.config_to_hf(base, "phi3")["model_type"] == "phi3"
    assert hf.config_from_hf(hf.config_to_hf(base, "phi3")) == base

    for config, model_type, message in [
        (gemma3.replace(attn_softcap=5.0), None, "attn_softcap"),
        (gemma2.replace(attn_scale=0.07), None, "attn_scale"),
        (gemma2.replace(local_rope_base=1e4), None, "local_rope_base"),
        (gemma2.replace(d_model=62), None, "divisible"),
        (olmo2.replace(norm_offset=1.0), None, "norm_offset"),
        (base.replace(norm_position="sandwich", qk_norm="full"), None, "qk_norm"),
        (base.replace(scale_embeddings=True), None, "scale_embeddings"),
        (base.replace(sliding_window=8, layer_pattern=("local", "global")), None,
         "layer_pattern"),
        (base.replace(sliding_window=8, layer_pattern=("local", "global")), "phi3",
         "layer_pattern"),
        (base.replace(rope_scaling=RopeScaling("yarn", 4.0)), None, "yarn"),
        (base.replace(rope_scaling=RopeScaling("linear", 2.0)), "phi3", "rope_scaling"),
        (base.replace(qkv_bias=True), "phi3", "qkv_bias"),
        (base, "gpt2", "model_type"),
        (base, "qwen2", "llama"),
    ]:
        with pytest.raises(ValueError, match=message):
            hf.config_to_hf(config, model_type)


def _one_per_family() -> dict[str, ModelConfig]:
    """A config of every family (``convert.FAMILIES``), each as import gives it."""
    base = ModelConfig(vocab_size=V, d_model=D, n_layers=4, n_heads=4, n_kv_heads=2,
                       head_dim=H, d_ff=96)
    gemma2 = base.replace(norm_position="sandwich", norm_offset=1.0, scale_embeddings=True,
                          ffn="geglu_tanh", attn_softcap=50.0, final_softcap=30.0,
                          attn_scale=0.0625, sliding_window=8, layer_pattern=("local", "global"))
    moe = MoE(n_experts=3, top_k=2, d_ff=16)
    return {
        "llama": base, "mistral": base.replace(sliding_window=8),
        "qwen2": base.replace(qkv_bias=True,
                              rope_scaling=RopeScaling("yarn", 4.0, original_max_len=128)),
        "qwen3": base.replace(qk_norm="head", sliding_window=8,
                              layer_pattern=("global", "local")),
        "gemma2": gemma2,
        "gemma3_text": gemma2.replace(qk_norm="head", attn_softcap=None, rope_base=1e6,
                                      local_rope_base=1e4),
        "olmo2": base.replace(norm_position="post_branch", qk_norm="full"),
        "phi3": base.replace(sliding_window=8),
        "mixtral": base.replace(d_ff=16, moe=moe),
        "qwen3_moe": base.replace(qk_norm="head", moe=dataclasses.replace(
            moe, renormalize=False, sparse_step=2, dense_layers=(1,))),
        "qwen2_moe": base.replace(qkv_bias=True, sliding_window=8,
                                  layer_pattern=("local", "global"),
                                  moe=dataclasses.replace(moe, shared_d_ff=8, shared_gate=True)),
        "gpt_oss": base.replace(d_ff=16, qkv_bias=True, o_bias=True, attn_sinks=True,
                                sliding_window=8, layer_pattern=("local", "global"),
                                swiglu_limit=7.0, swiglu_alpha=1.702, swiglu_up_offset=1.0,
                                moe=dataclasses.replace(moe, router_bias=True,
                                                        expert_bias=True)),
        "llama4_text": base.replace(
            rope_pairing="adjacent", qk_norm="weightless", attention_chunk=8,
            layer_pattern=("chunked", "global"), nope_layers=(1, 3), nope_temperature_floor=16,
            nope_temperature_scale=0.2,
            moe=MoE(n_experts=3, top_k=1, d_ff=16, renormalize=False, shared_d_ff=16,
                    score="sigmoid", scale_input=True, sparse_step=2)),
        "deepseek_v3": base.replace(n_kv_heads=4, head_dim=4, rope_pairing="adjacent",
                                    mla=MLA(kv_lora_rank=16, qk_nope_head_dim=8,
                                            qk_rope_head_dim=4, v_head_dim=6, q_lora_rank=12)),
    }


def test_every_family_round_trips_and_matches_its_own_declaration():
    configs = _one_per_family()
    assert list(configs) == list(convert.FAMILIES)  # export tries them in this order
    for model_type, config in configs.items():
        assert convert.FAMILIES[model_type].mismatches(config) == [], model_type
        written = json.loads(json.dumps(hf.config_to_hf(config, model_type)))
        assert written["model_type"] == model_type
        assert hf.config_from_hf(written) == config, model_type
        if model_type != "phi3":  # Phi-3 is the Llama block; written only when asked for
            assert hf.config_to_hf(config)["model_type"] == model_type
    # A window on every layer (layer_types all sliding) reads back uniform: layer_pattern ().
    for model_type in ("qwen3", "gemma2", "gemma3_text"):
        uniform = configs[model_type].replace(sliding_window=4, layer_pattern=())
        assert hf.config_from_hf(hf.config_to_hf(uniform, model_type)) == uniform, model_type


def test_a_field_no_family_declares_is_refused_naming_it(monkeypatch):
    """A new ``Architecture`` (or ``MoE``) field is refused by every family until one declares
    it: the fields a family must leave at their defaults are the dataclass's, not a list."""

    @dataclasses.dataclass(frozen=True)
    class Newer(Architecture):
        new_trick: float = 0.0

    @dataclasses.dataclass(frozen=True)
    class NewerConfig(ModelConfig):
        new_trick: float = 0.0

    @dataclasses.dataclass(frozen=True)
    class NewerMoE(MoE):
        router_jitter: bool = False

    monkeypatch.setattr(families, "Architecture", Newer)
    monkeypatch.setattr(convert, "Architecture", Newer)
    for model_type, config in _one_per_family().items():
        newer = NewerConfig(**config.to_dict())
        assert hf.config_from_hf(hf.config_to_hf(newer, model_type)) == config  # at its default
        tricked = dataclasses.replace(newer, new_trick=0.5)
        with pytest.raises(ValueError, match=rf"HF {model_type} checkpoints .*have no "
                                             r"new_trick: it must be 0\.0, got new_trick=0\.5"):
            hf.config_to_hf(tricked, model_type)
        if model_type != "phi3":
            with pytest.raises(ValueError, match=r"no HF model type has .*new_trick=0\.5"):
                hf.config_to_hf(tricked)
        if config.moe is not None:
            routed = newer.replace(moe=NewerMoE(**{**config.moe.__dict__,
                                                   "router_jitter": True}))
            with pytest.raises(ValueError, match=r"have no moe\.router_jitter: it must be "
                                                 r"False, got moe\.router_jitter=True"):
                hf.config_to_hf(routed, model_type)


def test_fused_blocks_read_from_the_hf_layout_equal_the_split_tensors():
    config = ModelConfig(vocab_size=V, d_model=8, n_layers=1, n_heads=4, n_kv_heads=2,
                         head_dim=4, d_ff=6)
    specs = [s for s in convert._tensors(config, "phi3") if s.rows is not None]
    assert {s.hf_name for s in specs} == {"model.layers.0.self_attn.qkv_proj.weight",
                                           "model.layers.0.mlp.gate_up_proj.weight"}
    rng = np.random.default_rng(0)
    fused = {s.hf_name: rng.standard_normal(s.stored_shape).astype(np.float32) for s in specs}
    for s in specs:
        ours = s.to_ours(fused[s.hf_name][slice(*s.row_range)])
        for _ in range(10):
            index = tuple(slice(a, int(rng.integers(a + 1, n + 1)))
                          for a, n in ((int(rng.integers(0, n)), n) for n in s.shape))
            np.testing.assert_array_equal(s.read(fused[s.hf_name], index), ours[index])
    q, k, v = specs[:3]
    assert (q.row_range, k.row_range, v.row_range) == ((0, 16), (16, 24), (24, 32))
