"""HuggingFace checkpoint directories of every family of ``ARCHITECTURES``: load, save, export.

``load(dir)`` reads ``config.json`` and the safetensors weights into a ``ModelConfig`` and a
param tree that gives the HF model's logits (sharded over a mesh if one is given; MXFP4 and FP8
dequantised); ``save`` writes the reverse, which ``from_pretrained`` reads. This module does the
file I/O, ``hf.convert`` the mapping; anything with no exact equivalent is a ValueError naming
it. Needs the ``hf`` extra (``safetensors``).
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from transformer_jax.hf import deepseek, fp8, generation_config, llama4, moe, mxfp4
from transformer_jax.hf.convert import (
    _IGNORED_TENSOR,
    ARCHITECTURES,
    FAMILIES,
    _tensors,
    config_from_hf,
    config_to_hf,
)
from transformer_jax.hf.reader import _open_safetensors, _Reader, _safetensors
from transformer_jax.hf.tensors import _flatten, _set_path, _Tensor
from transformer_jax.model.config import DTYPES, ModelConfig
from transformer_jax.model.transformer import Params, is_scanned, scanned_places, unstack_blocks
from transformer_jax.parallel.sharding import param_shardings
from transformer_jax.storage.files import read_json, replacing_directory, set_default_mode

if TYPE_CHECKING:  # the tokenizer backends are imported only by callers that have one
    from transformer_jax.tokenizer import TextTokenizer

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GENERATION_CONFIG_FILE = generation_config.FILE
# Files a tokenizer's ``save`` may write (HF or SentencePiece), replaced as a set by ``save``.
_TOKENIZER_FILES = frozenset({
    "tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
    "chat_template.jinja", "added_tokens.json", GENERATION_CONFIG_FILE})

_SHARD_FILE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


def _names(names: list[str], limit: int = 5) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


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


def _dtype_name(dtype: Any) -> str:
    try:
        name = jnp.dtype(dtype).name
    except TypeError:
        name = None
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    return name


def _read_config(path: Path) -> tuple[ModelConfig, dict[str, Any]]:
    config_file = path / CONFIG_FILE
    if not config_file.is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} in {path}")
    hf_config = read_json(config_file, "config")
    if not isinstance(hf_config, dict):
        raise ValueError(f"config {config_file} is not a JSON object")
    hf_config = llama4.text_model(hf_config)  # a Llama 4 with vision: its text model
    return config_from_hf(hf_config), hf_config


def load(path: str | Path, *, mesh: Mesh | None = None, scan_layers: bool | None = None,
         dtype: str | jnp.dtype | None = None, rules: Sequence[tuple[str, Any]] | None = None,
         mtp_depth: int | None = None) -> tuple[ModelConfig, Params]:
    """Reads a HF checkpoint directory (any model type of ``ARCHITECTURES``).

    Everything is checked from ``config.json`` and the safetensors headers before any weight
    is read; then each tensor (with a ``mesh``, each device's shard) is read on its own from the
    memory-mapped file, quantised ones (MXFP4, FP8) dequantised block by block to ``dtype``.

    Args:
      path: directory with ``config.json`` and the safetensors weights (one file or sharded).
      mesh: every param created sharded over it (``sharding.param_shardings``), on this
        process's devices only; None: plain arrays on the default device.
      scan_layers: True: the scanned layout (``scan_layers=True``); else ``blocks_{i}``.
      dtype: the ``param_dtype`` and compute ``dtype`` of the result; None keeps the
        checkpoint's dtype when all (unquantised) tensors share one, else float32.
      rules: the logical -> mesh axis rules of the placement (default: ``rules_for(mesh)``).
      mtp_depth: None loads the multi-token prediction modules the checkpoint has; 0 drops
        them (one log line).

    Returns:
      ``(config, params)``: ``Transformer(config).apply({"params": params}, tokens)`` gives the
      HF model's logits, the same with and without a mesh. Shapes: ``embed/embedding`` [V, D],
      ``q_proj`` [D, N, H], ``o_proj`` [N, H, D], ``mlp/gate`` [D, F], ``lm_head`` [D, V] etc.

    Raises:
      FileNotFoundError: no config.json or no weights.
      ValueError: a setting or tensor with no exact equivalent; a missing, unexpected or
        misshapen tensor, a quantised value not finite, an unreadable file (all named); an FP8
        ``quantization_config`` it does not read; a param the mesh cannot split evenly.
    """
    _safetensors()  # the ImportError with install advice, before any work
    if dtype is not None:
        dtype = _dtype_name(dtype)
    path = Path(path)
    config, hf_config = _read_config(path)
    if scan_layers:
        config = config.replace(scan_layers=True)
    files = _weight_files(path)
    config, dropped = deepseek.mtp_modules(config, files, mtp_depth, path)
    if dropped:
        logger.info("dropped the multi-token prediction modules of %s (%d tensors): "
                    "mtp_depth=0", path, len(dropped))
    mtp_embeds = deepseek.mtp_embeddings(config)
    specs = llama4.prefixed(_tensors(config, hf_config["model_type"],
                                     moe.stacked_experts(files)), hf_config)
    unused = moe.unused_tensors(config, hf_config["model_type"])

    expected = {s.hf_name for s in specs} | set(unused)
    packed = {**mxfp4.packed_tensors(hf_config, expected, files),  # read as their values
              **fp8.packed_tensors(hf_config, expected, files)}
    expected = (expected - set(packed)) | {part for p in packed.values() for part in p.parts}
    # Llama's attention_bias also biases o_proj, which we lack: accept only zero biases.
    o_biases = ([f"model.layers.{i}.self_attn.o_proj.bias" for i in range(config.n_layers)]
                if hf_config["model_type"] == "llama" and config.qkv_bias else [])
    tied_head = "lm_head.weight" if config.tie_embeddings and "lm_head.weight" in files else None
    table = (config.vocab_size, config.d_model)
    shapes = {**unused, **dict.fromkeys(o_biases, (config.d_model,)),  # checked, not loaded
              **dict.fromkeys([tied_head] if tied_head else [], table),
              **dict.fromkeys(mtp_embeds, table)}
    missing = sorted((expected | set(shapes)) - set(files))
    if missing:
        raise ValueError(f"checkpoint in {path} is missing tensors: {_names(missing)}")
    known = expected | set(shapes) | dropped
    unexpected = sorted(n for n in files if n not in known and not _IGNORED_TENSOR.match(n)
                        and n.startswith(hf_config.get(llama4.PREFIX_KEY, "")))
    if unexpected:
        raise ValueError(f"checkpoint in {path} has unexpected tensors: {_names(unexpected)}")

    with ExitStack() as stack:
        handles = {file: stack.enter_context(_open_safetensors(file))
                   for file in sorted(set(files.values()))}
        reader = _Reader(files, handles, packed)
        stored = {reader.check(s.hf_name, s.stored_shape) for s in specs} - {None}
        for name, shape in shapes.items():
            reader.check(name, shape)
        if dtype is None:
            dtype = stored.pop() if len(stored) == 1 else "float32"
        config = config.replace(param_dtype=dtype, dtype=dtype)
        shardings = None if mesh is None else param_shardings(config, mesh, rules)  # early

        for name in o_biases:
            if np.any(reader.whole(name) != 0):
                raise ValueError(f"tensor {name} is a nonzero o_proj bias, which is not "
                                 "supported (Llama attention_bias=True with o_proj bias)")
        if tied_head is not None and not _same_rows(reader, tied_head,
                                                    "model.embed_tokens.weight"):
            raise ValueError("tie_word_embeddings=True but lm_head.weight differs from "
                             "model.embed_tokens.weight")
        for name in mtp_embeds:
            if not _same_rows(reader, name, "model.embed_tokens.weight"):
                raise ValueError(f"{name} differs from model.embed_tokens.weight (the "
                                 "multi-token prediction modules share the main token table)")

        params = _load_params(config, specs, reader, shardings)
    logger.info("loaded %s checkpoint from %s: %d layers, %s%s", hf_config["model_type"], path,
                config.n_layers, dtype, "" if mesh is None else f", sharded over {mesh.shape}")
    return config, params


def stored_mtp_modules(path: str | Path, config: ModelConfig) -> ModelConfig:
    """``config`` (a HF checkpoint's, ``config_from_hf``) with the ``mtp_depth`` its weights
    hold (``deepseek.stored_mtp_depth``, from the safetensors headers or index only)."""
    if not config.mtp_depth:
        return config
    return config.replace(mtp_depth=deepseek.stored_mtp_depth(config, _weight_files(Path(path))))


def _same_rows(reader: _Reader, a: str, b: str, chunk_bytes: int = 1 << 26) -> bool:
    """Whether two [V, D] tensors are equal, compared a chunk of rows at a time."""
    shape = reader.handles[reader.files[a]].get_slice(a).get_shape()
    rows = max(1, chunk_bytes // (4 * math.prod(shape[1:])))
    ends = [(i, min(i + rows, shape[0])) for i in range(0, shape[0], rows)]
    return all(np.array_equal(reader.rows(a, i, j), reader.rows(b, i, j)) for i, j in ends)


def _load_params(config: ModelConfig, specs: list[_Tensor], reader: _Reader,
                 shardings: Any) -> Params:
    """Every param read from the files, whole (``shardings`` None) or shard by shard, its
    tensors' blocks stacked over its leading dimensions (scanned layers [R, ...], experts)."""
    dtype = jnp.dtype(config.param_dtype)
    layers: dict[tuple[str, ...], list[_Tensor]] = {}
    places = scanned_places(config) if config.scan_layers else {}
    repeats: dict[tuple[str, ...], int] = {}  # parts per stacked param
    for s in sorted(specs, key=lambda s: places.get(s.path[0], ((), 0))[1]):  # r in order
        path = (*places[s.path[0]][0], *s.path[1:]) if s.path[0] in places else s.path
        repeats[path] = repeats.get(path, 0) + (s.path[0] in places)
        layers.setdefault(path, []).append(s)
    by_path = None if shardings is None else dict(_flatten(shardings))
    if by_path is not None and set(by_path) != set(layers):  # a bug here: model and HF differ
        raise AssertionError(f"param paths differ: {sorted(set(by_path) ^ set(layers))}")

    def block(reader: _Reader, parts: list[_Tensor], lead: tuple[int, ...],
              index: tuple[slice, ...]) -> np.ndarray:  # parts row-major over ``lead``
        if not lead:
            return reader.block(parts[0], index).astype(dtype, copy=False)
        start, stop, _ = index[0].indices(lead[0])
        step = len(parts) // lead[0]
        return np.stack([block(reader, parts[i * step:(i + 1) * step], lead[1:], index[1:])
                         for i in range(start, stop)])

    params: dict[str, Any] = {}
    for key, parts in layers.items():
        lead = (((repeats[key] // (1 if parts[0].stack is None else parts[0].stack[1]),)
                 if repeats[key] else ())
                + (() if parts[0].stack is None else (parts[0].stack[1],)))
        shape = lead + parts[0].shape
        with reader.reopened([p.hf_name for p in parts]) as fresh:
            if by_path is None:
                # device_put, not jnp.asarray: that compiles a (copy) program per shape
                value = jax.device_put(block(fresh, parts, lead, (slice(None),) * len(shape)))
            else:
                sharding = by_path[key]
                shards = [jax.device_put(block(fresh, parts, lead, index), device) for
                          device, index in sharding.addressable_devices_indices_map(shape).items()]
                value = jax.make_array_from_single_device_arrays(shape, sharding, shards)
        _set_path(params, key, value)
    return params


def save(config: ModelConfig, params: Params, path: str | Path, *,
         tokenizer: TextTokenizer | None = None, max_shard_bytes: int | None = None,
         model_type: str | None = None, mxfp4_experts: bool = False,
         fp8_block: tuple[int, int] | None = None) -> None:
    """Writes a HF checkpoint directory that ``load`` and transformers' ``from_pretrained`` read.

    The layout is the family ``config_to_hf`` picks, or ``model_type``'s; tensors keep the
    params' dtype. An existing ``path`` is replaced only once the new export is complete; its
    files but weights and ``config.json`` (and tokenizer files, with a ``tokenizer``) are kept.
    With a tokenizer, ``config.json`` and ``generation_config.json`` carry its bos/eos/pad ids.

    Args:
      config: the model config.
      params: unrolled or scanned params of ``config``, plain or sharded arrays.
      path: the directory (created if needed).
      tokenizer: the model's tokenizer; ``tokenizer.save(path)`` writes its files.
      max_shard_bytes: write shards of at most this size (a larger tensor gets its own) and
        ``model.safetensors.index.json``.
      model_type: the HF model type to write (one of ``ARCHITECTURES``); None picks it.
      mxfp4_experts: store GPT-OSS's experts in MXFP4 (``hf.mxfp4.quantize``).
      fp8_block: store the layers' projection weights in FP8 with [B0, B1] block scales
        (``hf.fp8.quantize``; DeepSeek-V3: (128, 128)); not for GPT-OSS, Llama 4 or MXFP4.

    Raises:
      ValueError: the config has no HF equivalent, or params are missing, unexpected or
        misshapen (named).
      OSError: writing failed (the previous export, if any, is unchanged).
    """
    st = _safetensors()
    hf_config = config_to_hf(config, model_type)
    if mxfp4_experts and mxfp4.METHOD not in FAMILIES[hf_config["model_type"]].quant_methods:
        raise ValueError(f"HF {hf_config['model_type']} checkpoints have no MXFP4 experts "
                         "(only gpt_oss's)")
    if fp8_block is not None:
        _check_fp8_export(hf_config, fp8_block, mxfp4_experts)
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
    if is_scanned(params):
        params = unstack_blocks(params)
    flat = {"/".join(p): v for p, v in _flatten(params)}
    specs = _tensors(config, hf_config["model_type"])
    wanted = {"/".join(s.path) for s in specs}
    missing = sorted(wanted - set(flat))
    if missing:
        raise ValueError(f"params lack {_names(missing)} for this config")
    unexpected = sorted(set(flat) - wanted)
    if unexpected:
        raise ValueError(f"params have entries this config does not use: {_names(unexpected)}")

    tensors: dict[str, np.ndarray] = {}
    host: dict[str, np.ndarray] = {}  # the last param read (its experts' specs follow it)
    for s in specs:
        key = "/".join(s.path)
        value = host[key] if key in host else np.asarray(jax.device_get(flat[key]))
        host = {key: value}
        if value.shape != s.param_shape:
            raise ValueError(f"param {key} has shape {list(value.shape)}, expected "
                             f"{list(s.param_shape)}")
        part = s.to_hf(value if s.stack is None else value[s.stack[0]])
        if s.interleave is not None:  # its entries alternate with the other parts'
            part = s.place(tensors.get(s.hf_name), part)
        elif s.rows is not None and s.hf_name in tensors:  # the next rows of a fused tensor
            part = np.concatenate([tensors[s.hf_name], part], axis=s.axis)
        tensors[s.hf_name] = np.ascontiguousarray(part)
    for name in deepseek.mtp_embeddings(config):  # copies of the main token table
        tensors[name] = tensors["model.embed_tokens.weight"].copy()
    for name, shape in moe.unused_tensors(config, hf_config["model_type"]).items():
        tensors[name] = np.zeros(shape, jnp.dtype(config.param_dtype))
    if mxfp4_experts:
        for name in [name for name in tensors if mxfp4.packable(name)]:
            tensors[name + "_blocks"], tensors[name + "_scales"] = mxfp4.quantize(
                tensors.pop(name), name)
        hf_config["quantization_config"] = mxfp4.CONFIG
    if fp8_block is not None:
        for name in [n for n, t in tensors.items() if fp8.quantizable(n, t.shape)]:
            tensors[name], tensors[name + fp8.SCALE_SUFFIX] = fp8.quantize(
                tensors[name], fp8_block, name)
        hf_config["quantization_config"] = fp8.config(fp8_block)

    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    total = sum(t.nbytes for t in tensors.values())
    for name, tensor in tensors.items():
        if max_shard_bytes is not None and shards[-1] and size + tensor.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += tensor.nbytes

    ids = {} if tokenizer is None else {
        f"{k}_token_id": int(i) for k, i in (("bos", tokenizer.bos_id), ("eos", tokenizer.eos_id),
                                            ("pad", tokenizer.pad_id)) if i is not None and i >= 0}
    hf_config.update(ids)
    path = Path(path)
    keep = _not_weights if tokenizer is None else (lambda name: not is_saved_file(name))
    with replacing_directory(path, carry_over=keep) as new:
        metadata = {"format": "pt"}  # transformers requires it on safetensors files
        n = len(shards)
        files = [SINGLE_FILE] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors"
                                              for i in range(1, n + 1)]
        weight_map = {}
        for file, shard in zip(files, shards, strict=True):
            st.numpy.save_file(shard, str(new / file), metadata=metadata)
            set_default_mode(new / file)  # not safetensors' 0o600: the mode open() gives
            weight_map.update(dict.fromkeys(shard, file))
        if n > 1:
            (new / INDEX_FILE).write_text(json.dumps(
                {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        (new / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
        if tokenizer is not None:
            tokenizer.save(new)
            (new / GENERATION_CONFIG_FILE).write_text(
                json.dumps(ids, indent=2, sort_keys=True) + "\n")
    logger.info("saved %s checkpoint to %s: %d file(s), %.1f MiB", hf_config["model_type"], path,
                len(shards), total / 2**20)


def _check_fp8_export(hf_config: dict[str, Any], block: tuple[int, int], mxfp4_experts: bool
                      ) -> None:
    """Refuses an FP8 export ``save`` cannot write as its family's checkpoints would be."""
    model_type = hf_config["model_type"]
    if mxfp4_experts:
        raise ValueError("an export is either MXFP4 or FP8, not both (one quantization_config)")
    if fp8.METHOD not in FAMILIES[model_type].quant_methods:
        why = ("its experts are MXFP4 (--mxfp4)" if mxfp4.METHOD in
               FAMILIES[model_type].quant_methods else "its experts are 3-D fused tensors")
        raise ValueError(f"HF {model_type} checkpoints are not block-scaled FP8: {why}")
    fp8.block_size(fp8.config(tuple(block)))  # (two positive ints)


def is_saved_file(name: str) -> bool:
    """Whether ``save`` writes (or replaces) a file of this name: weights, ``config.json``,
    ``generation_config.json`` and tokenizer files."""
    return not _not_weights(name) or name in _TOKENIZER_FILES


def _not_weights(name: str) -> bool:
    """Whether an old export's file is kept by ``save`` (everything but weights and config)."""
    return not (name in (SINGLE_FILE, INDEX_FILE, CONFIG_FILE) or _SHARD_FILE.match(name))


__all__ = ["ARCHITECTURES", "config_from_hf", "config_to_hf", "is_saved_file", "load", "save"]

