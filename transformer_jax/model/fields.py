"""The nested tables of an ``Architecture``, the shared value checks, and ``key=value`` parsing."""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from typing import Any

ROPE_SCALINGS = ("linear", "llama3", "yarn")
#: How a mixture's router turns logits into expert scores (``MoE.score``).
MOE_SCORES = ("softmax", "sigmoid")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """How RoPE frequencies are rescaled for context extension.

    Attributes:
      kind: ``"linear"`` (every frequency divided by ``factor``), ``"llama3"`` (the low ones,
        ramped) or ``"yarn"`` (chosen by their rotations, with cos and sin scaled).
      factor: the context extension factor (> 0).
      low_freq_factor, high_freq_factor: llama3: wavelengths above ``original_max_len /
        low_freq_factor`` are fully scaled, below ``original_max_len / high_freq_factor`` kept.
      original_max_len: llama3 and yarn: the context length the model was trained with.
      beta_fast, beta_slow: yarn: rotations over ``original_max_len`` above which a frequency
        is kept, below which it is fully interpolated.
      attention_factor: yarn: the cos/sin multiplier; None: ``ops.rope_attention_factor``'s
        formula of ``factor``, ``mscale`` and ``mscale_all_dim``.
      mscale, mscale_all_dim: yarn: that formula's multipliers of ``ln(factor)``.
      truncate: yarn: round the ramp's ends to whole dimensions.
    """

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_len: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        check_choice("rope_scaling.kind", self.kind, ROPE_SCALINGS)
        if not self.factor > 0:
            raise ValueError(f"rope_scaling.factor must be > 0, got {self.factor}")
        if self.kind == "llama3" and not 0 < self.low_freq_factor <= self.high_freq_factor:
            raise ValueError("rope_scaling needs 0 < low_freq_factor <= high_freq_factor, got "
                             f"{self.low_freq_factor} and {self.high_freq_factor}")
        if self.kind in ("llama3", "yarn") and self.original_max_len <= 0:
            raise ValueError(
                f"rope_scaling.original_max_len must be > 0, got {self.original_max_len}")
        if self.kind == "yarn":
            # Equal betas (Kimi K2's 1 and 1): a ramp of one pair, as transformers takes them.
            if not 0 < self.beta_slow <= self.beta_fast:
                raise ValueError("rope_scaling needs 0 < beta_slow <= beta_fast, got "
                                 f"{self.beta_slow} and {self.beta_fast}")
            if self.attention_factor is not None:
                check_positive_number("rope_scaling.attention_factor", self.attention_factor)


@dataclasses.dataclass(frozen=True)
class MoE:
    """A mixture-of-experts FFN: which layers have one and how tokens are routed.

    A sparse layer's FFN is E gated experts of width ``d_ff`` and a router [D, E]; each token
    goes to its ``top_k`` highest-scored experts, its output their outputs weighted by the
    scores. An optional shared expert (width ``shared_d_ff``) sees every token. Other layers
    keep the dense FFN of width ``Architecture.d_ff``.

    Attributes:
      n_experts, top_k, d_ff: E experts per sparse layer, k per token, each of hidden width F.
      renormalize: divide the k chosen probabilities by their sum (Mixtral; not Qwen2-MoE).
      shared_d_ff, shared_gate: the shared expert's width (0: none); gate its output by
        ``sigmoid(x . w_gate)`` (Qwen2-MoE).
      sparse_step: layer i is sparse when ``(i + 1) % sparse_step == 0`` ...
      dense_layers: ... and i is not listed here (HF's ``mlp_only_layers``).
      router_bias, expert_bias: the router's logits, each expert's projections have biases.
      score: the experts' scores from the router logits: ``"softmax"`` or ``"sigmoid"``.
      correction_bias: a bias [E] added to the scores for choosing the experts only, trained
        by ``train.moe_bias_update_rate``'s update, not by gradients (DeepSeek-V3).
      n_groups, top_groups: each token chooses within its ``top_groups`` best of ``n_groups``
        groups of experts, a group scored by its two highest scores (DeepSeek-V3).
      routed_scale: multiplies the routed experts' weights after any renormalisation.
      scale_input: the chosen expert's weight scales the token going into it, not the
        expert's output (Llama 4); needs ``top_k`` 1.
    """

    n_experts: int
    top_k: int
    d_ff: int
    renormalize: bool = True
    shared_d_ff: int = 0
    shared_gate: bool = False
    sparse_step: int = 1
    dense_layers: tuple[int, ...] = ()
    router_bias: bool = False
    expert_bias: bool = False
    score: str = "softmax"
    correction_bias: bool = False
    n_groups: int = 1
    top_groups: int = 1
    routed_scale: float = 1.0
    scale_input: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.dense_layers, list):
            object.__setattr__(self, "dense_layers", tuple(self.dense_layers))
        for name in ("n_experts", "top_k", "d_ff", "sparse_step", "n_groups", "top_groups"):
            check_positive_int(f"moe.{name}", getattr(self, name))
        if self.top_k > self.n_experts:
            raise ValueError(f"moe.top_k ({self.top_k}) must be at most moe.n_experts "
                             f"({self.n_experts})")
        check_nonnegative_int("moe.shared_d_ff", self.shared_d_ff)
        for name in ("renormalize", "shared_gate", "router_bias", "expert_bias",
                     "correction_bias", "scale_input"):
            check_bool(f"moe.{name}", getattr(self, name))
        check_choice("moe.score", self.score, MOE_SCORES)
        check_positive_number("moe.routed_scale", self.routed_scale)
        n, top, e = self.n_groups, self.top_groups, self.n_experts
        if top > n:
            raise ValueError(f"moe.top_groups ({top}) must be at most moe.n_groups ({n})")
        if n > 1 and (e % n or e // n < 2):
            raise ValueError(f"moe.n_groups={n} must split moe.n_experts={e} into equal groups "
                             "of at least 2 experts (a group is scored by its top two)")
        if top * (e // n) < self.top_k:
            raise ValueError(f"moe.top_k={self.top_k} is more than the {top * (e // n)} experts "
                             f"of moe.top_groups={top} groups")
        if self.scale_input and self.top_k != 1:
            raise ValueError(f"moe.scale_input needs moe.top_k 1 (one expert per token), got "
                             f"{self.top_k}")
        if self.shared_gate and not self.shared_d_ff:
            raise ValueError("moe.shared_gate needs a shared expert (moe.shared_d_ff > 0)")
        if not isinstance(self.dense_layers, tuple) or any(
                isinstance(i, bool) or not isinstance(i, int) or i < 0
                for i in self.dense_layers):
            raise ValueError(f"moe.dense_layers must be a list of layer indices >= 0, got "
                             f"{self.dense_layers!r}")

    def is_sparse(self, layer: int) -> bool:
        """Whether layer ``layer``'s FFN is the mixture (else the dense FFN)."""
        return (layer + 1) % self.sparse_step == 0 and layer not in self.dense_layers


@dataclasses.dataclass(frozen=True)
class MLA:
    """Multi-head latent attention: keys and values from a small per-token latent.

    The query is ``q_b(norm(q_a(x)))`` [N, nope + rope] (``q_proj(x)`` without ``q_lora_rank``);
    ``kv_a_proj(x)`` gives a normed latent c and one rope key shared by the heads, ``kv_b_proj(c)``
    each head's position-free key part and value. A cache holds c and the rotated rope key. The
    softmax scale is ``attn_scale`` when set, else ``scale(rope_scaling)``.

    Attributes:
      kv_lora_rank: the latent's width.
      qk_nope_head_dim, qk_rope_head_dim: a head's query/key width without position, and rotated.
      v_head_dim: each head's value width.
      q_lora_rank: the query's low-rank width; None: one ``q_proj``.
      norm_eps: the epsilon of the latents' RMSNorms.
    """

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            check_positive_int(f"mla.{name}", getattr(self, name))
        if self.q_lora_rank is not None:
            check_positive_int("mla.q_lora_rank", self.q_lora_rank)
        check_positive_number("mla.norm_eps", self.norm_eps)
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"mla.qk_rope_head_dim must be even for RoPE, got "
                             f"{self.qk_rope_head_dim}")

    @property
    def qk_head_dim(self) -> int:
        """A head's query/key width, nope + rope."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def entry_dim(self) -> int:
        """What a cache holds per token per layer: the latent and the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def scale(self, rope_scaling: RopeScaling | None) -> float:
        """The softmax scale without ``attn_scale``: ``qk_head_dim ** -0.5``, times ``m^2`` with
        ``m = 0.1 mscale_all_dim ln(factor) + 1`` when the scaling has a ``mscale_all_dim``
        and factor > 1 (YaRN's scale of the whole logit)."""
        scale = self.qk_head_dim ** -0.5
        s = rope_scaling
        if s is not None and s.mscale_all_dim and s.factor > 1:
            m = 0.1 * s.mscale_all_dim * math.log(s.factor) + 1.0
            scale *= m * m
        return scale


def plain(value: Any) -> Any:
    """``value`` with NumPy scalars as Python numbers, for error messages."""
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "shape", None) == ():
        return item()
    return value


def check_positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {plain(value)!r}")


def check_positive_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a positive finite number, got {plain(value)!r}")


def check_nonnegative_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {plain(value)!r}")


def check_finite_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {plain(value)!r}")


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {plain(value)!r}")


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {plain(value)!r}")


def check_keys(values: dict[str, Any], cls: type, section: str) -> None:
    """Raises ValueError for keys that are not fields of dataclass ``cls``, naming close ones."""
    fields = [f.name for f in dataclasses.fields(cls)]
    for key in values:
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=3)
            hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise ValueError(f"unknown {section} option {key!r}{hint}")


def parse_override(cls: type, key: str, text: str) -> Any:
    """Parses the string ``text`` as the type of dataclass field ``key`` of ``cls``.

    Used for ``key=value`` command-line overrides, so a wrong type is an error at start-up."""
    check_keys({key: None}, cls, cls.__name__)
    hints = typing.get_type_hints(cls)
    return _parse_as(hints[key], text, key)


def _parse_as(tp: Any, text: str, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if text.lower() in ("none", "null") and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _parse_as(arg, text, key)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(f"{key}={text!r}: " + "; ".join(errors))
    if origin in (tuple, list):
        (item,) = set(typing.get_args(tp)) - {Ellipsis} or {str}
        parts = [p for p in text.split(",") if p.strip()]
        return origin(_parse_as(item, p.strip(), key) for p in parts)
    if tp is bool:
        if text.lower() in ("true", "1", "yes"):
            return True
        if text.lower() in ("false", "0", "no"):
            return False
        raise ValueError(f"{key} expects a bool (true/false), got {text!r}")
    if tp in (int, float):
        try:
            return tp(text)
        except ValueError:
            article = "an" if tp is int else "a"
            raise ValueError(f"{key} expects {article} {tp.__name__}, got {text!r}") from None
    if tp is str:
        return text
    if dataclasses.is_dataclass(tp):
        raise ValueError(f"{key} is a table; set its fields in the config file")
    raise ValueError(f"{key}: cannot parse type {tp}")
