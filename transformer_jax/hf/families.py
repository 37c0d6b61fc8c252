"""HF ``config.json`` <-> ``ModelConfig`` for Qwen3, Gemma 2, Gemma 3 (text), Phi-3 and OLMo 2,
and the RoPE and layer-type entries every family shares.

Pure functions, no file I/O; ``transformer_jax.hf.convert`` dispatches here by ``model_type``
(and maps the tensors). Each family is a set of ``Architecture`` fields:

- ``qwen3``: the Llama block with per-head QK-norm (``qk_norm="head"``), mixed sliding/full
  layers from ``layer_types`` (or ``use_sliding_window`` and ``max_window_layers``).
- ``gemma2``: ``norm_position="sandwich"``, gains stored as w of ``(1 + w)``
  (``norm_offset=1``), embeddings times sqrt(D), ``attn_scale = query_pre_attn_scalar^-0.5``,
  soft-capped attention and final logits, local/global ``layer_types``.
- ``gemma3_text``: Gemma 2 with ``(1 + w)`` per-head QK-norm, no attention soft-cap, and the
  local layers' own RoPE (``rope_parameters["sliding_attention"]`` -> ``local_rope_base``).
- ``phi3``: the Llama block (its checkpoint fuses q/k/v and gate/up, ``convert._tensors``),
  ``sliding_window`` on every layer; LongRoPE is refused.
- ``olmo2``: ``norm_position="post_branch"`` and QK-norm over whole projections
  (``qk_norm="full"``).

Every ``config.json`` setting these classes use that has no exact equivalent is refused with a
ValueError naming it. Canonical forms (what ``config_from_hf`` returns, so a load, save and load
again gives the same config): uniform layers have an empty ``layer_pattern`` (no window when
every layer is global), otherwise the shortest period of ``layer_types``; ``local_rope_base``
is None when the local layers rotate as the global ones; Gemma's ``attn_scale`` is always set.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformer_jax.model.config import ModelConfig, RopeScaling

ARCHITECTURES = {
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
}
GEMMAS = ("gemma2", "gemma3_text")
#: HF activation -> our gated FFN, for the families here (the tanh GELU is exact here).
ACTIVATIONS = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu",
               "gelu_pytorch_tanh": "geglu_tanh"}
FFN_TO_ACTIVATION = {"swiglu": "silu", "geglu": "gelu", "geglu_tanh": "gelu_pytorch_tanh"}
ALL_ROPE = ("default", "linear", "llama3", "yarn")
_LAYER_TYPES = {"sliding_attention": "local", "full_attention": "global"}
_KIND_TO_TYPE = {v: k for k, v in _LAYER_TYPES.items()}
# transformers' defaults (class attributes) where config.json may omit the key.
_EPS = {"qwen3": 1e-6, "gemma2": 1e-6, "gemma3_text": 1e-6, "phi3": 1e-5, "olmo2": 1e-5}


# ------------------------------------------------------------------------------------------------
# RoPE and layer types (shared with the Llama layouts)


def rope_from_dict(rope: dict[str, Any], hf: dict[str, Any], max_seq_len: int,
                   kinds: Sequence[str], *, default_theta: float = 10000.0,
                   top_original: bool = True, where: str = "rope_scaling"
                   ) -> tuple[float, RopeScaling | None]:
    """(rope_base, rope_scaling) of one flat RoPE dict (``rope_parameters`` or legacy
    ``rope_scaling``), as transformers reads it.

    Args:
      rope: the dict (``rope_type`` or legacy ``type``, ``rope_theta``, the scaling's keys).
      hf: the whole ``config.json`` (top-level ``rope_theta``, ``partial_rotary_factor`` and,
        with ``top_original``, ``original_max_position_embeddings``, which transformers
        prefers to the dict's for llama3 and yarn).
      max_seq_len: ``max_position_embeddings``, the default original length.
      kinds: the RoPE types this family accepts.
      default_theta: the base when neither the dict nor ``hf`` has ``rope_theta``.
      where: the setting named in errors.
    """
    base = float(rope.get("rope_theta", hf.get("rope_theta", default_theta)))
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial is not None and float(partial) != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} is not supported (only full RoPE)")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in kinds:
        raise ValueError(f"unsupported {where} type {kind!r}; supported: {', '.join(kinds)}")
    if kind == "default":
        return base, None

    def key(name: str) -> Any:
        if rope.get(name) is None:
            raise ValueError(f"{where} of type {kind!r} lacks {name!r}")
        return rope[name]

    if kind == "linear":
        return base, RopeScaling(kind="linear", factor=float(key("factor")))
    top = hf.get("original_max_position_embeddings") if top_original else None
    original = int(top or rope.get("original_max_position_embeddings") or max_seq_len)
    if kind == "llama3":
        return base, RopeScaling(
            kind="llama3", factor=float(key("factor")),
            low_freq_factor=float(key("low_freq_factor")),
            high_freq_factor=float(key("high_freq_factor")), original_max_len=original)
    factor = rope.get("factor")  # transformers: None means max_position_embeddings / original
    optional = {name: None if rope.get(name) is None else float(rope[name])
                for name in ("attention_factor", "mscale", "mscale_all_dim")}
    return base, RopeScaling(
        kind="yarn", factor=float(max_seq_len / original if factor is None else factor),
        original_max_len=original, beta_fast=float(rope.get("beta_fast") or 32.0),
        beta_slow=float(rope.get("beta_slow") or 1.0), truncate=bool(rope.get("truncate", True)),
        **optional)


def rope_to_dict(scaling: RopeScaling | None) -> dict[str, Any] | None:
    """The HF RoPE dict (without ``rope_theta``) of a scaling; None for none."""
    if scaling is None:
        return None
    s = scaling
    if s.kind == "linear":
        return {"rope_type": "linear", "factor": s.factor}
    if s.kind == "llama3":
        return {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_len}
    out = {"rope_type": "yarn", "factor": s.factor,
           "original_max_position_embeddings": s.original_max_len, "beta_fast": s.beta_fast,
           "beta_slow": s.beta_slow, "truncate": s.truncate}
    for name in ("attention_factor", "mscale", "mscale_all_dim"):
        if getattr(s, name) is not None:
            out[name] = getattr(s, name)
    return out


def rope_keys(base: float, scaling: RopeScaling | None) -> dict[str, Any]:
    """Legacy ``rope_theta``/``rope_scaling`` (transformers 4.x) and ``rope_parameters`` (5.x)."""
    dict_ = rope_to_dict(scaling)
    return {"rope_theta": base, "rope_scaling": dict_,
            "rope_parameters": {**(dict_ or {"rope_type": "default"}), "rope_theta": base}}


def layer_kinds_from_hf(layer_types: Any, n_layers: int) -> list[str]:
    """``layer_types`` (``sliding_attention``/``full_attention``) -> L kinds local/global."""
    if not isinstance(layer_types, list) or len(layer_types) != n_layers:
        raise ValueError(f"layer_types must list one entry per layer ({n_layers}), got "
                         f"{layer_types!r}")
    unknown = sorted({str(t) for t in layer_types if t not in _LAYER_TYPES})
    if unknown:
        raise ValueError(f"unsupported layer_types entries {unknown}; supported: "
                         f"{sorted(_LAYER_TYPES)}")
    return [_LAYER_TYPES[t] for t in layer_types]


def window_and_pattern(kinds: list[str], window: Any) -> tuple[int | None, tuple[str, ...]]:
    """(sliding_window, layer_pattern) of L layer kinds in the canonical form: no window when
    no layer is local, an empty pattern for uniform layers, else the shortest period."""
    if "local" not in kinds:
        return None, ()
    if window is None:
        raise ValueError("layer_types has sliding_attention layers but sliding_window is null")
    if set(kinds) == {"local"}:
        return int(window), ()
    period = next(p for p in range(1, len(kinds) + 1)
                  if all(k == kinds[i % p] for i, k in enumerate(kinds)))
    return int(window), tuple(kinds[:period])


def layer_types_to_hf(config: ModelConfig) -> list[str]:
    """The config's L layer kinds as HF ``layer_types``."""
    return [_KIND_TO_TYPE[k] for k in config.layer_kinds()]


# ------------------------------------------------------------------------------------------------
# config.json -> ModelConfig


def config_from_hf(hf: dict[str, Any], model_type: str) -> ModelConfig:
    """Maps the ``config.json`` of one of ``ARCHITECTURES`` to a ``ModelConfig`` (float32; the
    generic checks, ``model_type``/``architectures``/``quantization_config``, are the caller's).

    Raises:
      ValueError: naming the setting that has no exact equivalent.
    """

    def required(key: str) -> Any:
        if hf.get(key) is None:
            raise ValueError(f"config.json lacks required key {key!r} (or it is null)")
        return hf[key]

    def present(key: str) -> Any:  # may be null, but transformers' default is a preset's
        if key not in hf:
            raise ValueError(f"{model_type} config.json lacks {key!r} (null for none)")
        return hf[key]

    gemma = model_type in GEMMAS
    act_key = "hidden_activation" if gemma else "hidden_act"
    act = hf.get(act_key, "gelu_pytorch_tanh" if gemma else "silu")
    if act not in ACTIVATIONS:
        raise ValueError(f"unsupported {act_key} {act!r}; supported: {sorted(ACTIVATIONS)}")
    if model_type != "phi3" and hf.get("attention_bias", False):
        raise ValueError(f"attention_bias=True is not supported for {model_type} (it also "
                         "biases o_proj, which the model lacks)")
    if hf.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=True is not supported (causal only)")

    n_layers = required("num_hidden_layers")
    n_heads = required("num_attention_heads")
    max_seq_len = required("max_position_embeddings")
    # Qwen3's and Gemma's classes default these to a preset's values.
    n_kv_heads = (required("num_key_value_heads") if model_type in ("qwen3", *GEMMAS)
                  else hf.get("num_key_value_heads") or n_heads)
    head_dim = required("head_dim") if model_type in ("qwen3", *GEMMAS) else hf.get("head_dim")
    fields: dict[str, Any] = {}
    if model_type == "qwen3":
        fields.update(qk_norm="head")
        kinds = _qwen_kinds(hf, n_layers)
        window = hf.get("sliding_window")
    elif model_type == "phi3":
        window = hf.get("sliding_window")
        kinds = ["local" if window is not None else "global"] * n_layers
    elif model_type == "olmo2":
        fields.update(norm_position="post_branch", qk_norm="full")
        kinds, window = ["global"] * n_layers, None
    else:
        fields.update(norm_position="sandwich", norm_offset=1.0, scale_embeddings=True,
                      attn_scale=float(required("query_pre_attn_scalar")) ** -0.5)
        window = present("sliding_window")
        layer_types = hf.get("layer_types")
        if layer_types is None:  # transformers: every `pattern`-th layer is global
            pattern = 2 if model_type == "gemma2" else hf.get("sliding_window_pattern", 6)
            layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                           for i in range(n_layers)]
        kinds = layer_kinds_from_hf(layer_types, n_layers)
        attn_cap, final_cap = present("attn_logit_softcapping"), present(
            "final_logit_softcapping")
        if model_type == "gemma3_text" and attn_cap is not None:
            raise ValueError(f"attn_logit_softcapping={attn_cap} is not supported for "
                             "gemma3_text (transformers' Gemma 3 attention ignores it)")
        fields.update(attn_softcap=None if attn_cap is None else float(attn_cap),
                      final_softcap=None if final_cap is None else float(final_cap))
        if model_type == "gemma3_text":
            fields.update(qk_norm="head")
    sliding_window, layer_pattern = window_and_pattern(kinds, window)

    if model_type == "gemma3_text":
        rope_base, rope_scaling, local = _gemma3_rope(hf, max_seq_len)
        fields.update(local_rope_base=local if "local" in kinds else None)
    elif model_type == "phi3":
        rope_base, rope_scaling = _phi3_rope(hf, max_seq_len)
    else:
        rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
        if not isinstance(rope, dict):
            raise ValueError(f"rope_scaling/rope_parameters must be a dict, got {rope!r}")
        rope_base, rope_scaling = rope_from_dict(rope, hf, max_seq_len, ALL_ROPE)
    return ModelConfig(
        vocab_size=required("vocab_size"), d_model=required("hidden_size"), n_layers=n_layers,
        n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
        d_ff=required("intermediate_size"), max_seq_len=max_seq_len, norm="rms",
        norm_eps=float(hf.get("rms_norm_eps", _EPS[model_type])), ffn=ACTIVATIONS[act],
        position="rope", rope_base=rope_base, rope_pairing="half", rope_scaling=rope_scaling,
        sliding_window=sliding_window, layer_pattern=layer_pattern, qkv_bias=False,
        tie_embeddings=bool(hf.get("tie_word_embeddings", gemma)), **fields)


def _qwen_kinds(hf: dict[str, Any], n_layers: int) -> list[str]:
    """Qwen3's layer kinds: all global without ``use_sliding_window`` (transformers then drops
    the window), else ``layer_types`` or layers i >= ``max_window_layers`` local."""
    layer_types = hf.get("layer_types")
    if not hf.get("use_sliding_window", False):
        if layer_types is not None:
            layer_kinds_from_hf(layer_types, n_layers)  # still a valid list
        return ["global"] * n_layers
    if hf.get("sliding_window") is None:
        raise ValueError("use_sliding_window=True needs a sliding_window")
    if layer_types is None:
        if "max_window_layers" not in hf:
            raise ValueError("use_sliding_window=True needs max_window_layers or layer_types")
        return ["local" if i >= hf["max_window_layers"] else "global" for i in range(n_layers)]
    return layer_kinds_from_hf(layer_types, n_layers)


def _phi3_rope(hf: dict[str, Any], max_seq_len: int) -> tuple[float, RopeScaling | None]:
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"rope_scaling/rope_parameters must be a dict, got {rope!r}")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in ("longrope", "su", "yarn"):  # transformers reads "su" and "yarn" as LongRoPE
        raise ValueError(f"Phi-3 rope_scaling of type {kind!r} (LongRoPE, rope_type "
                         "'longrope') is not supported")
    return rope_from_dict(rope, hf, max_seq_len, ("default",))


def _gemma3_rope(hf: dict[str, Any], max_seq_len: int
                 ) -> tuple[float, RopeScaling | None, float | None]:
    """(rope_base, rope_scaling, local_rope_base) from Gemma 3's per-layer-type
    ``rope_parameters`` or the legacy ``rope_theta``/``rope_scaling``/``rope_local_base_freq``,
    filled in as transformers does (global base 1e6, local 1e4 by default)."""
    nested = hf.get("rope_parameters") or {}
    if not isinstance(nested, dict) or not set(nested) <= set(_LAYER_TYPES):
        raise ValueError("gemma3_text rope_parameters must be nested by layer type "
                         f"({sorted(_LAYER_TYPES)}), got {nested!r}")
    full = dict(nested.get("full_attention") or {})
    if hf.get("rope_scaling"):
        full.update(hf["rope_scaling"])
    full.setdefault("rope_theta", hf.get("rope_theta") or 1e6)
    local = dict(nested.get("sliding_attention") or {})
    local.setdefault("rope_theta", hf.get("rope_local_base_freq") or 1e4)
    kw = dict(kinds=("default", "linear"), top_original=False)
    base, scaling = rope_from_dict(full, hf, max_seq_len, where="rope_parameters.full_attention",
                                   **kw)
    local_base, local_scaling = rope_from_dict(
        local, hf, max_seq_len, where="rope_parameters.sliding_attention", **kw)
    if (local_base, local_scaling) == (base, scaling):
        return base, scaling, None
    if local_scaling is not None:
        raise ValueError("rope_parameters.sliding_attention with a scaling other than the "
                         f"full_attention layers' is not supported: {local!r}")
    return base, scaling, local_base


# ------------------------------------------------------------------------------------------------
# ModelConfig -> config.json


def pick_model_type(config: ModelConfig) -> str | None:
    """The family of these fields, or None for the Llama layouts (``convert`` picks among
    llama/mistral/qwen2); Phi-3 is never picked (the Llama layout, chosen explicitly)."""
    c = config
    if c.norm_position == "pre" and c.qk_norm is None:
        return None
    families = {("pre", "head"): "qwen3", ("sandwich", None): "gemma2",
                ("sandwich", "head"): "gemma3_text", ("post_branch", "full"): "olmo2"}
    if (c.norm_position, c.qk_norm) not in families:
        raise ValueError(f"no HF model type has norm_position={c.norm_position!r} with "
                         f"qk_norm={c.qk_norm!r}")
    return families[c.norm_position, c.qk_norm]


#: Each family's fixed fields (beyond rms/rope/half, checked by ``convert``).
_FIXED = {
    "qwen3": dict(norm_position="pre", qk_norm="head", norm_offset=0.0),
    "phi3": dict(norm_position="pre", qk_norm=None, norm_offset=0.0),
    "olmo2": dict(norm_position="post_branch", qk_norm="full", norm_offset=0.0),
    "gemma2": dict(norm_position="sandwich", qk_norm=None, norm_offset=1.0,
                   scale_embeddings=True),
    "gemma3_text": dict(norm_position="sandwich", qk_norm="head", norm_offset=1.0,
                        scale_embeddings=True, attn_softcap=None),
}
# Fields only some families have; None/False/() elsewhere.
_OPTIONAL = {"scale_embeddings": False, "attn_softcap": None, "final_softcap": None,
             "attn_scale": None, "local_rope_base": None, "qkv_bias": False}
_HAS = {"gemma2": {"attn_softcap", "final_softcap", "attn_scale"},
        "gemma3_text": {"final_softcap", "attn_scale", "local_rope_base"}}


def require_fields(config: ModelConfig, wants: dict[str, Any], activations: dict[str, str],
                   what: str) -> None:
    """Raises ValueError naming the first field of ``wants`` the config does not have, or an
    FFN with no entry in ``activations`` (``what`` names the checkpoint kind)."""
    for name, want in wants.items():
        if getattr(config, name) != want:
            raise ValueError(f"{what} checkpoints need {name}={want!r}, got "
                             f"{getattr(config, name)!r}")
    if config.ffn not in activations:
        raise ValueError(f"{what} checkpoints need a gated ffn {sorted(activations)}, got "
                         f"{config.ffn!r}")


def config_to_hf(config: ModelConfig, model_type: str) -> dict[str, Any]:
    """The ``config.json`` dict of ``config`` as ``model_type`` (one of ``ARCHITECTURES``).

    Raises:
      ValueError: naming the field that ``model_type`` cannot represent.
    """
    c = config
    require_fields(c, {name: want for name, want in {**_OPTIONAL, **_FIXED[model_type]}.items()
                       if name not in _HAS.get(model_type, ()) or name in _FIXED[model_type]},
                   FFN_TO_ACTIVATION, f"HF {model_type}")
    kinds = set(c.layer_kinds())
    if model_type in ("phi3", "olmo2") and len(kinds) > 1:
        raise ValueError(f"HF {model_type} checkpoints cannot mix local and global layers "
                         f"(layer_pattern={c.layer_pattern})")
    if model_type == "olmo2" and "local" in kinds:
        raise ValueError(f"HF olmo2 checkpoints have no sliding window, got "
                         f"sliding_window={c.sliding_window}")
    scaling_kinds = {"phi3": (), "gemma3_text": ("linear",)}.get(
        model_type, ("linear", "llama3", "yarn"))
    if c.rope_scaling is not None and c.rope_scaling.kind not in scaling_kinds:
        raise ValueError(f"HF {model_type} checkpoints cannot have rope_scaling of kind "
                         f"{c.rope_scaling.kind!r}")
    hf: dict[str, Any] = {
        "architectures": [ARCHITECTURES[model_type]], "model_type": model_type,
        "vocab_size": c.vocab_size, "hidden_size": c.d_model, "intermediate_size": c.d_ff,
        "num_hidden_layers": c.n_layers, "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads, "head_dim": c.head_dim,
        "max_position_embeddings": c.max_seq_len, "rms_norm_eps": c.norm_eps,
        "tie_word_embeddings": c.tie_embeddings, "attention_bias": False,
        "torch_dtype": c.param_dtype, "dtype": c.param_dtype,
        # Unknown without a tokenizer (``hf.save`` sets them from one): the classes' defaults
        # are a preset's ids, out of range for a small vocabulary (Phi-3's pad 32000).
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
        "hidden_activation" if model_type in GEMMAS else "hidden_act":
            FFN_TO_ACTIVATION[c.ffn],
        **rope_keys(c.rope_base, c.rope_scaling),
    }
    if model_type == "qwen3":
        local = [k == "local" for k in c.layer_kinds()]
        hf.update(use_sliding_window=any(local), sliding_window=c.sliding_window,
                  max_window_layers=local.index(True) if any(local) else c.n_layers,
                  layer_types=layer_types_to_hf(c))
    elif model_type == "phi3":
        hf.update(sliding_window=c.sliding_window if "local" in kinds else None)
    elif model_type in GEMMAS:
        hf.update(_gemma_to_hf(c, model_type))
    return hf


def _gemma_to_hf(c: ModelConfig, model_type: str) -> dict[str, Any]:
    if c.d_model % c.n_heads:  # transformers' Gemma configs reject this, head_dim or not
        raise ValueError(f"HF {model_type} needs d_model ({c.d_model}) divisible by n_heads "
                         f"({c.n_heads})")
    scale = c.attn_scale if c.attn_scale is not None else c.head_dim ** -0.5
    scalar = round(scale ** -2)
    if scalar <= 0 or scalar ** -0.5 != scale:
        raise ValueError(f"HF {model_type} checkpoints need attn_scale = q ** -0.5 for an "
                         f"integer query_pre_attn_scalar q, got attn_scale={scale} (q = "
                         f"{scale ** -2})")
    out = {
        "query_pre_attn_scalar": scalar, "layer_types": layer_types_to_hf(c),
        # transformers needs a window even when no layer is local; it is then unused.
        "sliding_window": c.sliding_window or c.max_seq_len,
        "attn_logit_softcapping": c.attn_softcap, "final_logit_softcapping": c.final_softcap,
        "use_bidirectional_attention": False,
    }
    if model_type == "gemma3_text":
        full = {**(rope_to_dict(c.rope_scaling) or {"rope_type": "default"}),
                "rope_theta": c.rope_base}
        local = full if c.local_rope_base is None else {
            "rope_type": "default", "rope_theta": c.local_rope_base}
        out.update(rope_parameters={"full_attention": full, "sliding_attention": dict(local)},
                   rope_local_base_freq=local["rope_theta"])
    return out


__all__ = ["ARCHITECTURES", "config_from_hf", "config_to_hf", "pick_model_type"]
