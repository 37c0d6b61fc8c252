"""HuggingFace names and layouts <-> ``ModelConfig`` and our param tree, for every family.

Pure functions, no file I/O. Each family is a ``families.Family`` (Llama, Mistral and Qwen2
here), ``FAMILIES`` lists them all; ``config_from_hf``/``config_to_hf`` map ``config.json`` by
it, refusing what has no exact equivalent. ``_tensors(config)`` lists every HF tensor with the
param it becomes (``hf.tensors._Tensor``): ``Linear`` weights [out, in] become [in, out] with
heads split out (``q_proj.weight`` [N*H, D] -> ``q_proj`` [D, N, H], ``o_proj.weight``
[D, N*H] -> [N, H, D]). HF Llama's rotation is ``rope_pairing="half"``.
"""

from __future__ import annotations

import dataclasses
import re
from collections import ChainMap
from functools import partial
from typing import Any

from transformer_jax.hf import deepseek, families, fp8, llama4, moe
from transformer_jax.hf.families import COMMON, Family, required
from transformer_jax.hf.tensors import (
    _fused,
    _heads_in,
    _heads_out,
    _linear,
    _reshaped,
    _same,
    _Tensor,
)
from transformer_jax.model.config import Architecture, ModelConfig
from transformer_jax.model.mtp import module_key

# Buffers some older checkpoints carry that are recomputed from the config.
_IGNORED_TENSOR = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")


def _window_read(hf: ChainMap[str, Any], n_layers: int, max_seq_len: int, *, qwen2: bool
                 ) -> dict[str, Any]:
    """Mistral's and Qwen2's window: the one every layer uses, or None; mixed sliding/full
    layers are refused."""
    window = hf.get("sliding_window")
    if qwen2:
        if not hf.get("use_sliding_window", False):
            return dict(sliding_window=None)
        kinds = families._qwen_kinds(hf, n_layers)  # Qwen3's rule: the same keys
    elif window is None or hf.get("layer_types") is None:
        return dict(sliding_window=window)
    else:
        kinds = families.layer_kinds_from_hf(hf["layer_types"], n_layers)
    if len(set(kinds)) > 1:
        raise ValueError(
            f"mixed sliding-window and full-attention layers are not supported: layer_types="
            f"{[families._KIND_TO_TYPE[k] for k in kinds]} (Qwen2 max_window_layers="
            f"{hf.get('max_window_layers')}, num_hidden_layers={n_layers})")
    return dict(sliding_window=int(window) if set(kinds) == {"local"} else None)


def _llama_write(c: ModelConfig) -> dict[str, Any]:
    if c.d_model % c.n_heads:  # transformers' LlamaConfig rejects this even with a head_dim
        raise ValueError(f"HF LlamaConfig needs d_model ({c.d_model}) divisible by n_heads "
                         f"({c.n_heads})")
    return {}


def _qwen2_write(c: ModelConfig) -> dict[str, Any]:
    # Qwen2 slides in layers i >= max_window_layers: 0 means all of them, L means none.
    sliding = c.sliding_window is not None
    return dict(use_sliding_window=sliding, sliding_window=c.sliding_window,
                max_window_layers=0 if sliding else c.n_layers)


# Llama's attention_bias (q/k/v and o_proj biases) is read as qkv_bias, ``load`` then requiring
# zero o_proj biases; such a config is written as Qwen2 (q/k/v biases only).
LLAMA = Family("llama", "LlamaForCausalLM",
               lambda hf, n_layers, max_seq_len: dict(qkv_bias=bool(hf.get("attention_bias"))),
               _llama_write)
MISTRAL = Family("mistral", "MistralForCausalLM", partial(_window_read, qwen2=False),
                 lambda c: dict(sliding_window=c.sliding_window),
                 free=frozenset({"sliding_window"}), required=frozenset({"num_key_value_heads"}),
                 present=frozenset({"sliding_window"}))
QWEN2 = Family("qwen2", "Qwen2ForCausalLM", partial(_window_read, qwen2=True), _qwen2_write,
               fixed=dict(qkv_bias=True), free=frozenset({"sliding_window"}),
               rope_kinds=families.ALL_ROPE, required=frozenset({"num_key_value_heads"}))

#: Every family by model type, in the order export tries them (the first that matches).
FAMILIES = {f.model_type: f for f in (
    LLAMA, MISTRAL, QWEN2, families.QWEN3, families.GEMMA2, families.GEMMA3_TEXT,
    families.OLMO2, families.PHI3, moe.MIXTRAL, moe.QWEN3_MOE, moe.QWEN2_MOE, moe.GPT_OSS,
    llama4.LLAMA4_TEXT, deepseek.DEEPSEEK_V3)}
ARCHITECTURES = {name: f.hf_class for name, f in FAMILIES.items()}
# transformers' defaults of keys every family may omit (``Family.defaults`` override them).
_DEFAULTS = {"rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False}
_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
             "max_position_embeddings", "intermediate_size")
# Settings no family has: a true value is refused.
_REFUSED = {"mlp_bias": "mlp_bias=True is not supported (the MLP has no biases)",
            "use_bidirectional_attention": "use_bidirectional_attention=True is not supported "
                                           "(causal only)"}


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Maps a HF ``config.json`` dict (any model type of ``ARCHITECTURES``) to a ``ModelConfig``
    by its family's declaration, with float32 ``param_dtype``/``dtype`` (``load`` sets them).

    Args:
      hf: the parsed ``config.json``.

    Returns:
      The equivalent ``ModelConfig``.

    Raises:
      ValueError: naming the setting that has no exact equivalent.
    """
    family = FAMILIES.get(hf.get("model_type"))
    if family is None:
        raise ValueError(f"unsupported model_type {hf.get('model_type')!r}; supported: "
                         f"{sorted(FAMILIES)}")
    architectures = hf.get("architectures")
    if architectures is not None and list(architectures) != [family.hf_class]:
        raise ValueError(f"unsupported architectures {architectures!r} for model_type "
                         f"{family.model_type!r}; expected [{family.hf_class!r}]")
    for key, why in _REFUSED.items():
        if hf.get(key):
            raise ValueError(why)
    _check_quantization(hf.get("quantization_config"), family)
    for key in (*_REQUIRED, *sorted(family.required)):
        required(hf, key)
    for key in sorted(family.present):
        if key not in hf:  # transformers' default would be a preset's value
            raise ValueError(f"{family.model_type} config.json lacks {key!r} (null for none)")
    cfg = ChainMap(hf, dict(family.defaults), _DEFAULTS)
    act = cfg.get(family.act_key)
    if act not in family.activations:
        raise ValueError(f"unsupported {family.act_key} {act!r}; supported: "
                         f"{sorted(family.activations)} (exact matches only)")
    n_layers, max_seq_len = hf["num_hidden_layers"], hf["max_position_embeddings"]
    fields = family.read(cfg, n_layers, max_seq_len)
    # Accepted only with q/k/v biases read (Llama's; ``load`` requires zero o_proj biases).
    if hf.get("attention_bias") and not fields.get("qkv_bias"):
        raise ValueError(f"attention_bias=True is not supported for {family.model_type} (it "
                         "also biases o_proj, which the model lacks)")
    if "rope_base" not in fields:
        fields["rope_base"], fields["rope_scaling"] = families.read_rope(
            cfg, max_seq_len, family.rope_kinds)
    common = dict(
        vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=n_layers,
        n_heads=hf["num_attention_heads"],
        n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=hf.get("head_dim"), d_ff=hf["intermediate_size"], max_seq_len=max_seq_len,
        norm_eps=float(cfg["rms_norm_eps"]), ffn=family.activations[act],
        tie_embeddings=bool(cfg["tie_word_embeddings"]))
    # A family's own reading of a common key (Llama 4's dense d_ff) wins.
    return ModelConfig(**{**common, **{k: v for k, v in family.fixed.items() if "." not in k},
                          **fields})


def _check_quantization(quant: Any, family: Family) -> None:
    """Refuses a ``quantization_config`` the family's checkpoints cannot have or ``load`` cannot
    read."""
    if not quant:
        return
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method not in family.quant_methods:
        only = (f"; {family.model_type} reads {', '.join(sorted(family.quant_methods))}"
                if family.quant_methods else "")
        raise ValueError(f"quantized checkpoints (quantization_config with quant_method "
                         f"{method!r}) are not supported{only}")
    if method == fp8.METHOD:
        fp8.block_size(quant)


def config_to_hf(config: ModelConfig, model_type: str | None = None) -> dict[str, Any]:
    """The HF ``config.json`` dict for a config, as the first family of ``FAMILIES`` that
    matches it (Phi-3 only when ``model_type`` names it), with both the legacy RoPE keys and
    ``rope_parameters``.

    Args:
      config: the model config.
      model_type: None (from the fields), or one of ``ARCHITECTURES`` that must represent it.

    Returns:
      A JSON-serialisable dict.

    Raises:
      ValueError: naming the field (and its value) that the model type cannot represent; with
        no ``model_type``, the fields no family has together and the closest family's reason.
    """
    c = _canonical(config)
    family = _family(c, model_type)
    return {
        "architectures": [family.hf_class], "model_type": family.model_type,
        "vocab_size": c.vocab_size, "hidden_size": c.d_model, "intermediate_size": c.d_ff,
        "num_hidden_layers": c.n_layers, "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads, "head_dim": c.head_dim,
        "max_position_embeddings": c.max_seq_len, "rms_norm_eps": c.norm_eps,
        "tie_word_embeddings": c.tie_embeddings, "torch_dtype": c.param_dtype,
        "dtype": c.param_dtype,
        # ``hf.save`` sets them from a tokenizer (the classes' defaults are a preset's ids).
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
        family.act_key: next(k for k, v in family.activations.items() if v == c.ffn),
        **families.rope_keys(c.rope_base, c.rope_scaling), **family.write(c)}


def _canonical(c: ModelConfig) -> ModelConfig:
    """``c`` with what its layers do not use dropped, as import gives it: no window, pattern
    or local RoPE base without local layers, no pattern for uniform layers."""
    kinds = set(c.layer_kinds())
    if "chunked" not in kinds:
        c = c.replace(attention_chunk=None)
    if "local" not in kinds:
        c = c.replace(sliding_window=None, local_rope_base=None)
    return c.replace(layer_pattern=()) if len(kinds) == 1 else c


def _family(c: ModelConfig, model_type: str | None) -> Family:
    """The family ``model_type`` names, or the first picked one that matches ``c``; raises
    ValueError naming what it cannot hold."""
    if model_type is not None:
        if model_type not in FAMILIES:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: "
                             f"{sorted(FAMILIES)}")
        wrong = FAMILIES[model_type].mismatches(c)
        if wrong:
            natural = next((name for name, f in FAMILIES.items()
                            if f.picked and not f.mismatches(c)), None)
            hint = f" (this config is a {natural} checkpoint)" if natural else ""
            raise ValueError(f"HF {model_type} checkpoints {'; '.join(wrong)}{hint}")
        return FAMILIES[model_type]
    reasons = {name: f.mismatches(c) for name, f in FAMILIES.items() if f.picked}
    for name, wrong in reasons.items():
        if not wrong:
            return FAMILIES[name]
    closest = min(reasons, key=lambda name: len(reasons[name]))
    own = ", ".join(f"{f.name}={getattr(c, f.name)!r}" for f in dataclasses.fields(Architecture)
                    if f.name not in COMMON and getattr(c, f.name) != f.default)
    raise ValueError(f"no HF model type has {own or 'this config'}; the closest, HF {closest} "
                     f"checkpoints, {'; '.join(reasons[closest])}")


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


def _layer_tensors(c: ModelConfig, family: Family, i: int, stacked_experts: bool
                   ) -> list[_Tensor]:
    """Layer i's HF tensors (``model.layers.{i}``), as params of ``blocks_{i}``."""
    d, n, kv, h, f = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff
    out: list[_Tensor] = []
    hf, ours = f"model.layers.{i}", f"blocks_{i}"
    attn, mlp = f"{hf}.self_attn", f"{hf}.{family.ffn_module}"
    before_attn, before_mlp = ([_same(f"{hf}.{name}.weight", (ours, param, "scale"), (d,))
                                for name, param in norms]
                               for norms in _BLOCK_NORMS[c.norm_position])
    out += before_attn
    if c.mla is not None:
        out += deepseek.attention_tensors(c, attn, (ours,))
    projections = () if c.mla is not None else (("q", n), ("k", kv), ("v", kv))
    qkv = [_heads_in(f"{attn}.{x}_proj.weight", (ours, "attn", f"{x}_proj"), d, nh, h)
           for x, nh in projections]
    out += _fused(qkv, f"{attn}.qkv_proj.weight") if family.fused else qkv
    if c.qkv_bias:
        out += [_reshaped(f"{attn}.{x}_proj.bias", (ours, "attn", f"{x}_bias"), (nh * h,),
                          (nh, h)) for x, nh in projections]
    if c.qk_norm == "head":
        out += [_same(f"{attn}.{x}_norm.weight", (ours, "attn", f"{x}_norm", "scale"), (h,))
                for x in "qk"]
    elif c.qk_norm == "full":
        out += [_reshaped(f"{attn}.{x}_norm.weight", (ours, "attn", f"{x}_norm", "scale"),
                          (heads * h,), (heads, h)) for x, heads in (("q", n), ("k", kv))]
    if c.mla is None:
        out.append(_heads_out(f"{attn}.o_proj.weight", (ours, "attn", "o_proj"), d, n, h))
    if c.o_bias:
        out.append(_same(f"{attn}.o_proj.bias", (ours, "attn", "o_bias"), (d,)))
    if c.attn_sinks:
        out.append(_same(f"{attn}.sinks", (ours, "attn", "sinks"), (n,)))
    out += before_mlp
    if c.moe is not None and c.moe.is_sparse(i):
        out += (family.sparse_tensors(c, i) if family.sparse_tensors
                else moe.ffn_tensors(c, i, family, stacked_experts))
        return out
    gate_up = [_linear(f"{mlp}.gate_proj.weight", (ours, "mlp", "gate"), d, f),
               _linear(f"{mlp}.up_proj.weight", (ours, "mlp", "up"), d, f)]
    out += _fused(gate_up, f"{mlp}.gate_up_proj.weight") if family.fused else gate_up
    out.append(_linear(f"{mlp}.down_proj.weight", (ours, "mlp", "down"), f, d))
    return out


def _tensors(config: ModelConfig, model_type: str | None = None, stacked_experts: bool = False
             ) -> list[_Tensor]:
    """Every tensor of the HF checkpoint of ``config`` as ``model_type`` (None: the family
    export picks), the experts stacked with ``stacked_experts``."""
    c = config
    family = FAMILIES[model_type] if model_type else _family(_canonical(c), None)
    d, v = c.d_model, c.vocab_size
    if c.norm_position not in _BLOCK_NORMS:
        raise ValueError(f"no HF layout has norm_position={c.norm_position!r}")
    out = [_same("model.embed_tokens.weight", ("embed", "embedding"), (v, d))]
    for i in range(c.n_layers):
        out += _layer_tensors(c, family, i, stacked_experts)
    for k in range(1, c.mtp_depth + 1):  # module k's block is HF layer L + k - 1
        i = c.n_layers + k - 1
        block = [dataclasses.replace(t, path=(module_key(k), "block", *t.path[1:]))
                 for t in _layer_tensors(c, family, i, stacked_experts)]
        out += deepseek.mtp_tensors(c, i, (module_key(k),), block)
    out.append(_same("model.norm.weight", ("final_norm", "scale"), (d,)))
    if not c.tie_embeddings:
        out.append(_linear("lm_head.weight", ("lm_head",), d, v))
    return out


__all__ = ["ARCHITECTURES", "FAMILIES", "config_from_hf", "config_to_hf"]
