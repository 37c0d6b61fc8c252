"""Thin flax.linen modules: each owns its parameters (with logical axis names, so a mesh shards
them by rules) and calls the pure functions in ``ops``."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from transformer_jax.model import ops, remat
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.kv_cache import Cache
from transformer_jax.model.ops.attention import attention
from transformer_jax.model.ops.dense import dense
from transformer_jax.model.ops.ffn import swiglu_glu
from transformer_jax.model.ops.layouts import OutFirst
from transformer_jax.model.ops.moe import ExpertList
from transformer_jax.model.ops.positions import rope_attention_factor
from transformer_jax.model.ops.quantized import is_quantized
from transformer_jax.model.ops.row_lora import RowAdapters
from transformer_jax.model.stack import LayerRef, LayerSpec


def is_vector_param(name: str) -> bool:
    """Whether a parameter of this (leaf) name is a norm gain/shift or a bias."""
    return name in ("scale", "bias", "sinks") or name.endswith("_bias")


#: How many leading axes of each matrix (in its in-first layout) are inputs; the rest outputs.
MATRIX_INPUT_AXES = {"q_proj": 1, "k_proj": 1, "v_proj": 1, "o_proj": 2, "gate": 1, "up": 1,
                     "down": 1, "lm_head": 1, "router": 1, "shared_gate": 1,
                     "eh_proj": 1}

#: The token table's name: a lookup in the forward, a matmul only as a tied LM head.
EMBEDDING_PARAM = "embedding"

#: What a block passes to the next: the [B, T, D] residual stream and the cache (or None).
Carry = tuple[jax.Array, Cache | None]


def matrix(module: nn.Module, name: str, shape: tuple[int, ...], axes: tuple[str, ...],
           init: nn.initializers.Initializer, *, param_dtype: jnp.dtype) -> Any:
    """Declares matrix ``name`` on ``module``, in-first ``shape`` and logical ``axes``.

    Returns:
      The parameter in ``param_dtype``, or a weight prepared in its place (``stored_as_is``).
    """
    prepared = stored_as_is(module, name)
    if prepared is not None:
        return prepared
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, param_dtype)


def typed_matrix(module: nn.Module, name: str, shape: tuple[int, ...], axes: tuple[str, ...],
                 std: float) -> Any:
    """``matrix`` with a normal(``std``) initialiser, cast to the module's compute ``dtype``."""
    return matrix(module, name, shape, axes, nn.initializers.normal(std),
                  param_dtype=module.param_dtype).astype(module.dtype)


def zeros_param(module: nn.Module, name: str, shape: tuple[int, ...], axes: tuple[str, ...]
                ) -> jax.Array:
    """A zero-initialised parameter (a bias) of ``module``, cast to its compute ``dtype``."""
    return module.param(name, nn.with_logical_partitioning(nn.initializers.zeros, axes), shape,
                        module.param_dtype).astype(module.dtype)


def stored_as_is(module: nn.Module, name: str) -> Any:
    """Parameter ``name`` of ``module`` when stored as a typed leaf (e.g. quantised), else None."""
    if module.has_variable("params", name):
        w = module.get_variable("params", name)
        if is_quantized(w) or isinstance(w, RowAdapters | OutFirst | ExpertList):
            return w
    return None


class Embed(nn.Module):
    """Token embedding table [V, D] (also the LM head when tied, ``Transformer.lm_head``)."""

    vocab_size: int
    d_model: int
    init_std: float = 0.02
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    def setup(self) -> None:
        self.embedding = matrix(self, EMBEDDING_PARAM, (self.vocab_size, self.d_model),
                                ("vocab", "embed"), nn.initializers.normal(self.init_std),
                                param_dtype=self.param_dtype)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """[B, T] ids -> [B, T, D] vectors in the compute dtype."""
        # A tied table prepared as an out-first head (``ops.layouts``) is still the [V, D] table.
        table = self.embedding.w if isinstance(self.embedding, OutFirst) else self.embedding
        return ops.embed(tokens, table).astype(self.dtype)


class Norm(nn.Module):
    """RMSNorm (``kind="rms"``) or LayerNorm (``kind="layer"``) over the trailing ``shape``
    (default: x's last axis); gain ``offset + scale``, ``scale`` starting at ``1 - offset``."""

    kind: str = "rms"
    eps: float = 1e-5
    offset: float = 0.0
    shape: tuple[int, ...] | None = None
    axes: tuple[str, ...] = ("norm",)
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        shape = self.shape or x.shape[-1:]
        init = nn.initializers.constant(1.0 - self.offset)
        scale = self.param("scale", nn.with_logical_partitioning(init, self.axes), shape,
                           self.param_dtype)
        if self.kind == "rms":
            return ops.rms_norm(x, scale, self.eps, offset=self.offset)
        bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, self.axes),
                          shape, self.param_dtype)
        return ops.layer_norm(x, scale, bias, self.eps, offset=self.offset)


@dataclasses.dataclass(frozen=True)
class LayerKind:
    """How one layer attends, from its ``LayerSpec``.

    Attributes:
      window: the sliding window (None: full causal).
      freqs, rope_factor: [H/2] float32 RoPE frequencies (None without RoPE), cos/sin multiplier.
      chunk: a chunked layer's C, else None.
      temperature: (floor, scale) of a NoPE layer's query temperature, else None.
    """

    window: int | None
    freqs: jax.Array | None
    rope_factor: float
    chunk: int | None = None
    temperature: tuple[int, float] | None = None

    @classmethod
    def of(cls, config: ModelConfig, spec: LayerSpec) -> LayerKind:
        c = config
        window = c.sliding_window if spec.local else None
        chunk = c.attention_chunk if spec.attention == "chunked" else None
        if c.position != "rope" or not spec.rope:
            temperature = None if c.nope_temperature_floor is None or spec.rope else (
                c.nope_temperature_floor, c.nope_temperature_scale)
            return cls(window, None, 1.0, chunk, temperature)
        if spec.local and c.local_rope_base is not None:
            return cls(window, ops.rope_frequencies(c.head_dim, c.local_rope_base), 1.0, chunk)
        return cls(window, ops.rope_frequencies(c.head_dim, c.rope_base, c.rope_scaling),
                   rope_attention_factor(c.rope_scaling), chunk)


class Attention(nn.Module):
    """Multi-head attention with grouped kv heads, RoPE and an optional KV cache: ``q_proj``
    [D, N, H], ``k_proj``, ``v_proj`` [D, K, H], ``o_proj`` [N, H, D]; optionally ``q_bias``,
    ``k_bias``, ``v_bias``, ``o_bias``, ``sinks`` [N] and the ``qk_norm`` gains."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    qkv_bias: bool = False
    o_bias: bool = False
    sinks: bool = False
    qk_norm: str | None = None
    norm_eps: float = 1e-5
    norm_offset: float = 0.0
    scale: float | None = None
    softcap: float | None = None
    rope_pairing: str = "half"
    impl: str = "auto"
    init_std: float = 0.02
    out_init_std: float = 0.02
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    def _qk_norm(self, name: str, x: jax.Array, heads_axis: str) -> jax.Array:
        shape, axes = (((self.head_dim,), ("head_dim",)) if self.qk_norm == "head"
                       else (x.shape[-2:], (heads_axis, "head_dim")))
        return Norm(eps=self.norm_eps, offset=self.norm_offset, shape=shape, axes=axes,
                    param_dtype=self.param_dtype, name=name)(x)

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array, kind: LayerKind,
                 cache: Cache | None = None, layer: int | LayerRef = 0,
                 segment_ids: jax.Array | None = None) -> tuple[jax.Array, Cache | None]:
        """Self-attention of x over itself, or over the cache once x's keys are written in.

        Args:
          x, positions: [B, T, D] normalised input, [B, T] int positions (consecutive per row).
          kind: this layer's window and RoPE frequencies (``LayerKind.of``).
          cache, layer: an optional ``Cache`` and this block's number (or ``LayerRef``) in it.
          segment_ids: optional [B, T] packed-sequence ids (0 = padding); not with a cache.

        Returns:
          ([B, T, D] output, the updated cache or None).
        """
        d = x.shape[-1]
        n, kv, h = self.n_heads, self.n_kv_heads, self.head_dim
        std = self.init_std
        wq = typed_matrix(self, "q_proj", (d, n, h), ("embed", "heads", "head_dim"), std)
        wk = typed_matrix(self, "k_proj", (d, kv, h), ("embed", "kv_heads", "head_dim"), std)
        wv = typed_matrix(self, "v_proj", (d, kv, h), ("embed", "kv_heads", "head_dim"), std)
        wo = typed_matrix(self, "o_proj", (n, h, d), ("heads", "head_dim", "embed"),
                          self.out_init_std)
        q = checkpoint_name(dense(x, wq, "BTD,DNH->BTNH"), remat.QUERY)
        k = checkpoint_name(dense(x, wk, "BSD,DKH->BSKH"), remat.KEY)
        v = checkpoint_name(dense(x, wv, "BSD,DKH->BSKH"), remat.VALUE)
        if self.qkv_bias:
            q = q + zeros_param(self, "q_bias", (n, h), ("heads", "head_dim"))
            k = k + zeros_param(self, "k_bias", (kv, h), ("kv_heads", "head_dim"))
            v = v + zeros_param(self, "v_bias", (kv, h), ("kv_heads", "head_dim"))
        if self.qk_norm in ("head", "full"):
            q = self._qk_norm("q_norm", q, "heads")
            k = self._qk_norm("k_norm", k, "kv_heads")
        if kind.freqs is not None:
            rope = dict(pairing=self.rope_pairing, freqs=kind.freqs,
                        attention_factor=kind.rope_factor)
            q, k = (ops.apply_rope(x, positions, **rope) for x in (q, k))
        if self.qk_norm == "weightless":
            unit = jnp.ones((h,), jnp.float32)
            q, k = (ops.rms_norm(x, unit, self.norm_eps) for x in (q, k))
        if kind.temperature is not None:  # 1 + s log(1 + floor((m + 1) / f)) per query
            floor, slope = kind.temperature
            steps = jnp.floor((positions.astype(jnp.float32) + 1.0) / floor)
            q = (q * (jnp.log1p(steps) * slope + 1.0)[:, :, None, None]).astype(q.dtype)

        sinks = None if not self.sinks else self.param(
            "sinks", nn.with_logical_partitioning(nn.initializers.zeros, ("heads",)), (n,),
            self.param_dtype).astype(jnp.float32)
        logits = dict(window=kind.window, impl=self.impl, scale=self.scale, softcap=self.softcap,
                      sinks=sinks)
        if kind.chunk is not None:  # only then: a cache without chunked layers takes none
            logits["chunk"] = kind.chunk
        if cache is None:
            out = attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
                            q_positions=positions, k_positions=positions,
                            q_segments=segment_ids, k_segments=segment_ids, **logits)
        else:
            if segment_ids is not None:
                raise ValueError("segment_ids cannot be combined with a KV cache")
            # The cache stores the chunk and attends over what it holds, in its own layout.
            out, cache = cache.attend(layer, q, k, v, positions, **logits)
        out = checkpoint_name(out.astype(self.dtype), remat.CONTEXT)
        out = checkpoint_name(dense(out, wo, "BTNH,NHD->BTD"), remat.OUT)
        if self.o_bias:
            out = out + zeros_param(self, "o_bias", (d,), ("embed",))
        return out, cache


class MLP(nn.Module):
    """Feed-forward network: ``gate`` and ``up`` [D, F] (gated kinds), ``down`` [F, D];
    ``swiglu``: (limit, alpha, up_offset) of a clamped SwiGLU (``ops.ffn.swiglu_glu``)."""

    d_ff: int
    kind: str = "swiglu"
    swiglu: tuple[float | None, float, float] | None = None
    init_std: float = 0.02
    out_init_std: float = 0.02
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """[B, T, D] -> [B, T, D]."""
        d = x.shape[-1]
        fn, gated = ops.FFN_FUNCTIONS[self.kind]

        up = typed_matrix(self, "up", (d, self.d_ff), ("embed", "mlp"), self.init_std)
        down = typed_matrix(self, "down", (self.d_ff, d), ("mlp", "embed"), self.out_init_std)
        gate = (typed_matrix(self, "gate", (d, self.d_ff), ("embed", "mlp"), self.init_std)
                if gated else None)
        names = {id(gate): remat.MLP_GATE, id(up): remat.MLP_UP, id(down): remat.MLP_DOWN}

        def matmul(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
            # Each product named by its weight, for the remat policies (``model.remat``).
            return checkpoint_name(dense(x, w, spec), names[id(w)])

        if gated:
            glu = None if self.swiglu is None else swiglu_glu_of(self.swiglu)
            return fn(x, gate, up, down, matmul=matmul, glu=glu)
        return fn(x, up, down, matmul=matmul)


def swiglu_glu_of(swiglu: tuple[float | None, float, float]) -> Any:
    """``ops.ffn.swiglu_glu`` with (limit, alpha, up_offset) bound."""
    limit, alpha, offset = swiglu
    return functools.partial(swiglu_glu, limit=limit, alpha=alpha, up_offset=offset)
