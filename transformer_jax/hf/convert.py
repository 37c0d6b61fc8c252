"""HuggingFace names and layouts <-> ``ModelConfig`` and our param tree: Llama, Mistral, Qwen2
(here) and Qwen3, Gemma 2, Gemma 3 text, Phi-3, OLMo 2 (their configs in ``hf.families``), Mixtral,
Qwen2-MoE, Qwen3-MoE (their configs and experts' tensors in ``hf.moe``).

Pure functions, no file I/O (``transformer_jax.hf`` reads and writes the files):
``config_from_hf``/``config_to_hf`` map a ``config.json`` dict to a ``ModelConfig`` and back;
``_tensors(config)`` lists every HF tensor of a config with the param path it becomes and the
reshape/transpose between the two layouts (``_Tensor``, in ``hf.tensors``).

Anything that cannot be represented exactly is refused with a ValueError naming the offending
setting (never converted approximately): other model types, MLP biases, RoPE scaling other than
linear/llama3/yarn, partial rotary embeddings, mixed sliding/full attention layers in the
Llama / Mistral / Qwen2 layouts (Qwen3 and Gemma map them to ``layer_pattern``), quantized
weights, approximate GELUs there.

HF stores torch ``Linear`` weights as [out, in]; our tree stores matrices [in, out] with heads
split out: ``q_proj.weight`` [N*H, D] -> ``q_proj`` [D, N, H], ``o_proj.weight`` [D, N*H] ->
``o_proj`` [N, H, D], ``gate/up_proj.weight`` [F, D] -> [D, F], ``down_proj.weight`` [D, F] ->
[F, D], ``lm_head.weight`` [V, D] -> [D, V]. HF Llama rotates the half-split pairs
``(x_i, x_{i+H/2})``, which is ``rope_pairing="half"``, so no permutation is needed. Phi-3 fuses
``qkv_proj.weight`` [(N+2K)*H, D] and ``gate_up_proj.weight`` [2F, D] (gate rows first): each
of our params is a row range of the fused tensor (``_Tensor.rows``).
"""

from __future__ import annotations

import re
from typing import Any

from transformer_jax.hf import families, moe
from transformer_jax.hf.families import rope_from_dict, rope_keys
from transformer_jax.hf.tensors import (  # noqa: F401  (_flatten, _set_path: re-exported)
    _flatten,
    _fused,
    _heads_in,
    _heads_out,
    _linear,
    _reshaped,
    _same,
    _set_path,
    _Tensor,
)
from transformer_jax.model.config import ModelConfig, RopeScaling

#: The Llama layouts mapped here; ``ARCHITECTURES`` adds ``families.ARCHITECTURES``.
LLAMA_LAYOUTS = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
ARCHITECTURES = {**LLAMA_LAYOUTS, **families.ARCHITECTURES, **moe.ARCHITECTURES}
#: The fields of Architecture beyond the Llama layouts', and their values there.
_LLAMA_DEFAULTS = {"qk_norm": None, "norm_offset": 0.0, "scale_embeddings": False,
                   "attn_softcap": None, "final_softcap": None, "attn_scale": None,
                   "local_rope_base": None}
# HF activation name -> our gated FFN. Only exact matches: "gelu" is the erf GELU; the tanh
# approximations ("gelu_new", "gelu_pytorch_tanh", ...) would not give the same logits.
_ACTIVATIONS = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu"}
_FFN_TO_ACTIVATION = {"swiglu": "silu", "geglu": "gelu"}
# Buffers some older checkpoints carry that are recomputed from the config.
_IGNORED_TENSOR = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")


# ------------------------------------------------------------------------------------------------
# Config mapping


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Maps a HF ``config.json`` dict (any model type of ``ARCHITECTURES``) to a ``ModelConfig``.

    The returned config has float32 ``param_dtype``/``dtype``; ``load`` sets them from the
    weights. Llama's ``attention_bias`` maps to ``qkv_bias`` (``load`` then requires the
    ``o_proj`` biases to be zero).

    Args:
      hf: the parsed ``config.json``.

    Returns:
      The equivalent ``ModelConfig``.

    Raises:
      ValueError: naming the setting that has no exact equivalent.
    """
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: "
                         f"{sorted(ARCHITECTURES)}")
    architectures = hf.get("architectures")
    if architectures is not None and list(architectures) != [ARCHITECTURES[model_type]]:
        raise ValueError(f"unsupported architectures {architectures!r} for model_type "
                         f"{model_type!r}; expected [{ARCHITECTURES[model_type]!r}]")
    if hf.get("quantization_config") is not None:
        raise ValueError("quantized checkpoints (quantization_config) are not supported")
    if model_type in families.ARCHITECTURES:
        return families.config_from_hf(hf, model_type)
    if model_type in moe.ARCHITECTURES:
        return moe.config_from_hf(hf, model_type)

    def required(key: str) -> Any:
        if hf.get(key) is None:
            raise ValueError(f"config.json lacks required key {key!r} (or it is null)")
        return hf[key]

    act = hf.get("hidden_act", "silu")
    if act not in _ACTIVATIONS:
        raise ValueError(f"unsupported hidden_act {act!r}; supported: {sorted(_ACTIVATIONS)} "
                         "(approximate GELUs are not representable exactly)")
    if hf.get("mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported (the MLP has no biases)")

    if model_type == "qwen2":
        qkv_bias = True  # Qwen2 always has q/k/v biases and never an o_proj bias
    elif model_type == "llama":
        qkv_bias = bool(hf.get("attention_bias", False))
    else:
        qkv_bias = False

    n_heads = required("num_attention_heads")
    if model_type == "llama":
        n_kv_heads = hf.get("num_key_value_heads") or n_heads
    else:
        # Mistral/Qwen2 classes default this to a preset's value, not to num_attention_heads.
        n_kv_heads = required("num_key_value_heads")
    n_layers = required("num_hidden_layers")
    max_seq_len = required("max_position_embeddings")
    rope_base, rope_scaling = _rope_from_hf(hf, max_seq_len, model_type)
    return ModelConfig(
        vocab_size=required("vocab_size"),
        d_model=required("hidden_size"),
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=hf.get("head_dim"),
        d_ff=required("intermediate_size"),
        max_seq_len=max_seq_len,
        norm="rms",
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        norm_position="pre",
        ffn=_ACTIVATIONS[act],
        position="rope",
        rope_base=rope_base,
        rope_pairing="half",
        rope_scaling=rope_scaling,
        sliding_window=_sliding_window_from_hf(hf, model_type, n_layers),
        qkv_bias=qkv_bias,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def _rope_from_hf(hf: dict[str, Any], max_seq_len: int, model_type: str
                  ) -> tuple[float, RopeScaling | None]:
    """(rope_base, rope_scaling) from legacy ``rope_theta``/``rope_scaling`` or ``rope_parameters``.

    As in transformers, a legacy ``rope_scaling`` dict wins over ``rope_parameters``, and a
    ``rope_theta`` inside the dict wins over the top-level one. YaRN is read for Qwen2 only.
    """
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"rope_scaling/rope_parameters must be a dict, got {rope!r}")
    if "rope_type" not in rope and "type" not in rope and rope and all(
            isinstance(v, dict) for v in rope.values()):
        # Per-layer-type RoPE (nested by layer type) is fine only if every layer has the same.
        variants = list(rope.values())
        if any(v != variants[0] for v in variants):
            raise ValueError(f"per-layer-type RoPE parameters differ: {rope!r}")
        rope = variants[0]
    kinds = ("default", "linear", "llama3", *(("yarn",) if model_type == "qwen2" else ()))
    return rope_from_dict(rope, hf, max_seq_len, kinds)


def _sliding_window_from_hf(hf: dict[str, Any], model_type: str, n_layers: int) -> int | None:
    """The one window every layer uses, or None; mixed sliding/full layers are refused."""
    if model_type == "llama":
        return None
    window = hf.get("sliding_window")
    if model_type == "qwen2":
        if not hf.get("use_sliding_window", False):
            return None
        if window is None:
            raise ValueError("use_sliding_window=True needs a sliding_window")
        layer_types = hf.get("layer_types")
        if layer_types is None:
            if "max_window_layers" not in hf:
                raise ValueError("use_sliding_window=True needs max_window_layers or layer_types")
            # transformers: layer i slides iff i >= max_window_layers.
            layer_types = ["sliding_attention" if i >= hf["max_window_layers"]
                           else "full_attention" for i in range(n_layers)]
    else:
        if "sliding_window" not in hf:
            # MistralConfig would silently default it to 4096.
            raise ValueError("Mistral config.json lacks 'sliding_window' (null for none)")
        layer_types = hf.get("layer_types")
        if window is None:
            return None
        if layer_types is None:
            return int(window)
    if len(layer_types) != n_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {n_layers} layers")
    kinds = set(layer_types)
    if not kinds <= {"sliding_attention", "full_attention"}:
        raise ValueError(f"unsupported layer_types {sorted(kinds)}")
    if len(kinds) > 1:
        raise ValueError(
            f"mixed sliding-window and full-attention layers are not supported: layer_types="
            f"{layer_types} (Qwen2 max_window_layers={hf.get('max_window_layers')}, "
            f"num_hidden_layers={n_layers})")
    return int(window) if kinds == {"sliding_attention"} else None


def config_to_hf(config: ModelConfig, model_type: str | None = None) -> dict[str, Any]:
    """The HF ``config.json`` dict for a config.

    The model type follows from the fields unless given: Qwen2 (q/k/v biases), Mistral (a
    sliding window) or Llama for the plain pre-norm block; ``qk_norm="head"`` Qwen3;
    ``norm_position="sandwich"`` Gemma 2, with ``qk_norm="head"`` Gemma 3 (``gemma3_text``);
    ``"post_branch"`` with ``qk_norm="full"`` OLMo 2. Phi-3 (the Llama block with fused
    tensors) is written only when ``model_type="phi3"`` is asked for. A config with ``moe`` is
    Mixtral, Qwen2-MoE or Qwen3-MoE (``hf.moe.pick_model_type``). Writes both the legacy
    ``rope_theta``/``rope_scaling`` keys (transformers 4.x) and ``rope_parameters`` (5.x).

    Args:
      config: the model config.
      model_type: None (from the fields), or one of ``ARCHITECTURES`` that must represent it.

    Returns:
      A JSON-serialisable dict.

    Raises:
      ValueError: naming the setting that the model type cannot represent.
    """
    c = config
    fixed = {"norm": "rms", "position": "rope", "rope_pairing": "half"}
    for name, want in fixed.items():
        if getattr(c, name) != want:
            raise ValueError(f"HF Llama-family checkpoints need {name}={want!r}, got "
                             f"{getattr(c, name)!r}")
    if model_type is not None and model_type not in ARCHITECTURES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: "
                         f"{sorted(ARCHITECTURES)}")
    if c.moe is not None:
        model_type = model_type or moe.pick_model_type(c)
        if model_type not in moe.ARCHITECTURES:
            raise ValueError(f"HF {model_type} checkpoints have no mixture of experts, but moe "
                             f"is set; write one of {sorted(moe.ARCHITECTURES)}")
    if model_type in moe.ARCHITECTURES:
        return moe.config_to_hf(c, model_type)
    if model_type is None:
        model_type = families.pick_model_type(c)
    if model_type in families.ARCHITECTURES:
        return families.config_to_hf(c, model_type)
    families.require_fields(c, {"norm_position": "pre", **_LLAMA_DEFAULTS}, _FFN_TO_ACTIVATION,
                            "HF Llama-family")
    if c.layers_differ:
        raise ValueError("HF llama/mistral/qwen2 checkpoints cannot mix local and global "
                         f"layers (layer_pattern={c.layer_pattern})")
    window = c.sliding_window if c.local_layers else None
    natural = "qwen2" if c.qkv_bias else "mistral" if window is not None else "llama"
    if model_type not in (None, natural):
        raise ValueError(f"this config is a {natural} checkpoint, not {model_type} "
                         f"(qkv_bias={c.qkv_bias}, sliding_window={window})")
    model_type = natural
    if model_type == "llama" and c.d_model % c.n_heads:
        # transformers' LlamaConfig rejects this even with an explicit head_dim.
        raise ValueError(f"HF LlamaConfig needs d_model ({c.d_model}) divisible by n_heads "
                         f"({c.n_heads})")
    if c.rope_scaling is not None and c.rope_scaling.kind == "yarn" and model_type != "qwen2":
        raise ValueError("rope_scaling of kind 'yarn' is exported as qwen2 or qwen3 only, not "
                         f"{model_type}")
    hf: dict[str, Any] = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": c.vocab_size,
        "hidden_size": c.d_model,
        "intermediate_size": c.d_ff,
        "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": _FFN_TO_ACTIVATION[c.ffn],
        "max_position_embeddings": c.max_seq_len,
        "rms_norm_eps": c.norm_eps,
        **rope_keys(c.rope_base, c.rope_scaling),
        "tie_word_embeddings": c.tie_embeddings,
        "torch_dtype": c.param_dtype,
        "dtype": c.param_dtype,
    }
    if model_type == "llama":
        hf.update(attention_bias=False, mlp_bias=False)
    elif model_type == "mistral":
        hf.update(sliding_window=window)
    else:
        sliding = window is not None
        # Qwen2 slides in layers i >= max_window_layers: 0 means all of them, L means none.
        hf.update(use_sliding_window=sliding, sliding_window=window,
                  max_window_layers=0 if sliding else c.n_layers)
    return hf


# ------------------------------------------------------------------------------------------------
# Tensor mapping


#: HF names of each block's norms by ``norm_position``, (HF module, our param): those written
#: before the attention's tensors, and those before the MLP's (HF's order).
_BLOCK_NORMS = {
    "pre": ((("input_layernorm", "attn_norm"),), (("post_attention_layernorm", "mlp_norm"),)),
    "sandwich": ((("input_layernorm", "attn_norm"),),
                 (("post_attention_layernorm", "attn_out_norm"),
                  ("pre_feedforward_layernorm", "mlp_norm"),
                  ("post_feedforward_layernorm", "mlp_out_norm"))),
    "post_branch": ((), (("post_attention_layernorm", "attn_out_norm"),
                         ("post_feedforward_layernorm", "mlp_out_norm"))),
}


def _tensors(config: ModelConfig, model_type: str | None = None, stacked_experts: bool = False
             ) -> list[_Tensor]:
    """Every tensor of the HF checkpoint of ``config`` (Phi-3's fused ones for
    ``model_type="phi3"``; the model type's layout otherwise follows from the fields; the
    sparse layers' in ``hf.moe``, their experts stacked with ``stacked_experts``)."""
    c = config
    d, n, kv, h, f, v = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff, c.vocab_size
    if c.norm_position not in _BLOCK_NORMS:
        raise ValueError(f"no HF layout has norm_position={c.norm_position!r}")
    out = [_same("model.embed_tokens.weight", ("embed", "embedding"), (v, d))]
    for i in range(c.n_layers):
        hf, ours = f"model.layers.{i}", f"blocks_{i}"
        attn, mlp = f"{hf}.self_attn", f"{hf}.mlp"
        before_attn, before_mlp = ([_same(f"{hf}.{name}.weight", (ours, param, "scale"), (d,))
                                    for name, param in norms]
                                   for norms in _BLOCK_NORMS[c.norm_position])
        out += before_attn
        qkv = [
            _heads_in(f"{attn}.q_proj.weight", (ours, "attn", "q_proj"), d, n, h),
            _heads_in(f"{attn}.k_proj.weight", (ours, "attn", "k_proj"), d, kv, h),
            _heads_in(f"{attn}.v_proj.weight", (ours, "attn", "v_proj"), d, kv, h),
        ]
        out += _fused(qkv, f"{attn}.qkv_proj.weight") if model_type == "phi3" else qkv
        if c.qkv_bias:
            out += [
                _reshaped(f"{attn}.q_proj.bias", (ours, "attn", "q_bias"), (n * h,), (n, h)),
                _reshaped(f"{attn}.k_proj.bias", (ours, "attn", "k_bias"), (kv * h,), (kv, h)),
                _reshaped(f"{attn}.v_proj.bias", (ours, "attn", "v_bias"), (kv * h,), (kv, h)),
            ]
        if c.qk_norm == "head":
            out += [_same(f"{attn}.{x}_norm.weight", (ours, "attn", f"{x}_norm", "scale"), (h,))
                    for x in "qk"]
        elif c.qk_norm == "full":
            out += [_reshaped(f"{attn}.{x}_norm.weight", (ours, "attn", f"{x}_norm", "scale"),
                              (heads * h,), (heads, h)) for x, heads in (("q", n), ("k", kv))]
        out += [_heads_out(f"{attn}.o_proj.weight", (ours, "attn", "o_proj"), d, n, h),
                *before_mlp]
        if c.moe is not None and c.moe.is_sparse(i):
            out += moe.ffn_tensors(c, i, model_type or moe.pick_model_type(c), stacked_experts)
            continue
        gate_up = [_linear(f"{mlp}.gate_proj.weight", (ours, "mlp", "gate"), d, f),
                   _linear(f"{mlp}.up_proj.weight", (ours, "mlp", "up"), d, f)]
        out += _fused(gate_up, f"{mlp}.gate_up_proj.weight") if model_type == "phi3" else gate_up
        out.append(_linear(f"{mlp}.down_proj.weight", (ours, "mlp", "down"), f, d))
    out.append(_same("model.norm.weight", ("final_norm", "scale"), (d,)))
    if not c.tie_embeddings:
        out.append(_linear("lm_head.weight", ("lm_head",), d, v))
    return out


__all__ = ["ARCHITECTURES", "config_from_hf", "config_to_hf"]
