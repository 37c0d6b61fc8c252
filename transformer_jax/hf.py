"""HuggingFace checkpoints (Llama, Mistral and Qwen2 layouts) <-> ``ModelConfig`` and params.

``load(dir)`` reads ``config.json`` plus ``model.safetensors`` (or a sharded
``model.safetensors.index.json``) and returns a ``ModelConfig`` and a param tree that
``Transformer(config).apply`` runs with the same logits as the HF model; ``load(dir, mesh=mesh)``
creates every param sharded over a device mesh by the training's rules, each device's shard read
on its own from the memory-mapped files. ``save(config, params, dir, tokenizer=tok)`` writes the
reverse, which ``transformers``' ``from_pretrained`` reads (model and tokenizer).
``python -m transformer_jax.hf export --checkpoint RUN_DIR --out DIR`` exports a training run
(see ``transformer_jax.hf_export``).

Anything that cannot be represented exactly is refused with a ValueError naming the offending
setting or tensor (never loaded approximately): other model types, MLP biases, an ``o_proj``
bias, RoPE scaling other than linear/llama3, partial rotary embeddings, mixed sliding/full
attention layers, quantized weights, approximate GELUs.

HF stores torch ``Linear`` weights as [out, in]; our tree stores matrices [in, out] with heads
split out: ``q_proj.weight`` [N*H, D] -> ``q_proj`` [D, N, H], ``o_proj.weight`` [D, N*H] ->
``o_proj`` [N, H, D], ``gate/up_proj.weight`` [F, D] -> [D, F], ``down_proj.weight`` [D, F] ->
[F, D], ``lm_head.weight`` [V, D] -> [D, V]. HF Llama rotates the half-split pairs
``(x_i, x_{i+H/2})``, which is ``rope_pairing="half"``, so no permutation is needed.

Needs the ``hf`` extra (``safetensors``); ``torch``/``transformers`` are not used here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from transformer_jax.config import DTYPES, ModelConfig, RopeScaling
from transformer_jax.files import read_json, replacing_directory
from transformer_jax.model import Params, stack_blocks, unstack_blocks
from transformer_jax.sharding import param_shardings

if TYPE_CHECKING:  # the tokenizer backends are imported only by callers that have one
    from transformer_jax.tokenizer import TextTokenizer

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GENERATION_CONFIG_FILE = "generation_config.json"
# Files a tokenizer's ``save`` may write (HF or SentencePiece), replaced as a set by ``save``.
_TOKENIZER_FILES = frozenset({
    "tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
    "chat_template.jinja", "added_tokens.json", GENERATION_CONFIG_FILE})

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
# HF activation name -> our gated FFN. Only exact matches: "gelu" is the erf GELU; the tanh
# approximations ("gelu_new", "gelu_pytorch_tanh", ...) would not give the same logits.
_ACTIVATIONS = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu"}
_FFN_TO_ACTIVATION = {"swiglu": "silu", "geglu": "gelu"}
# safetensors dtype codes we read, and the ModelConfig dtype names they become.
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
# Buffers some older checkpoints carry that are recomputed from the config.
_IGNORED_TENSOR = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")
_SHARD_FILE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


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


def _names(names: list[str], limit: int = 5) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


# ------------------------------------------------------------------------------------------------
# Loading


def _safetensors() -> Any:
    try:
        import safetensors
        import safetensors.numpy  # noqa: F401  (loads the numpy save/load API)
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("transformer_jax.hf needs the 'hf' extra: pip install "
                          "'transformer_jax[hf]' (safetensors)") from e
    return safetensors


def _weight_files(path: Path) -> dict[str, Path]:
    """Maps every tensor name to the safetensors file that holds it."""
    single, index = path / SINGLE_FILE, path / INDEX_FILE
    if single.is_file():
        with _open_safetensors(single) as f:
            return {name: single for name in f.keys()}
    if index.is_file():
        index_json = read_json(index, "safetensors index")
        weight_map = index_json.get("weight_map") if isinstance(index_json, dict) else None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no 'weight_map' dict")
        files = {name: path / file for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not file.is_file():
                raise FileNotFoundError(f"shard {file.name} named in {index} does not exist")
        return files
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path} (only safetensors "
                            "checkpoints are supported)")


def _open_safetensors(file: Path) -> Any:
    """``safe_open`` of one file; a truncated or garbage file is a ValueError naming it."""
    try:
        return _safetensors().safe_open(str(file), framework="numpy")
    except Exception as e:  # safetensors raises its own SafetensorError (and OSError)
        raise ValueError(f"{file} is not a readable safetensors file ({_first_line(e)}); "
                         "it may be truncated or corrupt") from None


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def _dtype_name(dtype: Any) -> str:
    try:
        name = jnp.dtype(dtype).name
    except TypeError:
        name = None
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    return name


class _Reader:
    """Reads tensors, or blocks of them, from open safetensors files; errors name the file."""

    def __init__(self, files: dict[str, Path], handles: dict[Path, Any]) -> None:
        self.files = files
        self.handles = handles
        self.stored = {file: set(handle.keys()) for file, handle in handles.items()}

    def check(self, name: str, shape: tuple[int, ...]) -> str:
        """Checks a tensor's presence, shape and dtype from the header; returns its dtype name."""
        file = self.files[name]
        if name not in self.stored[file]:
            raise ValueError(f"tensor {name} is not in {file.name} as the index says")
        info = self.handles[file].get_slice(name)
        found = tuple(info.get_shape())
        if found != shape:
            raise ValueError(f"tensor {name} has shape {list(found)}, expected {list(shape)}")
        code = info.get_dtype()
        if code not in _SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {name} has unsupported dtype {code}; supported: "
                             f"{sorted(_SAFETENSORS_DTYPES)}")
        return _SAFETENSORS_DTYPES[code]

    @contextlib.contextmanager
    def reopened(self, names: Sequence[str]) -> Iterator[_Reader]:
        """A reader over fresh handles of the files holding ``names``, closed on exit.

        Pages of a memory-mapped file count in the process's resident set while it stays
        mapped; reopening per param and closing after lets them go, so a load never keeps
        the whole file resident on top of the arrays it built.
        """
        files = {name: self.files[name] for name in names}
        with ExitStack() as stack:
            handles = {file: stack.enter_context(_open_safetensors(file))
                       for file in sorted(set(files.values()))}
            yield _Reader(files, handles)

    def whole(self, name: str) -> np.ndarray:
        """The whole tensor, as stored."""
        return self._guard(name, lambda handle: handle.get_tensor(name))

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` of the tensor's first dimension."""
        return self._guard(name, lambda handle: handle.get_slice(name)[start:stop])

    def block(self, spec: _Tensor, index: tuple[slice, ...]) -> np.ndarray:
        """``spec.to_ours(tensor)[index]``, reading only that block from the memory-mapped file."""
        return self._guard(spec.hf_name,
                           lambda handle: spec.read(handle.get_slice(spec.hf_name), index))

    def _guard(self, name: str, read: Callable[[Any], np.ndarray]) -> np.ndarray:
        file = self.files[name]
        try:
            return read(self.handles[file])
        except Exception as e:  # data cut short or unreadable
            raise ValueError(f"{file}: tensor {name} is unreadable ({_first_line(e)}); the file "
                             "may be truncated or corrupt") from None


def _read_config(path: Path) -> tuple[ModelConfig, dict[str, Any]]:
    config_file = path / CONFIG_FILE
    if not config_file.is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} in {path}")
    hf_config = read_json(config_file, "config")
    if not isinstance(hf_config, dict):
        raise ValueError(f"config {config_file} is not a JSON object")
    return config_from_hf(hf_config), hf_config


def load(path: str | Path, *, mesh: Mesh | None = None, scan_layers: bool | None = None,
         dtype: str | jnp.dtype | None = None) -> tuple[ModelConfig, Params]:
    """Reads a HF Llama / Mistral / Qwen2 checkpoint directory.

    Everything is checked from ``config.json`` and the safetensors headers (names, shapes,
    dtypes, mesh divisibility) before any weight is read or any array allocated. Tensors are
    then read one at a time; with a ``mesh``, each device's shard is read on its own from the
    memory-mapped file (a scanned layout's [L, ...] shard from the per-layer tensors), so the
    host never holds more than one shard in flight, never the whole model or a whole tensor.

    Args:
      path: directory with ``config.json`` and ``model.safetensors`` or
        ``model.safetensors.index.json`` plus its shards.
      mesh: if given, every param is created sharded over it by
        ``sharding.param_shardings(config, mesh)`` (the training's logical-axis rules), on this
        process's devices only (so it works multi-host); None: plain arrays on the default
        device.
      scan_layers: True returns the scanned layout (``blocks`` with a leading L axis) and a
        config with ``scan_layers=True``; None or False the unrolled one (``blocks_{i}``).
      dtype: the ``param_dtype`` and compute ``dtype`` of the result (``"float32"``,
        ``"bfloat16"``, ``"float16"``); None keeps the checkpoint's dtype when all tensors
        share one, else float32 (an exact upcast).

    Returns:
      ``(config, params)``: ``Transformer(config).apply({"params": params}, tokens)`` gives the
      HF model's logits. Shapes: ``embed/embedding`` [V, D], ``q_proj`` [D, N, H], ``o_proj``
      [N, H, D], ``mlp/gate`` [D, F], ``lm_head`` [D, V] etc. (see ``transformer_jax.model``).
      The values are the same with and without a mesh.

    Raises:
      FileNotFoundError: no config.json or no weights.
      ValueError: a setting or tensor with no exact equivalent, or missing, unexpected or
        misshapen tensors (named); a ``config.json``/index that is not JSON or a truncated or
        corrupt safetensors file (the file named); a param the mesh cannot split evenly.
    """
    _safetensors()  # the ImportError with install advice, before any work
    if dtype is not None:
        dtype = _dtype_name(dtype)
    path = Path(path)
    config, hf_config = _read_config(path)
    if scan_layers:
        config = config.replace(scan_layers=True)
    specs = _tensors(config)
    files = _weight_files(path)

    expected = {s.hf_name for s in specs}
    o_biases = []
    if hf_config["model_type"] == "llama" and config.qkv_bias:
        # Llama's attention_bias also biases o_proj, which we lack: accept only zero biases.
        o_biases = [f"model.layers.{i}.self_attn.o_proj.bias" for i in range(config.n_layers)]
    tied_head = "lm_head.weight" if config.tie_embeddings and "lm_head.weight" in files else None
    missing = sorted((expected | set(o_biases)) - set(files))
    if missing:
        raise ValueError(f"checkpoint in {path} is missing tensors: {_names(missing)}")
    known = expected | set(o_biases) | {tied_head}
    unexpected = sorted(n for n in files if n not in known and not _IGNORED_TENSOR.match(n))
    if unexpected:
        raise ValueError(f"checkpoint in {path} has unexpected tensors: {_names(unexpected)}")

    with ExitStack() as stack:
        handles = {file: stack.enter_context(_open_safetensors(file))
                   for file in sorted(set(files.values()))}
        reader = _Reader(files, handles)
        stored = {reader.check(s.hf_name, s.hf_shape) for s in specs}
        for name in o_biases:
            reader.check(name, (config.d_model,))
        if tied_head is not None:
            reader.check(tied_head, (config.vocab_size, config.d_model))
        if dtype is None:
            dtype = stored.pop() if len(stored) == 1 else "float32"
        config = config.replace(param_dtype=dtype, dtype=dtype)
        shardings = None if mesh is None else param_shardings(config, mesh)  # raises early

        for name in o_biases:
            if np.any(reader.whole(name) != 0):
                raise ValueError(f"tensor {name} is a nonzero o_proj bias, which is not "
                                 "supported (Llama attention_bias=True with o_proj bias)")
        if tied_head is not None and not _same_rows(reader, tied_head,
                                                    "model.embed_tokens.weight"):
            raise ValueError("tie_word_embeddings=True but lm_head.weight differs from "
                             "model.embed_tokens.weight")

        if shardings is None:
            params: dict[str, Any] = {}
            for s in specs:
                _set_path(params, s.path, jnp.asarray(s.to_ours(reader.whole(s.hf_name)),
                                                      dtype=dtype))
            if config.scan_layers:
                params = stack_blocks(params, config.n_layers)
        else:
            params = _load_sharded(config, specs, reader, shardings)
    logger.info("loaded %s checkpoint from %s: %d layers, %s%s", hf_config["model_type"], path,
                config.n_layers, dtype, "" if mesh is None else f", sharded over {mesh.shape}")
    return config, params


def _same_rows(reader: _Reader, a: str, b: str, chunk_bytes: int = 1 << 26) -> bool:
    """Whether two [V, D] tensors are equal, compared a chunk of rows at a time."""
    shape = reader.handles[reader.files[a]].get_slice(a).get_shape()
    rows = max(1, chunk_bytes // (4 * math.prod(shape[1:])))
    return all(np.array_equal(reader.rows(a, i, i + rows), reader.rows(b, i, i + rows))
               for i in range(0, shape[0], rows))


def _load_sharded(config: ModelConfig, specs: list[_Tensor], reader: _Reader,
                  shardings: Any) -> Params:
    """Every param built shard by shard on this process's devices, straight from the files.

    A stacked (scanned) param ``blocks/...`` [L, ...] gathers its per-layer tensors' blocks.
    Each shard is read, put on its device and dropped before the next is read.
    """
    dtype = jnp.dtype(config.param_dtype)
    layers: dict[tuple[str, ...], list[_Tensor]] = {}
    for s in specs:
        stacked = config.scan_layers and s.path[0].startswith("blocks_")
        layers.setdefault(("blocks", *s.path[1:]) if stacked else s.path, []).append(s)
    by_path = dict(_flatten(shardings))
    if set(by_path) != set(layers):  # the model and the HF mapping disagree: a bug here
        raise AssertionError(f"param paths differ: {sorted(set(by_path) ^ set(layers))}")

    params: dict[str, Any] = {}
    for key, parts in layers.items():
        sharding = by_path[key]
        stacked = key[0] == "blocks"
        shape = ((len(parts),) if stacked else ()) + parts[0].shape

        def block(reader: _Reader, index: tuple[slice, ...], parts=parts, stacked=stacked,
                  shape=shape) -> np.ndarray:
            if not stacked:
                return reader.block(parts[0], index).astype(dtype, copy=False)
            start, stop, _ = index[0].indices(shape[0])
            return np.stack([reader.block(parts[i], index[1:]).astype(dtype, copy=False)
                             for i in range(start, stop)])

        with reader.reopened([p.hf_name for p in parts]) as fresh:
            shards = [jax.device_put(block(fresh, index), device) for device, index
                      in sharding.addressable_devices_indices_map(shape).items()]
        _set_path(params, key, jax.make_array_from_single_device_arrays(shape, sharding, shards))
    return params


# ------------------------------------------------------------------------------------------------
# Saving


def save(config: ModelConfig, params: Params, path: str | Path, *,
         tokenizer: TextTokenizer | None = None, max_shard_bytes: int | None = None) -> None:
    """Writes a HF checkpoint directory that ``load`` and transformers' ``from_pretrained`` read.

    The layout is Qwen2 when ``config.qkv_bias`` (Llama's ``attention_bias`` would also add an
    ``o_proj`` bias), else Mistral when ``config.sliding_window`` is set, else Llama. Tensors
    keep the params' dtype. An existing ``path`` is replaced only once the new export is
    complete (written to a temporary directory beside it, then swapped in), so a failed save
    leaves the previous export untouched; its files other than weights and ``config.json``
    (a tokenizer, say) are kept, unless a ``tokenizer`` is given: then the old tokenizer files
    are dropped and the new ones written.

    With a tokenizer the directory is complete: transformers' ``AutoModelForCausalLM`` and
    ``AutoTokenizer.from_pretrained``, ``python -m transformer_jax.generate --checkpoint DIR``
    and ``load`` all read it; ``config.json`` and ``generation_config.json`` then carry its
    bos/eos/pad ids.

    Args:
      config: the model config.
      params: unrolled (``blocks_{i}``) or scanned (``blocks`` [L, ...]) params of ``config``,
        plain or sharded arrays (each tensor is gathered to the host on its own).
      path: the directory (created if needed).
      tokenizer: the model's tokenizer (SentencePiece ``Tokenizer`` or ``HFTokenizer``);
        ``tokenizer.save(path)`` writes its files.
      max_shard_bytes: if the tensors take more bytes than this, write shards of at most this
        size (a larger single tensor gets its own) plus ``model.safetensors.index.json``.

    Raises:
      ValueError: the config has no HF equivalent, or params are missing, unexpected or
        misshapen (named).
      OSError: writing failed (the previous export, if any, is unchanged).
    """
    st = _safetensors()
    hf_config = config_to_hf(config)
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
    if "blocks" in params:
        params = unstack_blocks(params)
    flat = {"/".join(p): v for p, v in _flatten(params)}
    specs = _tensors(config)
    wanted = {"/".join(s.path) for s in specs}
    missing = sorted(wanted - set(flat))
    if missing:
        raise ValueError(f"params lack {_names(missing)} for this config")
    unexpected = sorted(set(flat) - wanted)
    if unexpected:
        raise ValueError(f"params have entries this config does not use: {_names(unexpected)}")

    tensors: dict[str, np.ndarray] = {}
    for s in specs:
        value = np.asarray(jax.device_get(flat["/".join(s.path)]))
        if value.shape != s.shape:
            raise ValueError(f"param {'/'.join(s.path)} has shape {list(value.shape)}, expected "
                             f"{list(s.shape)}")
        tensors[s.hf_name] = np.ascontiguousarray(s.to_hf(value))

    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    total = sum(t.nbytes for t in tensors.values())
    for name, tensor in tensors.items():
        if max_shard_bytes is not None and shards[-1] and size + tensor.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += tensor.nbytes

    ids = {} if tokenizer is None else _special_ids(tokenizer)
    hf_config.update(ids)
    path = Path(path)
    keep = _not_weights if tokenizer is None else _not_weights_or_tokenizer
    # Everything is written to a new directory that replaces the old one only when complete,
    # so a failed save (a full disk, a kill) leaves the previous export as it was. Files of
    # the old directory that are not weights (a tokenizer, a README) are carried over.
    with replacing_directory(path, carry_over=keep) as new:
        metadata = {"format": "pt"}  # transformers requires it on safetensors files
        if len(shards) == 1:
            st.numpy.save_file(tensors, str(new / SINGLE_FILE), metadata=metadata)
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                st.numpy.save_file(shard, str(new / file), metadata=metadata)
                weight_map.update(dict.fromkeys(shard, file))
            with open(new / INDEX_FILE, "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f,
                          indent=2)
        with open(new / CONFIG_FILE, "w") as f:
            json.dump(hf_config, f, indent=2, sort_keys=True)
            f.write("\n")
        if tokenizer is not None:
            tokenizer.save(new)
            with open(new / GENERATION_CONFIG_FILE, "w") as f:
                json.dump(ids, f, indent=2, sort_keys=True)
                f.write("\n")
    logger.info("saved %s checkpoint to %s: %d file(s), %.1f MiB", hf_config["model_type"], path,
                len(shards), total / 2**20)


def _not_weights(name: str) -> bool:
    """Whether an old export's file is kept by ``save`` (everything but weights and config)."""
    return not (name in (SINGLE_FILE, INDEX_FILE, CONFIG_FILE) or _SHARD_FILE.match(name))


def _not_weights_or_tokenizer(name: str) -> bool:
    """Whether an old export's file is kept by a ``save`` that writes a tokenizer."""
    return _not_weights(name) and name not in _TOKENIZER_FILES


def _special_ids(tokenizer: TextTokenizer) -> dict[str, int]:
    """``bos_token_id``/``eos_token_id``/``pad_token_id`` of a tokenizer (those it has)."""
    ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id,
           "pad_token_id": tokenizer.pad_id}
    return {key: int(value) for key, value in ids.items() if value is not None and value >= 0}


__all__ = ["ARCHITECTURES", "config_from_hf", "config_to_hf", "load", "save"]


if __name__ == "__main__":  # python -m transformer_jax.hf export --checkpoint RUN --out DIR
    import sys

    from transformer_jax.hf_export import main

    sys.exit(main())
