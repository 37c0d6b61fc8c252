"""HuggingFace Llama / Mistral / Qwen2 names and layouts <-> ``ModelConfig`` and our param tree.

Pure functions, no file I/O (``transformer_jax.hf`` reads and writes the files):
``config_from_hf``/``config_to_hf`` map a ``config.json`` dict to a ``ModelConfig`` and back;
``_tensors(config)`` lists every HF tensor of a config with the param path it becomes and the
reshape/transpose between the two layouts (``_Tensor``).

Anything that cannot be represented exactly is refused with a ValueError naming the offending
setting (never converted approximately): other model types, MLP biases, RoPE scaling other than
linear/llama3, partial rotary embeddings, mixed sliding/full attention layers, quantized
weights, approximate GELUs.

HF stores torch ``Linear`` weights as [out, in]; our tree stores matrices [in, out] with heads
split out: ``q_proj.weight`` [N*H, D] -> ``q_proj`` [D, N, H], ``o_proj.weight`` [D, N*H] ->
``o_proj`` [N, H, D], ``gate/up_proj.weight`` [F, D] -> [D, F], ``down_proj.weight`` [D, F] ->
[F, D], ``lm_head.weight`` [V, D] -> [D, V]. HF Llama rotates the half-split pairs
``(x_i, x_{i+H/2})``, which is ``rope_pairing="half"``, so no permutation is needed.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from transformer_jax.model.config import ModelConfig, RopeScaling

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
# HF activation name -> our gated FFN. Only exact matches: "gelu" is the erf GELU; the tanh
# approximations ("gelu_new", "gelu_pytorch_tanh", ...) would not give the same logits.
_ACTIVATIONS = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu"}
_FFN_TO_ACTIVATION = {"swiglu": "silu", "geglu": "gelu"}
# Buffers some older checkpoints carry that are recomputed from the config.
_IGNORED_TENSOR = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")


# ------------------------------------------------------------------------------------------------
# Config mapping


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Maps a HF ``config.json`` dict (Llama, Mistral or Qwen2) to a ``ModelConfig``.

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
    rope_base, rope_scaling = _rope_from_hf(hf, max_seq_len)
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


def _rope_from_hf(hf: dict[str, Any], max_seq_len: int) -> tuple[float, RopeScaling | None]:
    """(rope_base, rope_scaling) from legacy ``rope_theta``/``rope_scaling`` or ``rope_parameters``.

    As in transformers, a legacy ``rope_scaling`` dict wins over ``rope_parameters``, and a
    ``rope_theta`` inside the dict wins over the top-level one.
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
    base = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial is not None and float(partial) != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} is not supported (only full RoPE)")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return base, None

    def key(name: str) -> Any:
        if rope.get(name) is None:
            raise ValueError(f"rope_scaling of type {kind!r} lacks {name!r}")
        return rope[name]

    if kind == "linear":
        return base, RopeScaling(kind="linear", factor=float(key("factor")))
    if kind == "llama3":
        original = rope.get("original_max_position_embeddings") or max_seq_len
        return base, RopeScaling(
            kind="llama3", factor=float(key("factor")),
            low_freq_factor=float(key("low_freq_factor")),
            high_freq_factor=float(key("high_freq_factor")), original_max_len=int(original))
    raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: default, linear, "
                     "llama3")


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


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The HF ``config.json`` dict for a config: Llama, Mistral (sliding window) or Qwen2 (biases).

    Writes both the legacy ``rope_theta``/``rope_scaling`` keys (transformers 4.x) and
    ``rope_parameters`` (transformers 5.x).

    Args:
      config: the model config.

    Returns:
      A JSON-serialisable dict.

    Raises:
      ValueError: naming the setting that HF Llama/Mistral/Qwen2 cannot represent.
    """
    c = config
    fixed = {"norm": "rms", "norm_position": "pre", "position": "rope", "rope_pairing": "half"}
    for name, want in fixed.items():
        if getattr(c, name) != want:
            raise ValueError(f"HF Llama-family checkpoints need {name}={want!r}, got "
                             f"{getattr(c, name)!r}")
    if c.ffn not in _FFN_TO_ACTIVATION:
        raise ValueError(f"HF Llama-family checkpoints need a gated ffn "
                         f"{sorted(_FFN_TO_ACTIVATION)}, got {c.ffn!r}")
    if c.qkv_bias:
        model_type = "qwen2"
    elif c.sliding_window is not None:
        model_type = "mistral"
    else:
        model_type = "llama"
    if model_type == "llama" and c.d_model % c.n_heads:
        # transformers' LlamaConfig rejects this even with an explicit head_dim.
        raise ValueError(f"HF LlamaConfig needs d_model ({c.d_model}) divisible by n_heads "
                         f"({c.n_heads})")

    if c.rope_scaling is None:
        scaling = None
    elif c.rope_scaling.kind == "linear":
        scaling = {"rope_type": "linear", "factor": c.rope_scaling.factor}
    else:
        scaling = {"rope_type": "llama3", "factor": c.rope_scaling.factor,
                   "low_freq_factor": c.rope_scaling.low_freq_factor,
                   "high_freq_factor": c.rope_scaling.high_freq_factor,
                   "original_max_position_embeddings": c.rope_scaling.original_max_len}
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
        "rope_theta": c.rope_base,
        "rope_scaling": scaling,
        "rope_parameters": {**(scaling or {"rope_type": "default"}), "rope_theta": c.rope_base},
        "tie_word_embeddings": c.tie_embeddings,
        "torch_dtype": c.param_dtype,
        "dtype": c.param_dtype,
    }
    if model_type == "llama":
        hf.update(attention_bias=False, mlp_bias=False)
    elif model_type == "mistral":
        hf.update(sliding_window=c.sliding_window)
    else:
        sliding = c.sliding_window is not None
        # Qwen2 slides in layers i >= max_window_layers: 0 means all of them, L means none.
        hf.update(use_sliding_window=sliding, sliding_window=c.sliding_window,
                  max_window_layers=0 if sliding else c.n_layers)
    return hf


# ------------------------------------------------------------------------------------------------
# Tensor mapping


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """One HF tensor and the param it becomes.

    Every mapping is a reshape then a transpose: the HF array [hf_shape] is viewed as
    [split] (each HF dimension ``i`` split into ``groups[i]`` consecutive dimensions), then
    transposed by ``perm`` (our dimension ``k`` is split dimension ``perm[k]``). Knowing that,
    ``read`` can fetch any rectangular block of our array from the file without the rest.

    Attributes:
      hf_name: the safetensors key.
      path: the param's path in the unrolled tree.
      hf_shape: shape in the HF checkpoint.
      split: ``hf_shape`` with merged dimensions split apart.
      groups: how many split dimensions each HF dimension holds.
      perm: the transpose from ``split`` to our layout.
    """

    hf_name: str
    path: tuple[str, ...]
    hf_shape: tuple[int, ...]
    split: tuple[int, ...]
    groups: tuple[int, ...]
    perm: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape in our tree."""
        return tuple(self.split[p] for p in self.perm)

    def to_ours(self, x: np.ndarray) -> np.ndarray:
        """HF array [hf_shape] -> our array [shape]."""
        return x.reshape(self.split).transpose(self.perm)

    def to_hf(self, x: np.ndarray) -> np.ndarray:
        """Our array [shape] -> HF array [hf_shape]."""
        return x.transpose(np.argsort(self.perm)).reshape(self.hf_shape)

    def read(self, tensor: Any, index: tuple[slice, ...]) -> np.ndarray:
        """The block ``ours[index]`` read from the HF tensor, and nothing much more.

        Args:
          tensor: anything indexable by a tuple of slices over ``hf_shape`` that returns a numpy
            array, e.g. safetensors' ``get_slice`` handle (memory-mapped, reads only the block).
          index: one step-1 slice per dimension of our layout (``shape``).

        Returns:
          ``to_ours(hf)[index]``. The HF block read is that block exactly whenever the inner
          dimensions of each merged HF dimension (head_dim) are whole, which every sharding
          rule here keeps; otherwise those inner dimensions are read whole and cut here.
        """
        ranges: list[tuple[int, int]] = [(0, 0)] * len(self.split)
        for k, p in enumerate(self.perm):
            start, stop, _ = index[k].indices(self.split[p])
            ranges[p] = (start, max(start, stop))
        hf_index, block_shape, inner = [], [], []
        first = 0
        for g in self.groups:
            dims = range(first, first + g)
            first += g
            rest = math.prod(self.split[d] for d in dims[1:])
            start, stop = ranges[dims[0]]
            hf_index.append(slice(start * rest, stop * rest))
            block_shape += [stop - start, *(self.split[d] for d in dims[1:])]
            inner += [slice(None), *(slice(*ranges[d]) for d in dims[1:])]
        block = np.asarray(tensor[tuple(hf_index)])
        return block.reshape(block_shape)[tuple(inner)].transpose(self.perm)


def _same(hf_name: str, path: tuple[str, ...], shape: tuple[int, ...]) -> _Tensor:
    return _Tensor(hf_name, path, shape, shape, (1,) * len(shape), tuple(range(len(shape))))


def _reshaped(hf_name: str, path: tuple[str, ...], hf_shape: tuple[int, ...],
              shape: tuple[int, ...]) -> _Tensor:
    """A bias [heads*H] <-> [heads, H]."""
    return _Tensor(hf_name, path, hf_shape, shape, (len(shape),), tuple(range(len(shape))))


def _linear(hf_name: str, path: tuple[str, ...], n_in: int, n_out: int) -> _Tensor:
    """torch Linear [out, in] <-> [in, out]."""
    return _Tensor(hf_name, path, (n_out, n_in), (n_out, n_in), (1, 1), (1, 0))


def _heads_in(hf_name: str, path: tuple[str, ...], d: int, heads: int, h: int) -> _Tensor:
    """q/k/v projection: [heads*H, D] <-> [D, heads, H]."""
    return _Tensor(hf_name, path, (heads * h, d), (heads, h, d), (2, 1), (2, 0, 1))


def _heads_out(hf_name: str, path: tuple[str, ...], d: int, heads: int, h: int) -> _Tensor:
    """Output projection: [D, N*H] <-> [N, H, D]."""
    return _Tensor(hf_name, path, (d, heads * h), (d, heads, h), (1, 2), (1, 2, 0))


def _tensors(config: ModelConfig) -> list[_Tensor]:
    """Every tensor of the HF checkpoint of ``config``, in the order HF writes them."""
    c = config
    d, n, kv, h, f, v = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff, c.vocab_size
    out = [_same("model.embed_tokens.weight", ("embed", "embedding"), (v, d))]
    for i in range(c.n_layers):
        hf, ours = f"model.layers.{i}", f"blocks_{i}"
        attn, mlp = f"{hf}.self_attn", f"{hf}.mlp"
        out += [
            _same(f"{hf}.input_layernorm.weight", (ours, "attn_norm", "scale"), (d,)),
            _heads_in(f"{attn}.q_proj.weight", (ours, "attn", "q_proj"), d, n, h),
            _heads_in(f"{attn}.k_proj.weight", (ours, "attn", "k_proj"), d, kv, h),
            _heads_in(f"{attn}.v_proj.weight", (ours, "attn", "v_proj"), d, kv, h),
        ]
        if c.qkv_bias:
            out += [
                _reshaped(f"{attn}.q_proj.bias", (ours, "attn", "q_bias"), (n * h,), (n, h)),
                _reshaped(f"{attn}.k_proj.bias", (ours, "attn", "k_bias"), (kv * h,), (kv, h)),
                _reshaped(f"{attn}.v_proj.bias", (ours, "attn", "v_bias"), (kv * h,), (kv, h)),
            ]
        out += [
            _heads_out(f"{attn}.o_proj.weight", (ours, "attn", "o_proj"), d, n, h),
            _same(f"{hf}.post_attention_layernorm.weight", (ours, "mlp_norm", "scale"), (d,)),
            _linear(f"{mlp}.gate_proj.weight", (ours, "mlp", "gate"), d, f),
            _linear(f"{mlp}.up_proj.weight", (ours, "mlp", "up"), d, f),
            _linear(f"{mlp}.down_proj.weight", (ours, "mlp", "down"), f, d),
        ]
    out.append(_same("model.norm.weight", ("final_norm", "scale"), (d,)))
    if not c.tie_embeddings:
        out.append(_linear("lm_head.weight", ("lm_head",), d, v))
    return out


def _set_path(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _flatten(tree: Mapping[str, Any], prefix: tuple[str, ...] = ()
             ) -> Iterator[tuple[tuple[str, ...], Any]]:
    for key, value in tree.items():
        if isinstance(value, Mapping):
            yield from _flatten(value, (*prefix, key))
        else:
            yield (*prefix, key), value


__all__ = ["ARCHITECTURES", "config_from_hf", "config_to_hf"]
