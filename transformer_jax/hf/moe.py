"""The mixture-of-experts families Mixtral, Qwen2-MoE, Qwen3-MoE and GPT-OSS, declared as
``families.Family``, and the experts' tensors.

Pure functions, no file I/O. The attention is the Llama layout's; each family's FFN is our
``MoE`` table (docs/models.md, docs/moe.md). A ``num_experts`` of 0 (or every layer in
``mlp_only_layers``) is a dense model (``moe=None``); transformers' loss settings are not read.

Experts' tensors, both layouts read (``stacked_experts`` tells which a file has): one tensor
per expert, ``{mlp}.experts.{j}.{gate,up,down}_proj.weight`` [F, D] / [D, F] (Mixtral:
``block_sparse_moe.experts.{j}.w1`` gate, ``w3`` up, ``w2`` down), as ``save_pretrained`` and
``save`` write them; or transformers 5's stacked ``mlp.experts.gate_up_proj`` [E, 2F, D] (gate
rows first) and ``down_proj`` [E, D, F]. GPT-OSS's are stacked in-first, ``gate_up_proj``
[E, D, 2F] with gate and up columns alternating (its bias [E, 2F] likewise), ``down_proj``
[E, F, D]. Ours: ``moe/gate``, ``moe/up`` [E, D, F], ``moe/down`` [E, F, D], ``moe/router``
[D, E] (HF ``gate.weight`` [E, D]), ``moe/shared/*`` a dense FFN, ``moe/shared_gate`` [D, 1].
"""

from __future__ import annotations

import dataclasses
from collections import ChainMap
from collections.abc import Iterable, Mapping
from functools import partial
from typing import Any

from transformer_jax.hf import families
from transformer_jax.hf.families import ALL_ROPE, Family
from transformer_jax.hf.tensors import _fused, _linear, _same, _Tensor
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.fields import MoE

_STACKED = ".experts.gate_up_proj"


def _read(hf: ChainMap[str, Any], n_layers: int, max_seq_len: int, *, model_type: str
          ) -> dict[str, Any]:
    jitter = hf.get("router_jitter_noise") or 0.0
    if jitter:
        raise ValueError(f"router_jitter_noise={jitter} is not supported (training-time noise "
                         "on the router's input, which the model lacks); set it to 0.0")
    window, pattern = families.window_and_pattern(_layer_kinds(hf, model_type, n_layers),
                                                  hf.get("sliding_window"))
    out = dict(sliding_window=window, layer_pattern=pattern,
               moe=_moe_from_hf(hf, model_type, n_layers))
    return {**out, "qkv_bias": bool(hf["qkv_bias"])} if model_type == "qwen2_moe" else out


def _layer_kinds(hf: Mapping[str, Any], model_type: str, n_layers: int) -> list[str]:
    """Each layer's local/global attention as transformers 5 reads the family's config."""
    if model_type == "mixtral":  # one window on every layer, or none
        return ["local" if hf.get("sliding_window") is not None else "global"] * n_layers
    sliding = bool(hf.get("use_sliding_window", False))
    if model_type == "qwen3_moe":  # the window, if used, is every layer's
        if sliding and hf.get("sliding_window") is None:
            raise ValueError("use_sliding_window=True needs a sliding_window")
        return ["local" if sliding else "global"] * n_layers
    layer_types = hf.get("layer_types")
    if layer_types is None:  # Qwen2MoeConfig's rule: odd-numbered layers below the limit
        limit = hf.get("max_window_layers", 28)
        return ["local" if sliding and (i + 1) % 2 and i < limit else "global"
                for i in range(n_layers)]
    kinds = families.layer_kinds_from_hf(layer_types, n_layers)
    if "local" in kinds and not sliding:
        raise ValueError("layer_types has sliding_attention layers but use_sliding_window is "
                         "false (transformers then sets their window to 0)")
    return kinds


def _moe_from_hf(hf: ChainMap[str, Any], model_type: str, n_layers: int) -> MoE | None:
    """The ``MoE`` table, or None when no layer is sparse (Qwen's layer i: when ``(i + 1) %
    decoder_sparse_step == 0`` and not in ``mlp_only_layers``)."""
    if model_type == "qwen2_moe":
        n_experts = hf.get("num_experts")
    else:  # transformers maps num_experts to num_local_experts (either name may be written)
        raw = hf.maps[0]
        values = {raw[n] for n in ("num_local_experts", "num_experts") if raw.get(n) is not None}
        if len(values) > 1:
            raise ValueError(f"num_local_experts ({raw['num_local_experts']}) and num_experts "
                             f"({raw['num_experts']}) differ")
        n_experts = values.pop() if values else hf["num_experts"]
    families.int_at_least(n_experts, "num_experts", 0)
    top_k = hf.get("num_experts_per_tok")
    if n_experts and (isinstance(top_k, bool) or not isinstance(top_k, int)
                      or not 1 <= top_k <= n_experts):
        raise ValueError(f"num_experts_per_tok must be an int in 1..{n_experts} (the experts), "
                         f"got {top_k!r}")
    if model_type in ("mixtral", "gpt_oss"):  # every layer sparse, one width
        return MoE(n_experts=n_experts, top_k=top_k, d_ff=hf["intermediate_size"])
    step = families.int_at_least(hf.get("decoder_sparse_step", 1), "decoder_sparse_step", 1)
    only = hf.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
        raise ValueError(f"mlp_only_layers must be a list of layer indices, got {only!r}")
    # Canonical: only the listed layers the step makes sparse (transformers ignores the rest).
    dense = tuple(sorted({i for i in only if 0 <= i < n_layers and (i + 1) % step == 0}))
    if not n_experts or len(dense) == len(range(step - 1, n_layers, step)):
        return None
    shared = families.int_at_least(hf.get("shared_expert_intermediate_size")
                                   if model_type == "qwen2_moe" else 0,
                                   "shared_expert_intermediate_size", 0)
    renormalize = hf.get("norm_topk_prob")
    if not isinstance(renormalize, bool):
        raise ValueError(f"norm_topk_prob must be a bool, got {renormalize!r}")
    return MoE(n_experts=n_experts, top_k=top_k, d_ff=hf.get("moe_intermediate_size"),
               renormalize=renormalize, shared_d_ff=shared, shared_gate=shared > 0,
               sparse_step=step, dense_layers=dense)


def _mixtral_write(c: ModelConfig) -> dict[str, Any]:
    m = c.moe
    # One width: the experts' (the dense d_ff is unused when every layer is sparse).
    return dict(num_local_experts=m.n_experts, num_experts_per_tok=m.top_k,
                intermediate_size=m.d_ff, router_jitter_noise=0.0,
                sliding_window=c.sliding_window)


def _qwen_write(c: ModelConfig, *, qwen2: bool) -> dict[str, Any]:
    m, sparse = c.moe, set(c.sparse_layers)
    if qwen2 and m.shared_d_ff and not m.shared_gate:
        raise ValueError("HF qwen2_moe checkpoints gate their shared expert: moe.shared_gate "
                         "must be true with moe.shared_d_ff > 0")
    out = dict(num_experts=m.n_experts, num_experts_per_tok=m.top_k,
               moe_intermediate_size=m.d_ff, norm_topk_prob=m.renormalize,
               decoder_sparse_step=m.sparse_step,
               mlp_only_layers=[i for i in range(m.sparse_step - 1, c.n_layers, m.sparse_step)
                                if i not in sparse],
               use_sliding_window=c.sliding_window is not None, sliding_window=c.sliding_window)
    if qwen2:
        out.update(qkv_bias=c.qkv_bias, shared_expert_intermediate_size=m.shared_d_ff,
                   layer_types=families.layer_types_to_hf(c), max_window_layers=c.n_layers)
    return out


def _gpt_oss_read(hf: ChainMap[str, Any], n_layers: int, max_seq_len: int) -> dict[str, Any]:
    kinds = (families.layer_kinds_from_hf(hf["layer_types"], n_layers)
             if hf.get("layer_types") is not None
             else ["local" if i % 2 == 0 else "global" for i in range(n_layers)])
    window, pattern = families.window_and_pattern(kinds, hf.get("sliding_window"))
    bias = bool(hf.get("attention_bias"))
    moe = _moe_from_hf(hf, "gpt_oss", n_layers)
    if moe is None:
        raise ValueError("gpt_oss needs num_local_experts > 0")
    return dict(sliding_window=window, layer_pattern=pattern, qkv_bias=bias, o_bias=bias,
                moe=dataclasses.replace(moe, router_bias=True, expert_bias=True),
                swiglu_limit=float(hf["swiglu_limit"]), swiglu_alpha=float(hf["swiglu_alpha"]))


def _gpt_oss_write(c: ModelConfig) -> dict[str, Any]:
    if c.qkv_bias != c.o_bias:
        raise ValueError("HF gpt_oss checkpoints bias q/k/v and o together (attention_bias): "
                         f"got qkv_bias={c.qkv_bias}, o_bias={c.o_bias}")
    if c.swiglu_limit is None:
        raise ValueError("HF gpt_oss checkpoints clamp their SwiGLU: swiglu_limit must be set")
    m = c.moe
    return dict(num_local_experts=m.n_experts, num_experts_per_tok=m.top_k,
                intermediate_size=m.d_ff, attention_bias=c.qkv_bias,
                layer_types=families.layer_types_to_hf(c), sliding_window=c.sliding_window,
                swiglu_limit=c.swiglu_limit, swiglu_alpha=c.swiglu_alpha,
                router_aux_loss_coef=0.0)


# Every sparse layer's experts: the table's n_experts, top_k, d_ff (no default) and these.
_LAYERS = frozenset({"moe.renormalize", "moe.sparse_step", "moe.dense_layers"})
# ``defaults``: transformers' class defaults, where config.json may omit the key.
MIXTRAL = Family(
    "mixtral", "MixtralForCausalLM", partial(_read, model_type="mixtral"), _mixtral_write,
    fixed={"moe.renormalize": True}, free=frozenset({"sliding_window"}),
    activations=families.ACTIVATIONS, present=frozenset({"num_key_value_heads"}),
    defaults=dict(rms_norm_eps=1e-5, rope_theta=1e6, num_experts=8, num_experts_per_tok=2),
    experts=("block_sparse_moe", "w1", "w3", "w2"))
QWEN2_MOE = Family(
    "qwen2_moe", "Qwen2MoeForCausalLM", partial(_read, model_type="qwen2_moe"),
    partial(_qwen_write, qwen2=True), rope_kinds=ALL_ROPE, activations=families.ACTIVATIONS,
    free=_LAYERS | {"qkv_bias", "sliding_window", "layer_pattern", "moe.shared_d_ff",
                    "moe.shared_gate"},
    required=frozenset({"num_key_value_heads"}),
    defaults=dict(num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408,
                  shared_expert_intermediate_size=5632, norm_topk_prob=False,
                  sliding_window=4096, max_window_layers=28, qkv_bias=True))
QWEN3_MOE = Family(
    "qwen3_moe", "Qwen3MoeForCausalLM", partial(_read, model_type="qwen3_moe"),
    partial(_qwen_write, qwen2=False), fixed=dict(qk_norm="head"),
    free=_LAYERS | {"sliding_window"}, rope_kinds=ALL_ROPE, activations=families.ACTIVATIONS,
    required=frozenset({"num_key_value_heads"}),
    defaults=dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                  norm_topk_prob=False))
GPT_OSS = Family(
    "gpt_oss", "GptOssForCausalLM", _gpt_oss_read, _gpt_oss_write,
    fixed={"attn_sinks": True, "swiglu_up_offset": 1.0, "moe.renormalize": True,
           "moe.router_bias": True, "moe.expert_bias": True},
    free=frozenset({"qkv_bias", "o_bias", "sliding_window", "layer_pattern", "swiglu_limit",
                    "swiglu_alpha"}),
    rope_kinds=ALL_ROPE, activations={"silu": "swiglu"},
    required=frozenset({"num_key_value_heads"}), quant_methods=frozenset({"mxfp4"}),
    defaults=dict(num_local_experts=128, num_experts_per_tok=4, rms_norm_eps=1e-5,
                  attention_bias=True, sliding_window=128, swiglu_limit=7.0,
                  swiglu_alpha=1.702, tie_word_embeddings=False))


def stacked_experts(names: Iterable[str]) -> bool:
    """Whether a checkpoint's tensor ``names`` hold the experts stacked (transformers 5's
    ``experts.gate_up_proj``) rather than one tensor per expert."""
    return any(name.endswith(_STACKED) for name in names)


def ffn_tensors(config: ModelConfig, layer: int, family: Family, stacked: bool = False
                ) -> list[_Tensor]:
    """The HF tensors of sparse layer ``layer``'s FFN: the router, the experts (one tensor per
    expert, or ``stacked``), the shared expert and its gate."""
    c, m = config, config.moe
    d, e, f = c.d_model, m.n_experts, m.d_ff
    block = "mlp" if stacked else family.experts[0]  # transformers 5 stacks them in ``mlp``
    hf, ours = f"model.layers.{layer}.{block}", (f"blocks_{layer}", "moe")
    if m.expert_bias:  # GPT-OSS's layout (the one HF layout with expert biases)
        return _interleaved_experts(f"model.layers.{layer}.mlp", ours, d, e, f)
    out = [_linear(f"{hf}.gate.weight", (*ours, "router"), d, e)]
    if m.correction_bias:  # DeepSeek-V3's, a float32 buffer of transformers' router
        out.append(_same(f"{hf}.gate.e_score_correction_bias", (*ours, "correction_bias"), (e,)))
    if stacked:  # [E, out, in] <-> [E, in, out]
        def batched(name: str, param: str, n_in: int, n_out: int) -> _Tensor:
            shape = (e, n_out, n_in)
            return _Tensor(name, (*ours, param), shape, shape, (1, 1, 1), (0, 2, 1))

        out += _fused([batched("", "gate", d, f), batched("", "up", d, f)],
                      f"{hf}.experts.gate_up_proj", axis=1)
        out.append(batched(f"{hf}.experts.down_proj", "down", f, d))
    else:  # each param's experts in order (``save`` gathers a param once)
        for name, param, n_in, n_out in zip(family.experts[1:], ("gate", "up", "down"), (d, d, f),
                                            (f, f, d), strict=True):
            out += [dataclasses.replace(
                _linear(f"{hf}.experts.{j}.{name}.weight", (*ours, param), n_in, n_out),
                stack=(j, e)) for j in range(e)]
    if m.shared_d_ff:
        shared, s = f"{hf}.{family.shared_expert}", m.shared_d_ff
        out += [_linear(f"{shared}.{p}_proj.weight", (*ours, "shared", p), *dims)
                for p, dims in (("gate", (d, s)), ("up", (d, s)), ("down", (s, d)))]
        if m.shared_gate:
            out.append(_linear(f"{hf}.shared_expert_gate.weight", (*ours, "shared_gate"), d, 1))
    return out


def _interleaved_experts(hf: str, ours: tuple[str, ...], d: int, e: int, f: int
                         ) -> list[_Tensor]:
    """GPT-OSS's sparse layer: router, experts in-first with gate and up alternating."""
    def part(name: str, param: str, shape: tuple[int, ...], index: int) -> _Tensor:
        return dataclasses.replace(_same(name, (*ours, param), shape),
                                   axis=len(shape) - 1, interleave=(index, 2))

    experts = f"{hf}.experts"
    return [_linear(f"{hf}.router.weight", (*ours, "router"), d, e),
            _same(f"{hf}.router.bias", (*ours, "router_bias"), (e,)),
            part(f"{experts}.gate_up_proj", "gate", (e, d, f), 0),
            part(f"{experts}.gate_up_proj", "up", (e, d, f), 1),
            part(f"{experts}.gate_up_proj_bias", "gate_bias", (e, f), 0),
            part(f"{experts}.gate_up_proj_bias", "up_bias", (e, f), 1),
            _same(f"{experts}.down_proj", (*ours, "down"), (e, f, d)),
            _same(f"{experts}.down_proj_bias", (*ours, "down_bias"), (e, d))]


def unused_tensors(config: ModelConfig, model_type: str) -> dict[str, tuple[int, ...]]:
    """Tensors a checkpoint has that change nothing, with their shapes (Qwen2-MoE's shared
    expert of width 0): ``load`` checks and drops them, ``save`` writes zeros."""
    c, m = config, config.moe
    if model_type != "qwen2_moe" or m is None or m.shared_d_ff:
        return {}
    d = c.d_model
    return {f"model.layers.{i}.mlp.{name}": shape for i in c.sparse_layers
            for name, shape in (("shared_expert.gate_proj.weight", (0, d)),
                                ("shared_expert.up_proj.weight", (0, d)),
                                ("shared_expert.down_proj.weight", (d, 0)),
                                ("shared_expert_gate.weight", (1, d)))}


__all__ = ["GPT_OSS", "MIXTRAL", "QWEN2_MOE", "QWEN3_MOE", "ffn_tensors", "stacked_experts",
           "unused_tensors"]
