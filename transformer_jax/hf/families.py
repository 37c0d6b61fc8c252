"""``Family``, the declaration of one HF model type; the dense families Qwen3, Gemma 2, Gemma 3
(text), Phi-3 and OLMo 2; the RoPE and layer-type keys every family shares.

Pure functions, no file I/O. A field of ``Architecture`` that a family does not declare must
keep its default there, so a new field is refused by every family until one declares it.
Import returns canonical forms, so load, save and load again gives the same config: uniform
layers have an empty ``layer_pattern`` (and no window when every layer is global), else the
shortest period of ``layer_types``; ``local_rope_base`` is None when the local layers rotate
as the global ones; Gemma's ``attn_scale`` is always set.
"""

from __future__ import annotations

import dataclasses
from collections import ChainMap
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from typing import Any

from transformer_jax.model.config import Architecture, ModelConfig, RopeScaling

#: The ``Architecture`` fields every family maps, through the keys ``convert`` reads and
#: writes for all of them (``ffn`` and ``rope_scaling`` within a family's ``activations`` and
#: ``rope_kinds``). Every other field is a family's only where it declares it.
COMMON = frozenset({"vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                    "d_ff", "max_seq_len", "norm_eps", "ffn", "rope_base", "rope_scaling",
                    "tie_embeddings"})
#: HF activation -> our gated FFN, exact matches only (``"gelu"`` is the erf GELU; the Llama
#: layouts refuse the tanh approximation, the later families have it).
LLAMA_ACTIVATIONS = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu"}
ACTIVATIONS = {**LLAMA_ACTIVATIONS, "gelu_pytorch_tanh": "geglu_tanh"}
ALL_ROPE = ("default", "linear", "llama3", "yarn")
_LAYER_TYPES = {"sliding_attention": "local", "full_attention": "global"}
_KIND_TO_TYPE = {v: k for k, v in _LAYER_TYPES.items()}


@dataclasses.dataclass(frozen=True)
class Family:
    """One HF model type, declared once: import reads ``config.json`` by it, export writes a
    config as the first family it matches (``mismatches`` empty).

    Attributes:
      model_type: the HF ``model_type``.
      hf_class: its ``architectures`` entry.
      read: (``config.json`` over ``defaults`` as a ``ChainMap``, L, max_seq_len) -> the
        ``free`` fields (and RoPE, if it reads its own); ValueError for a setting it refuses.
      write: config -> the family's own ``config.json`` keys; ValueError for what else it refuses.
      fixed: fields with one value (import sets it, export requires it); ``"moe.x"``: MoE's x.
      free: fields with any value ``write`` accepts; a ``"moe.x"`` field means it has the table.
      activations: HF activation name -> ``ffn``.
      act_key: the ``config.json`` key of the activation.
      rope_kinds: the ``rope_scaling`` kinds it has (``"default"``: none).
      defaults: transformers' class defaults of keys ``config.json`` may omit.
      required: keys whose class default is a preset's value: they must be set (not null).
      present: keys that must be there, null allowed, for the same reason.
      fused: Phi-3's tensors: q/k/v in one ``qkv_proj``, gate/up in one ``gate_up_proj``.
      experts: a sparse layer's module and its experts' gate, up and down tensor names.
      picked: whether export picks it by matching; False: only when asked for by name.
      quant_methods: the ``quantization_config`` methods its checkpoints may have.
      ffn_module: the HF module of each layer's FFN (a dense layer's ``{gate,up,down}_proj``).
      sparse_tensors: (config, layer) -> a sparse layer's FFN tensors; None: ``hf.moe``'s.
      shared_expert: the HF module of a sparse layer's shared expert (``hf.moe.ffn_tensors``).
      optional: tables (``"moe"``) the family declares that a config may also lack (None).
    """

    model_type: str
    hf_class: str
    read: Callable[[ChainMap[str, Any], int, int], dict[str, Any]]
    write: Callable[[ModelConfig], dict[str, Any]]
    fixed: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    free: frozenset[str] = frozenset()
    activations: Mapping[str, str] = dataclasses.field(default_factory=lambda: LLAMA_ACTIVATIONS)
    act_key: str = "hidden_act"
    rope_kinds: tuple[str, ...] = ("default", "linear", "llama3")
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    required: frozenset[str] = frozenset()
    present: frozenset[str] = frozenset()
    fused: bool = False
    experts: tuple[str, str, str, str] = ("mlp", "gate_proj", "up_proj", "down_proj")
    picked: bool = True
    quant_methods: frozenset[str] = frozenset({"fp8"})
    ffn_module: str = "mlp"
    sparse_tensors: Callable[[ModelConfig, int], list[Any]] | None = None
    shared_expert: str = "shared_expert"
    optional: frozenset[str] = frozenset()

    def mismatches(self, config: Architecture) -> list[str]:
        """What this family lacks to hold ``config``, one phrase per field, each to follow
        "HF {model_type} checkpoints" (empty: it holds it)."""
        out = []
        if config.ffn not in self.activations.values():
            out.append(f"need a gated ffn {sorted(set(self.activations.values()))}, got "
                       f"ffn={config.ffn!r}")
        kind = "default" if config.rope_scaling is None else config.rope_scaling.kind
        if kind not in self.rope_kinds:
            out.append(f"cannot have rope_scaling of kind {kind!r} (only "
                       f"{', '.join(self.rope_kinds)})")
        return out + list(self._fields(config, Architecture, ""))

    def _fields(self, table: Any, cls: type, prefix: str) -> Iterator[str]:
        declared = {*self.fixed, *self.free}
        for f in dataclasses.fields(cls):
            name, value = prefix + f.name, getattr(table, f.name)
            if name in COMMON or name in self.free or f.default is dataclasses.MISSING:
                continue  # mapped (a table's fields without a default always are)
            if name in self.fixed:
                if value != self.fixed[name]:
                    yield f"need {name}={self.fixed[name]!r}, got {name}={value!r}"
            elif any(d.startswith(f"{name}.") for d in declared):  # the family has the table
                if value is not None:
                    yield from self._fields(value, type(value), f"{name}.")
                elif name not in self.optional:
                    yield f"need {name}, got {name}=None"
            elif value != f.default:
                yield f"have no {name}: it must be {f.default!r}, got {name}={value!r}"


def required(hf: Mapping[str, Any], key: str) -> Any:
    """``hf[key]``, or a ValueError when it is missing or null."""
    if hf.get(key) is None:
        raise ValueError(f"config.json lacks required key {key!r} (or it is null)")
    return hf[key]


def int_at_least(value: Any, name: str, low: int) -> int:
    """``value`` if it is an int >= ``low`` (not a bool), else a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


def rope_from_dict(rope: dict[str, Any], hf: Mapping[str, Any], max_seq_len: int,
                   kinds: Sequence[str], *, top_original: bool = True,
                   where: str = "rope_scaling") -> tuple[float, RopeScaling | None]:
    """(rope_base, rope_scaling) of one flat RoPE dict (``rope_parameters`` or legacy
    ``rope_scaling``), as transformers reads it.

    Args:
      rope: the dict (``rope_type`` or legacy ``type``, ``rope_theta``, the scaling's keys).
      hf: the whole ``config.json`` over the family's defaults (its top-level keys, and with
        ``top_original`` its ``original_max_position_embeddings``, preferred to the dict's).
      max_seq_len: ``max_position_embeddings``, the default original length.
      kinds: the RoPE types this family accepts.
      where: the setting named in errors.
    """
    base = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
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
    optional = {name: getattr(s, name) for name in ("attention_factor", "mscale", "mscale_all_dim")}
    return {"rope_type": "yarn", "factor": s.factor,
            "original_max_position_embeddings": s.original_max_len, "beta_fast": s.beta_fast,
            "beta_slow": s.beta_slow, "truncate": s.truncate,
            **{name: value for name, value in optional.items() if value is not None}}


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
    return int(window), layer_period(kinds)


def layer_period(kinds: list[str]) -> tuple[str, ...]:
    """The shortest period of L layer kinds; empty when they are all alike."""
    if len(set(kinds)) <= 1:
        return ()
    p = next(p for p in range(1, len(kinds) + 1)
             if all(k == kinds[i % p] for i, k in enumerate(kinds)))
    return tuple(kinds[:p])


def layer_types_to_hf(config: ModelConfig) -> list[str]:
    """The config's L layer kinds as HF ``layer_types``."""
    return [_KIND_TO_TYPE[k] for k in config.layer_kinds()]


def read_rope(hf: Mapping[str, Any], max_seq_len: int, kinds: Sequence[str]
              ) -> tuple[float, RopeScaling | None]:
    """(rope_base, rope_scaling) from legacy ``rope_theta``/``rope_scaling`` or
    ``rope_parameters``, the legacy dict winning as in transformers."""
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
    return rope_from_dict(rope, hf, max_seq_len, kinds)


def _qwen3_read(hf: ChainMap[str, Any], n_layers: int, max_seq_len: int) -> dict[str, Any]:
    window, pattern = window_and_pattern(_qwen_kinds(hf, n_layers), hf.get("sliding_window"))
    return dict(sliding_window=window, layer_pattern=pattern)


def _qwen_kinds(hf: Mapping[str, Any], n_layers: int) -> list[str]:
    """Qwen3's layer kinds: all global without ``use_sliding_window``, else ``layer_types`` or
    layers i >= ``max_window_layers`` local."""
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


def _qwen3_write(c: ModelConfig) -> dict[str, Any]:
    local = [k == "local" for k in c.layer_kinds()]
    return dict(use_sliding_window=any(local), sliding_window=c.sliding_window,
                max_window_layers=local.index(True) if any(local) else c.n_layers,
                layer_types=layer_types_to_hf(c))


def _gemma_read(hf: ChainMap[str, Any], n_layers: int, max_seq_len: int, *, gemma3: bool
                ) -> dict[str, Any]:
    layer_types = hf.get("layer_types")
    if layer_types is None:  # transformers: every `pattern`-th layer is global
        pattern = hf.get("sliding_window_pattern", 6) if gemma3 else 2
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                       for i in range(n_layers)]
    kinds = layer_kinds_from_hf(layer_types, n_layers)
    window, layer_pattern = window_and_pattern(kinds, hf["sliding_window"])
    attn_cap, final_cap = hf["attn_logit_softcapping"], hf["final_logit_softcapping"]
    fields = dict(attn_scale=float(hf["query_pre_attn_scalar"]) ** -0.5, sliding_window=window,
                  layer_pattern=layer_pattern,
                  final_softcap=None if final_cap is None else float(final_cap))
    if not gemma3:
        return {**fields, "attn_softcap": None if attn_cap is None else float(attn_cap)}
    if attn_cap is not None:
        raise ValueError(f"attn_logit_softcapping={attn_cap} is not supported for gemma3_text "
                         "(transformers' Gemma 3 attention ignores it)")
    base, scaling, local = _gemma3_rope(hf, max_seq_len)
    return {**fields, "rope_base": base, "rope_scaling": scaling,
            "local_rope_base": local if "local" in kinds else None}


def _gemma3_rope(hf: Mapping[str, Any], max_seq_len: int
                 ) -> tuple[float, RopeScaling | None, float | None]:
    """(rope_base, rope_scaling, local_rope_base) of Gemma 3, as transformers fills them in
    (global base 1e6, local 1e4 by default)."""
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


def _gemma_write(c: ModelConfig, model_type: str) -> dict[str, Any]:
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
        full = rope_keys(c.rope_base, c.rope_scaling)["rope_parameters"]
        local = full if c.local_rope_base is None else {
            "rope_type": "default", "rope_theta": c.local_rope_base}
        out.update(rope_parameters={"full_attention": full, "sliding_attention": dict(local)},
                   rope_local_base_freq=local["rope_theta"])
    return out


_GEMMA = dict(fixed=dict(norm_position="sandwich", norm_offset=1.0, scale_embeddings=True),
              activations=ACTIVATIONS, act_key="hidden_activation",
              defaults=dict(hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True),
              required=frozenset({"num_key_value_heads", "head_dim", "query_pre_attn_scalar"}),
              present=frozenset({"sliding_window", "attn_logit_softcapping",
                                 "final_logit_softcapping"}))
QWEN3 = Family("qwen3", "Qwen3ForCausalLM", _qwen3_read, _qwen3_write,
               fixed=dict(qk_norm="head"), free=frozenset({"sliding_window", "layer_pattern"}),
               activations=ACTIVATIONS, rope_kinds=ALL_ROPE,
               required=frozenset({"num_key_value_heads", "head_dim"}))
GEMMA2 = Family("gemma2", "Gemma2ForCausalLM", partial(_gemma_read, gemma3=False),
                partial(_gemma_write, model_type="gemma2"), **_GEMMA,
                free=frozenset({"attn_softcap", "final_softcap", "attn_scale", "sliding_window",
                                "layer_pattern"}), rope_kinds=ALL_ROPE)
GEMMA3_TEXT = Family(
    "gemma3_text", "Gemma3ForCausalLM", partial(_gemma_read, gemma3=True),
    partial(_gemma_write, model_type="gemma3_text"),
    **{**_GEMMA, "fixed": {**_GEMMA["fixed"], "qk_norm": "head"}},
    free=frozenset({"final_softcap", "attn_scale", "sliding_window", "layer_pattern",
                    "local_rope_base"}), rope_kinds=("default", "linear"))
# Phi-3's LongRoPE (rope_type "longrope", read from "su" and "yarn" too) is refused.
PHI3 = Family("phi3", "Phi3ForCausalLM",
              lambda hf, n_layers, max_seq_len: dict(sliding_window=hf.get("sliding_window")),
              lambda c: dict(sliding_window=c.sliding_window), free=frozenset({"sliding_window"}),
              activations=ACTIVATIONS, rope_kinds=("default",), defaults=dict(rms_norm_eps=1e-5),
              fused=True, picked=False)
OLMO2 = Family("olmo2", "Olmo2ForCausalLM", lambda hf, n_layers, max_seq_len: {},
               lambda c: {}, fixed=dict(norm_position="post_branch", qk_norm="full"),
               activations=ACTIVATIONS, rope_kinds=ALL_ROPE, defaults=dict(rms_norm_eps=1e-5))


__all__ = ["COMMON", "GEMMA2", "GEMMA3_TEXT", "OLMO2", "PHI3", "QWEN3", "Family", "read_rope",
           "rope_from_dict", "rope_keys", "window_and_pattern"]
