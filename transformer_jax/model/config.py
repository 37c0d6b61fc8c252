"""Model configuration: ``Architecture`` (the function, what a HF ``config.json`` holds),
``Execution`` (how it is initialised and run) and ``ModelConfig``, both in one flat table, as
presets (``configs/*.toml``), ``model.KEY=`` overrides and checkpoints store it."""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from transformer_jax.model import attention_checks
from transformer_jax.model.fields import (  # noqa: F401 (config.RopeScaling etc. are the API)
    MLA,
    ROPE_SCALINGS,
    MoE,
    RopeScaling,
    check_bool,
    check_choice,
    check_finite_number,
    check_keys,
    check_nonnegative_int,
    check_positive_int,
    check_positive_number,
    parse_override,
    plain,
)
from transformer_jax.model.remat import REMATS
from transformer_jax.model.stack import LayerGroup, LayerSpec, layer_groups

NORMS = ("rms", "layer")
NORM_POSITIONS = ("pre", "post", "sandwich", "post_branch")
QK_NORMS = ("head", "full", "weightless")
FFNS = ("swiglu", "geglu", "geglu_tanh", "gelu", "relu")
POSITIONS = ("rope", "sinusoidal", "none")
ROPE_PAIRINGS = ("half", "adjacent")
#: The kinds of attention layer a ``layer_pattern`` lists.
LAYER_KINDS = ("global", "local", "chunked")  # latent layers: every layer with mla
#: Attention implementations (``ops.attention.attention``'s ``impl``).
ATTENTION_IMPLS = ("auto", "xla", "chunked", "cudnn", "pallas", "mosaic")
#: How a mixture-of-experts layer computes its experts (``ops.moe.experts_ffn``'s ``impl``).
MOE_IMPLS = ("auto", "ragged", "tiled", "gather", "dense", "tokamax", "megablox")
DTYPES = ("float32", "bfloat16", "float16")

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"


@dataclasses.dataclass(frozen=True)
class Architecture:
    """The function a decoder-only Transformer computes: what a HF ``config.json`` holds.

    Two models with equal architectures take the same parameters and compute the same logits;
    everything else is ``Execution``.

    Attributes:
      vocab_size, d_model, n_layers, n_heads: V, D (the residual width), L, N (query heads).
      n_kv_heads, head_dim: K key/value heads (N for MHA, 1 for MQA; default N), H (D // N).
      d_ff, max_seq_len: F, the FFN's hidden width; the largest position the model is used at.
      norm, norm_eps: ``"rms"`` (RMSNorm) or ``"layer"`` (LayerNorm with bias); its epsilon.
      norm_position: one of ``NORM_POSITIONS`` (``"pre"``: LLaMA's; see ``block.Block``).
      ffn: one of ``FFNS``.
      position: ``"rope"`` (on Q and K), ``"sinusoidal"`` (added to the embeddings), ``"none"``.
      rope_base: the RoPE base b in ``theta_i = b^(-2i/H)``.
      rope_pairing: ``"half"`` (HF LLaMA) or ``"adjacent"`` (RoFormer; ``ops.apply_rope``).
      rope_scaling: optional frequency rescaling (``RopeScaling``).
      sliding_window: if set, a query sees only the last that many positions (itself included).
      qkv_bias, o_bias: whether the q/k/v projections (Qwen2), the output one have biases.
      attn_sinks: a learned sink logit per query head joins every softmax's denominator.
      tie_embeddings: whether the LM head is the transposed token embedding.
      qk_norm: RMSNorm of the queries and keys before RoPE: None; ``"head"`` per head with one
        [H] gain (Qwen3, Gemma 3); ``"full"`` over all N*H (K*H) values, gains [N, H] and
        [K, H] (OLMo 2); ``"weightless"`` per head after RoPE, no gain. Not on NoPE layers.
      norm_offset: every norm scales by ``(norm_offset + w)`` (1.0 in Gemma 2/3).
      scale_embeddings: multiply the token embeddings by ``sqrt(D)`` (in the compute dtype).
      attn_softcap, final_softcap: if set, the (scaled) attention logits, the LM head's logits
        become ``tanh(x / c) * c``.
      attn_scale: the attention logits' scale; None for ``1 / sqrt(H)``.
      layer_pattern: the layers' attention kinds (``LAYER_KINDS``), repeated over the depth:
        layer i is ``layer_pattern[i % len(layer_pattern)]``. Empty: every layer is local when
        ``sliding_window`` is set, chunked when ``attention_chunk`` is, global otherwise.
      local_rope_base: if set, local layers rotate with this base and no ``rope_scaling``.
      moe: if set, the mixture-of-experts FFN of the sparse layers (``MoE``).
      swiglu_limit, swiglu_alpha, swiglu_up_offset: ``"swiglu"`` only (``ops.ffn.swiglu_glu``).
      attention_chunk: C for ``"chunked"`` layers (a query at m sees keys with n // C == m // C).
      nope_layers: the layers that do not rotate q and k (NoPE) and have no ``qk_norm``.
      nope_temperature_floor, nope_temperature_scale: if the floor f is set, NoPE layers scale
        their queries at position m by ``1 + scale * log(1 + floor((m + 1) / f))``.
      mla: if set, every layer is multi-head latent attention (``MLA``; head_dim: its rope width).
      mtp_depth: the multi-token prediction modules after the stack (0: none; ``model.mtp``).
    """

    vocab_size: int = 512
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None
    head_dim: int | None = None
    d_ff: int = 512
    max_seq_len: int = 256
    norm: str = "rms"
    norm_eps: float = 1e-5
    norm_position: str = "pre"
    ffn: str = "swiglu"
    position: str = "rope"
    rope_base: float = 10000.0
    rope_pairing: str = "half"
    rope_scaling: RopeScaling | None = None
    sliding_window: int | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    attn_sinks: bool = False
    tie_embeddings: bool = False
    qk_norm: str | None = None
    norm_offset: float = 0.0
    scale_embeddings: bool = False
    attn_softcap: float | None = None
    final_softcap: float | None = None
    attn_scale: float | None = None
    layer_pattern: tuple[str, ...] = ()
    local_rope_base: float | None = None
    moe: MoE | None = None
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.0
    swiglu_up_offset: float = 0.0
    attention_chunk: int | None = None
    nope_layers: tuple[int, ...] = ()
    nope_temperature_floor: int | None = None
    nope_temperature_scale: float = 0.1
    mla: MLA | None = None
    mtp_depth: int = 0

    def __post_init__(self) -> None:
        for name, table in (("moe", MoE), ("rope_scaling", RopeScaling), ("mla", MLA)):
            if isinstance(getattr(self, name), dict):
                object.__setattr__(self, name, _table(table, getattr(self, name), name))
        for name in ("layer_pattern", "nope_layers"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_seq_len"):
            check_positive_int(name, getattr(self, name))
        check_nonnegative_int("mtp_depth", self.mtp_depth)
        if self.mla is not None:
            attention_checks.check_mla(self)
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        check_positive_int("n_kv_heads", self.n_kv_heads)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads "
                             f"({self.n_kv_heads})")
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads "
                                 f"({self.n_heads}) unless head_dim is given")
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        check_positive_int("head_dim", self.head_dim)
        if self.sliding_window is not None:
            check_positive_int("sliding_window", self.sliding_window)
        check_positive_number("norm_eps", self.norm_eps)
        check_positive_number("rope_base", self.rope_base)
        _check_choices(self, norm=NORMS, norm_position=NORM_POSITIONS, ffn=FFNS,
                       position=POSITIONS, rope_pairing=ROPE_PAIRINGS)
        if self.position == "rope" and self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.position == "sinusoidal" and self.d_model % 2:
            raise ValueError(f"d_model must be even for sinusoidal positions, got {self.d_model}")
        for name in ("qkv_bias", "o_bias", "attn_sinks", "tie_embeddings", "scale_embeddings"):
            check_bool(name, getattr(self, name))
        if self.qk_norm is not None:
            check_choice("qk_norm", self.qk_norm, QK_NORMS)
        check_finite_number("norm_offset", self.norm_offset)
        for name in ("attn_softcap", "final_softcap", "attn_scale", "local_rope_base",
                     "swiglu_limit"):
            if getattr(self, name) is not None:
                check_positive_number(name, getattr(self, name))
        check_positive_number("swiglu_alpha", self.swiglu_alpha)
        check_finite_number("swiglu_up_offset", self.swiglu_up_offset)
        if self.ffn != "swiglu" and self.swiglu is not None:
            raise ValueError(f"swiglu_limit, swiglu_alpha and swiglu_up_offset need "
                             f"ffn='swiglu', got ffn={self.ffn!r}")
        if not isinstance(self.layer_pattern, tuple):
            raise ValueError(f"layer_pattern must be a list of {LAYER_KINDS}, got "
                             f"{self.layer_pattern!r}")
        for kind in self.layer_pattern:
            check_choice("layer_pattern entry", kind, LAYER_KINDS)
        if "local" in self.layer_pattern and self.sliding_window is None:
            raise ValueError("layer_pattern has local layers but sliding_window is not set")
        attention_checks.check_chunks_and_nope(self)
        if self.local_rope_base is not None and self.position != "rope":
            raise ValueError("local_rope_base needs position='rope'")
        if self.moe is not None:
            if not isinstance(self.moe, MoE):
                raise ValueError(f"moe must be a table of MoE fields, got {self.moe!r}")
            if self.ffn not in ("swiglu", "geglu", "geglu_tanh"):
                raise ValueError(f"moe needs a gated ffn (swiglu, geglu), got {self.ffn!r}")
            if past := [i for i in self.moe.dense_layers if i >= self.n_layers]:
                raise ValueError(f"moe.dense_layers lists {past}, past the last layer (the "
                                 f"model has n_layers={self.n_layers}: indices 0.."
                                 f"{self.n_layers - 1})")
            if not self.sparse_layers:
                raise ValueError("moe: no layer is sparse (check moe.sparse_step and "
                                 "moe.dense_layers)")

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        """The indices of the layers whose FFN is the mixture of experts (none without moe)."""
        if self.moe is None:
            return ()
        return tuple(i for i in range(self.n_layers) if self.moe.is_sparse(i))

    def layer_kinds(self) -> tuple[str, ...]:
        """Each layer's attention kind (``LAYER_KINDS``; ``"latent"`` with ``mla``)."""
        if self.mla is not None:
            return ("latent",) * self.n_layers
        pattern = self.layer_pattern or (
            ("local",) if self.sliding_window is not None
            else ("chunked",) if self.attention_chunk is not None else ("global",))
        return tuple(pattern[i % len(pattern)] for i in range(self.n_layers))

    def layer_specs(self) -> tuple[LayerSpec, ...]:
        """Each layer's ``stack.LayerSpec`` (attention and FFN kind): L entries."""
        sparse, nope = set(self.sparse_layers), set(self.nope_layers)
        return tuple(LayerSpec(kind, "moe" if i in sparse else "dense", i not in nope)
                     for i, kind in enumerate(self.layer_kinds()))

    def mtp_spec(self) -> LayerSpec:
        """The multi-token prediction modules' block spec: that of one layer more."""
        return dataclasses.replace(self, n_layers=self.n_layers + 1).layer_specs()[-1]

    def layer_groups(self) -> tuple[LayerGroup, ...]:
        """The stack cut into groups of a repeated period (``stack.layer_groups``)."""
        return layer_groups(self.layer_specs())

    @property
    def swiglu(self) -> tuple[float | None, float, float] | None:
        """(clamp limit, gate slope, up offset) when any differs from plain SwiGLU's, else None."""
        values = (self.swiglu_limit, self.swiglu_alpha, self.swiglu_up_offset)
        return None if values == (None, 1.0, 0.0) else values

    @property
    def local_layers(self) -> int:
        """How many layers attend within the sliding window."""
        return self.layer_kinds().count("local")

    @property
    def queries_per_kv_head(self) -> int:
        """G = N / K, the number of query heads sharing one key/value head."""
        return self.n_heads // self.n_kv_heads


def _check_choices(config: Any, **choices: tuple[str, ...]) -> None:
    for name, allowed in choices.items():
        check_choice(name, getattr(config, name), allowed)


def _resumable(default: Any) -> Any:
    """A field a run may change when it resumes from its own checkpoints."""
    return dataclasses.field(default=default, metadata={"resumable": True})


@dataclasses.dataclass(frozen=True)
class Execution:
    """How an architecture is initialised and run; a checkpoint loads under any of these.

    Attributes:
      param_dtype: dtype parameters are stored in.
      dtype: dtype activations and matmuls are computed in (norms, softmax and logits: float32).
      scan_layers: scan each layer group with ``nn.scan`` (compile time independent of depth).
      remat: the blocks' rematerialisation, one of ``REMATS`` (``model.remat``).
      attention_impl: one of ``ATTENTION_IMPLS`` (``ops.attention``).
      init_std: standard deviation of the normal initialiser of every matrix.
      moe_impl: how mixture-of-experts layers compute, one of ``MOE_IMPLS`` (``ops.moe``).
    """

    param_dtype: str = "float32"
    dtype: str = "float32"
    scan_layers: bool = False
    remat: str = _resumable("none")
    attention_impl: str = _resumable("auto")
    init_std: float = 0.02
    moe_impl: str = _resumable("auto")

    def __post_init__(self) -> None:
        check_positive_number("init_std", self.init_std)
        _check_choices(self, moe_impl=MOE_IMPLS, remat=REMATS, attention_impl=ATTENTION_IMPLS,
                       param_dtype=DTYPES, dtype=DTYPES)
        check_bool("scan_layers", self.scan_layers)

    @property
    def jnp_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def jnp_param_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.param_dtype)


#: Keys older checkpoints may hold that no longer configure the model (now ``decode.prepare``'s).
_RETIRED_KEYS = ("weights_out_first",)


@dataclasses.dataclass(frozen=True)
class ModelConfig(Execution, Architecture):
    """A model as a run uses it: its ``Architecture`` and ``Execution`` (see them) in one table."""

    def __post_init__(self) -> None:
        Architecture.__post_init__(self)
        Execution.__post_init__(self)
        if self.attn_softcap is not None and self.attention_impl == "cudnn":
            raise ValueError(f"attn_softcap={self.attn_softcap}: attention_impl='cudnn' cannot "
                             "soft-cap the logits; use 'auto', 'xla', 'chunked' or 'mosaic'")
        if self.attn_sinks and self.attention_impl in ("cudnn", "pallas", "mosaic"):
            raise ValueError(f"attn_sinks: attention_impl={self.attention_impl!r} has no "
                             "attention sinks; use 'auto', 'xla' or 'chunked'")

    @property
    def architecture(self) -> Architecture:
        """The fields that define the function (what a HF ``config.json`` holds)."""
        return Architecture(**_values(self, Architecture))

    @property
    def execution(self) -> Execution:
        """The fields that say how it is initialised and run."""
        return Execution(**_values(self, Execution))

    @classmethod
    def of(cls, architecture: Architecture, execution: Execution | None = None) -> ModelConfig:
        """The config of an architecture run with ``execution`` (default: ``Execution()``)."""
        return cls(**_values(architecture, Architecture),
                   **_values(execution or Execution(), Execution))

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ModelConfig:
        """From a mapping, rejecting unknown keys (close ones named; ``_RETIRED_KEYS`` dropped)."""
        values = {k: v for k, v in values.items() if k not in _RETIRED_KEYS}
        check_keys(values, cls, "model")
        return cls(**values)

    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        """The ``[model]`` table of ``configs/NAME.toml`` (e.g. ``"tiny"``, ``"llama2_7b"``)."""
        return cls.from_dict(load_toml(name).get("model", {}))


def field_names(cls: type) -> tuple[str, ...]:
    """The field names of dataclass ``cls`` (``Architecture``, ``Execution``, ...)."""
    return tuple(f.name for f in dataclasses.fields(cls))


def resumable_keys() -> tuple[str, ...]:
    """``Execution`` fields a run may change when it resumes (they leave its state as it is)."""
    return tuple(f.name for f in dataclasses.fields(Execution) if f.metadata.get("resumable"))


def _values(config: Any, cls: type) -> dict[str, Any]:
    return {name: getattr(config, name) for name in field_names(cls)}


def preset_names() -> list[str]:
    """Names of the TOML presets in ``configs/``."""
    return sorted(p.stem for p in CONFIGS_DIR.glob("*.toml"))


def resolve_config_path(name_or_path: str | Path) -> Path:
    """Maps a preset name or a path to an existing TOML file, or raises FileNotFoundError."""
    path = Path(name_or_path)
    candidates = [path, path.with_suffix(".toml"), CONFIGS_DIR / f"{path.name}.toml",
                  CONFIGS_DIR / path.name]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    close = difflib.get_close_matches(path.stem, preset_names(), n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else f"; presets: {preset_names()}"
    raise FileNotFoundError(f"no config file or preset named {str(name_or_path)!r}{hint}")


def load_toml(name_or_path: str | Path) -> dict[str, Any]:
    """Reads a config TOML file (by preset name or path)."""
    with open(resolve_config_path(name_or_path), "rb") as f:
        return tomllib.load(f)


def _table(cls: type, values: dict[str, Any], section: str) -> Any:
    """``cls(**values)`` for a sub-table (``[model.moe]``), naming unknown or missing keys."""
    check_keys(values, cls, f"model.{section}")
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in values
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ValueError(f"model.{section} needs {', '.join(missing)} (missing)")
    return cls(**values)
