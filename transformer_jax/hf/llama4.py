"""Llama 4 (text): ``llama4_text`` / ``Llama4ForCausalLM``, declared as a ``families.Family``.

Pure functions, no file I/O. Llama's block with NoPE layers, chunked attention, a weightless
QK-norm and a top-1 sigmoid-scaled mixture (docs/models.md). A sparse layer's tensors are
``feed_forward.router.weight`` [E, D], ``experts.gate_up_proj`` [E, D, 2F] (in-first, gate
columns first), ``experts.down_proj`` [E, F, D] and ``shared_expert.{gate,up,down}_proj``.
The published ``Llama4ForConditionalGeneration`` (``llama4``) checkpoints load as their text
model (``text_model``: its tensors under ``language_model.``, the vision tower unread).
"""

from __future__ import annotations

import dataclasses
from collections import ChainMap
from typing import Any

from transformer_jax.hf.families import Family, int_at_least, layer_period
from transformer_jax.hf.tensors import _fused, _linear, _same, _Tensor
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.fields import MoE

_TYPES = {"chunked_attention": "chunked", "full_attention": "global"}
_KIND_TO_TYPE = {v: k for k, v in _TYPES.items()}


def _int_list(hf: ChainMap[str, Any], key: str) -> list[int] | None:
    value = hf.get(key)
    if value is not None and (not isinstance(value, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in value)):
        raise ValueError(f"{key} must be a list of ints, got {value!r}")
    return value


def _read(hf: ChainMap[str, Any], n_layers: int, max_seq_len: int) -> dict[str, Any]:
    if hf.get("router_jitter_noise"):
        raise ValueError(f"router_jitter_noise={hf['router_jitter_noise']} is not supported "
                         "(training-time noise on the router's input); set it to 0.0")
    rope = _int_list(hf, "no_rope_layers") or [
        int((i + 1) % hf["no_rope_layer_interval"] != 0) for i in range(n_layers)]
    if len(rope) != n_layers:
        raise ValueError(f"no_rope_layers must have one entry per layer ({n_layers}), got "
                         f"{len(rope)}")
    chunk = hf.get("attention_chunk_size")
    types = hf.get("layer_types") or [
        "chunked_attention" if r and chunk is not None else "full_attention" for r in rope]
    if len(types) != n_layers or any(t not in _TYPES for t in types):
        raise ValueError(f"layer_types must list {n_layers} entries of {sorted(_TYPES)}, got "
                         f"{types!r}")
    kinds = [_TYPES[t] for t in types]
    if "chunked" in kinds and chunk is None:
        raise ValueError("layer_types has chunked_attention layers but attention_chunk_size "
                         "is null")
    nope = tuple(i for i, r in enumerate(rope) if not r)
    tuning = bool(hf["attn_temperature_tuning"]) and bool(nope)
    return dict(
        rope_pairing="adjacent", d_ff=hf["intermediate_size_mlp"],
        layer_pattern=layer_period(kinds),
        attention_chunk=int(chunk) if "chunked" in kinds else None, nope_layers=nope,
        qk_norm="weightless" if hf["use_qk_norm"] else None,
        nope_temperature_floor=int(hf["floor_scale"]) if tuning else None,
        nope_temperature_scale=float(hf["attn_scale"]) if tuning else 0.1,
        moe=_moe(hf, n_layers))


def _moe(hf: ChainMap[str, Any], n_layers: int) -> MoE | None:
    """The ``MoE`` table of ``moe_layers`` (or ``interleave_moe_layer_step``), None without
    sparse layers."""
    step = int_at_least(hf["interleave_moe_layer_step"], "interleave_moe_layer_step", 1)
    listed = _int_list(hf, "moe_layers")
    sparse = set(range(step - 1, n_layers, step) if listed is None else listed)
    sparse &= set(range(n_layers))
    if not sparse:
        return None
    if any((i + 1) % step for i in sparse):  # not on the step's layers: list them all
        step = 1
    dense = tuple(i for i in range(step - 1, n_layers, step) if i not in sparse)
    top_k = hf["num_experts_per_tok"]
    if top_k != 1:
        raise ValueError(f"num_experts_per_tok={top_k} is not supported: Llama 4 routes each "
                         "token to one expert")
    f = hf["intermediate_size"]
    return MoE(n_experts=hf["num_local_experts"], top_k=1, d_ff=f, renormalize=False,
               shared_d_ff=f, score="sigmoid", scale_input=True, sparse_step=step,
               dense_layers=dense)


def _write(c: ModelConfig) -> dict[str, Any]:
    if c.qk_norm not in (None, "weightless"):
        raise ValueError(f"HF llama4_text checkpoints need qk_norm None or 'weightless', got "
                         f"{c.qk_norm!r}")
    kinds = c.layer_kinds()
    if "local" in kinds:
        raise ValueError("HF llama4_text checkpoints have no sliding-window layers")
    m, sparse = c.moe, set(c.sparse_layers)
    if m is not None and m.shared_d_ff != m.d_ff:
        raise ValueError(f"HF llama4_text checkpoints need moe.shared_d_ff equal to moe.d_ff "
                         f"({m.d_ff}), got {m.shared_d_ff}")
    if c.nope_temperature_floor is None and c.nope_temperature_scale != 0.1:
        raise ValueError("nope_temperature_scale without nope_temperature_floor: set it to 0.1")
    return dict(
        intermediate_size=c.d_ff if m is None else m.d_ff, intermediate_size_mlp=c.d_ff,
        num_local_experts=1 if m is None else m.n_experts, num_experts_per_tok=1,
        moe_layers=sorted(sparse), interleave_moe_layer_step=1 if m is None else m.sparse_step,
        no_rope_layers=[int(i not in c.nope_layers) for i in range(c.n_layers)],
        attention_chunk_size=c.attention_chunk,
        layer_types=[_KIND_TO_TYPE[k] for k in kinds], use_qk_norm=c.qk_norm is not None,
        attn_temperature_tuning=c.nope_temperature_floor is not None,
        floor_scale=c.nope_temperature_floor or 8192, attn_scale=c.nope_temperature_scale,
        attention_bias=False, router_jitter_noise=0.0, router_aux_loss_coef=0.0)


def sparse_tensors(config: ModelConfig, layer: int) -> list[_Tensor]:
    """The HF tensors of sparse layer ``layer``'s FFN (see the module docstring)."""
    c, m = config, config.moe
    d, e, f = c.d_model, m.n_experts, m.d_ff
    hf, ours = f"model.layers.{layer}.feed_forward", (f"blocks_{layer}", "moe")
    experts = f"{hf}.experts"
    out = [_linear(f"{hf}.router.weight", (*ours, "router"), d, e)]
    out += _fused([_same("", (*ours, "gate"), (e, d, f)), _same("", (*ours, "up"), (e, d, f))],
                  f"{experts}.gate_up_proj", axis=2)
    out.append(_same(f"{experts}.down_proj", (*ours, "down"), (e, f, d)))
    return out + [_linear(f"{hf}.shared_expert.{p}_proj.weight", (*ours, "shared", p), *dims)
                  for p, dims in (("gate", (d, f)), ("up", (d, f)), ("down", (f, d)))]


LLAMA4_TEXT = Family(
    "llama4_text", "Llama4ForCausalLM", _read, _write,
    fixed={"rope_pairing": "adjacent", "moe.renormalize": False, "moe.score": "sigmoid",
           "moe.scale_input": True},
    free=frozenset({"layer_pattern", "attention_chunk", "nope_layers", "qk_norm",
                    "nope_temperature_floor", "nope_temperature_scale", "moe.shared_d_ff",
                    "moe.sparse_step", "moe.dense_layers"}),
    defaults=dict(rms_norm_eps=1e-5, rope_theta=500000.0, intermediate_size_mlp=16384,
                  num_local_experts=16, num_experts_per_tok=1, interleave_moe_layer_step=1,
                  use_qk_norm=True, no_rope_layer_interval=4, attention_chunk_size=8192,
                  attn_temperature_tuning=True, floor_scale=8192, attn_scale=0.1),
    required=frozenset({"num_key_value_heads", "head_dim"}),
    ffn_module="feed_forward", sparse_tensors=sparse_tensors, quant_methods=frozenset())

#: The key ``text_model`` adds to the text config it returns: its tensors' name prefix.
PREFIX_KEY = "_tensor_prefix"


def text_model(hf_config: dict[str, Any]) -> dict[str, Any]:
    """A ``Llama4ForConditionalGeneration`` ``config.json``'s text model, as the
    ``llama4_text`` config it is, with ``PREFIX_KEY`` giving its tensors' prefix
    (``language_model.``); any other config as it is."""
    if hf_config.get("model_type") != "llama4":
        return hf_config
    text = hf_config.get("text_config")
    if not isinstance(text, dict):
        raise ValueError("llama4 config.json lacks its text_config (a dict)")
    return {**text, "model_type": "llama4_text", "architectures": ["Llama4ForCausalLM"],
            PREFIX_KEY: "language_model."}


def prefixed(specs: list[_Tensor], hf_config: dict[str, Any]) -> list[_Tensor]:
    """``specs`` with the tensor name prefix ``text_model`` recorded in ``hf_config``."""
    prefix = hf_config.get(PREFIX_KEY, "")
    return [dataclasses.replace(s, hf_name=prefix + s.hf_name) for s in specs] if prefix \
        else specs


__all__ = ["LLAMA4_TEXT", "PREFIX_KEY", "prefixed", "sparse_tensors", "text_model"]
