"""ModelConfig validation, presets and parameter counts."""

import dataclasses

import pytest

from transformer_jax import ModelConfig, param_count
from transformer_jax.model.config import RopeScaling, load_toml, parse_override, preset_names

# Published parameter counts of the released checkpoints.
PUBLISHED = {
    "llama2_7b": 6_738_415_616,
    "llama2_70b": 68_976_648_192,  # meta-llama/Llama-2-70b-hf
    "llama3_8b": 8_030_261_248,
    "mistral_7b": 7_241_732_096,
    "qwen2_0_5b": 494_032_768,
    "tinyllama_1_1b": 1_100_048_384,
    "smollm_135m": 134_515_008,
    "qwen3_0_6b": 596_049_920,  # Qwen/Qwen3-0.6B ("0.6B, 0.44B non-embedding")
    "gemma2_2b": 2_614_341_888,  # google/gemma-2-2b
    "gemma3_1b": 999_885_952,  # google/gemma-3-1b-pt
    "phi3_mini": 3_821_079_552,  # microsoft/Phi-3-mini-4k-instruct
    "olmo2_1b": 1_484_916_736,  # allenai/OLMo-2-0425-1B
    "mixtral_8x7b": 46_702_792_704,  # mistralai/Mixtral-8x7B-v0.1
    "qwen3_30b_a3b": 30_532_122_624,  # Qwen/Qwen3-30B-A3B
    "qwen2_moe_a2_7b": 14_315_784_192,  # Qwen/Qwen1.5-MoE-A2.7B
    # deepseek-ai/DeepSeek-V3 ("671B"; without the multi-token-prediction layer) and
    # moonshotai/Kimi-K2-Instruct ("1T"): transformers' parameters plus the 58 and 60 sparse
    # layers' correction biases (256 and 384 each), buffers there, parameters here.
    "deepseek_v3": 671_026_404_352 + 58 * 256,
    "kimi_k2": 1_026_408_209_408 + 60 * 384,
}

# The mixture-of-experts presets' published configs (their config.json, the fields that set
# parameter shapes), counted by HF's own classes on the meta device.
HF_MOE = {
    "mixtral_8x7b": ("MixtralForCausalLM", "MixtralConfig", dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
        num_experts_per_tok=2, tie_word_embeddings=False)),
    "qwen3_30b_a3b": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, tie_word_embeddings=False)),
    "qwen2_moe_a2_7b": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16,
        num_key_value_heads=16, num_experts=60, num_experts_per_tok=4,
        tie_word_embeddings=False)),
    "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
        n_shared_experts=1, n_routed_experts=256, num_experts_per_tok=8, n_group=8,
        topk_group=4, first_k_dense_replace=3, kv_lora_rank=512, q_lora_rank=1536,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, tie_word_embeddings=False)),
    "kimi_k2": ("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(
        vocab_size=163840, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=64, num_key_value_heads=64,
        n_shared_experts=1, n_routed_experts=384, num_experts_per_tok=8, n_group=1,
        topk_group=1, first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=1536,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, tie_word_embeddings=False)),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_parameter_count_matches_published(name):
    assert param_count(ModelConfig.preset(name)) == PUBLISHED[name]


@pytest.mark.parametrize("name", sorted(HF_MOE))
def test_moe_preset_parameter_count_equals_hf_on_the_meta_device(name):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model_class, config_class, fields = HF_MOE[name]
    with torch.device("meta"):
        hf = getattr(transformers, model_class)(getattr(transformers, config_class)(**fields))
    # DeepSeek-V3's correction biases are buffers in transformers, parameters here.
    buffers = sum(b.numel() for n, b in hf.named_buffers()
                  if n.endswith("e_score_correction_bias"))
    assert param_count(ModelConfig.preset(name)) == sum(
        p.numel() for p in hf.parameters()) + buffers


def formula_count(c: ModelConfig) -> int:
    """Parameter count by hand: embedding V*D, per layer attention D*(N+2K)*H + N*H*D (plus
    biases), FFN 3*D*F (gated) or 2*D*F, two norms; final norm; untied head V*D."""
    d, h, n, k, f, v = c.d_model, c.head_dim, c.n_heads, c.n_kv_heads, c.d_ff, c.vocab_size
    norm = d * (2 if c.norm == "layer" else 1)
    attn = d * (n + 2 * k) * h + n * h * d + ((n + 2 * k) * h if c.qkv_bias else 0)
    ffn = (3 if c.ffn in ("swiglu", "geglu") else 2) * d * f
    total = v * d + c.n_layers * (attn + ffn + 2 * norm) + norm
    return total + (0 if c.tie_embeddings else v * d)


@pytest.mark.parametrize("changes", [
    {}, {"n_kv_heads": 2}, {"n_kv_heads": 1}, {"tie_embeddings": True}, {"qkv_bias": True},
    {"ffn": "gelu", "norm": "layer"}, {"ffn": "geglu", "head_dim": 24}, {"scan_layers": True},
])
def test_parameter_count_matches_formula(changes):
    c = ModelConfig(vocab_size=100, d_model=64, n_layers=3, n_heads=4, d_ff=96, **changes)
    assert param_count(c) == formula_count(c)


def test_tying_removes_exactly_the_head():
    c = ModelConfig(vocab_size=100, d_model=64)
    assert param_count(c) - param_count(c.replace(tie_embeddings=True)) == 100 * 64


@pytest.mark.parametrize("changes, field", [
    ({"d_model": 100, "n_heads": 3}, "d_model"),
    ({"n_heads": 4, "n_kv_heads": 3}, "n_kv_heads"),
    ({"n_layers": 0}, "n_layers"),
    ({"vocab_size": -5}, "vocab_size"),
    ({"d_ff": 2.5}, "d_ff"),
    ({"norm": "batch"}, "norm"),
    ({"ffn": "swish"}, "ffn"),
    ({"position": "alibi"}, "position"),
    ({"rope_pairing": "odd"}, "rope_pairing"),
    ({"remat": "some"}, "remat"),
    ({"dtype": "int8"}, "dtype"),
    ({"head_dim": 7}, "head_dim"),
    ({"norm_eps": 0.0}, "norm_eps"),
    ({"sliding_window": 0}, "sliding_window"),
    ({"rope_scaling": {"kind": "ntk", "factor": 2.0}}, "rope_scaling.kind"),
    ({"rope_scaling": {"kind": "linear", "factor": 0.0}}, "rope_scaling.factor"),
    ({"mtp_depth": -1}, "mtp_depth must be an int >= 0"),
    ({"norm_offset": float("inf")}, "norm_offset must be a finite number"),
    ({"swiglu_up_offset": float("nan")}, "swiglu_up_offset must be a finite number"),
    ({"ffn": "gelu", "swiglu_alpha": 2.0}, "need ffn='swiglu'"),
])
def test_bad_config_names_the_field(changes, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        ModelConfig(**changes)


def test_config_is_frozen_and_defaults_derive():
    c = ModelConfig(d_model=96, n_heads=6)
    assert c.n_kv_heads == 6 and c.head_dim == 16 and c.queries_per_kv_head == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.d_model = 3
    assert ModelConfig.from_dict(c.to_dict()) == c
    rs = ModelConfig(rope_scaling={"kind": "llama3", "factor": 8.0})
    assert rs.rope_scaling == RopeScaling("llama3", 8.0)


def test_unknown_keys_and_presets_name_close_matches():
    with pytest.raises(ValueError, match="d_model"):
        ModelConfig.from_dict({"d_modle": 3})
    with pytest.raises(FileNotFoundError, match="llama2_7b"):
        load_toml("llama2_7")
    assert {"tiny", *PUBLISHED} <= set(preset_names())


def test_override_parsing_is_typed():
    assert parse_override(ModelConfig, "n_layers", "6") == 6
    assert parse_override(ModelConfig, "tie_embeddings", "true") is True
    assert parse_override(ModelConfig, "norm_eps", "1e-6") == 1e-6
    assert parse_override(ModelConfig, "sliding_window", "none") is None
    with pytest.raises(ValueError, match="int"):
        parse_override(ModelConfig, "n_layers", "six")
    with pytest.raises(ValueError, match="n_layers"):
        parse_override(ModelConfig, "n_layer", "6")
