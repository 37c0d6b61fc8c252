"""MXFP4 tensors of HF checkpoints (GPT-OSS's published experts), read as their exact values.

A tensor ``X`` [..., I, O] (in-first) is stored as ``X_blocks`` [..., O, I/32, 16] (two e2m1
values a byte, low nibble first) and ``X_scales`` [..., O, I/32] (e8m0 ``s``): its value is
``e2m1 * 2^(s-127)``, transposed (docs/models.md). Pure numpy, no file I/O: ``Packed`` reads
any block of the value through two reading functions, reading only the blocks it needs.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np

from transformer_jax.hf.tensors import Packing, PartLayout, Read

METHOD = "mxfp4"
BLOCK = 32  # values per block (and per scale)
SCALE_BIAS = 127  # e8m0: the scale byte s is 2^(s - 127); 255 is NaN
DTYPE_CODE = "U8"  # both parts' safetensors dtype
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"
# The tensors transformers' MXFP4 quantizer packs (``Mxfp4HfQuantizer.serialized_names``).
_PACKABLE = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")
#: ``config.json``'s ``quantization_config`` of an MXFP4 export: the published GPT-OSS one.
CONFIG = {"quant_method": METHOD, "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
#: The 16 fp4 e2m1 values by code (sign bit, 2 exponent bits of bias 1, 1 mantissa bit).
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
# A byte's two values (low nibble first) as one 8-byte item, so one gather decodes a byte; and
# each scale byte's 2^(s - 127) (255: inf, refused).
_BYTES = np.arange(256)
_PAIRS = np.stack([E2M1[_BYTES & 0x0F], E2M1[_BYTES >> 4]], -1).view(np.uint64)[:, 0]
with np.errstate(over="ignore"):
    _SCALES = np.exp2(_BYTES - SCALE_BIAS).astype(np.float32)


def dequantize(blocks: np.ndarray, scales: np.ndarray, name: str = "tensor") -> np.ndarray:
    """MXFP4 blocks and scales -> their float32 values, exactly.

    Args:
      blocks: uint8 [..., G, 16], two e2m1 codes a byte (low nibble first).
      scales: uint8 [..., G], one e8m0 scale a block.
      name: the tensor, for the error.

    Returns:
      float32 [..., G * 32]: ``E2M1[code] * 2^(scale - 127)``, block by block (not transposed).

    Raises:
      ValueError: a value is not finite (a NaN scale 255, or past float32's range), naming it.
    """
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
    out = _PAIRS[blocks].view(np.float32)  # [..., G, 32]
    with np.errstate(over="ignore", invalid="ignore"):  # refused below
        out *= _SCALES[scales][..., None]  # exact: a power of two, in place
    if not np.all(np.isfinite(out)):
        raise ValueError(f"tensor {name} has MXFP4 values that are not finite (a scale byte of "
                         "255, e8m0's NaN, or values past float32's range)")
    return out.reshape(*blocks.shape[:-2], -1)


def quantize(value: np.ndarray, name: str = "tensor") -> tuple[np.ndarray, np.ndarray]:
    """A tensor's value -> its MXFP4 blocks and scales, as the OCP MX spec converts: a block's
    scale is ``2^(floor(log2 amax) - 2)``, each value the nearest e2m1 (ties to the even code;
    above 6: 6), so values MXFP4 holds come back exactly.

    Args:
      value: [..., I, O] (I a multiple of 32), finite.
      name: the tensor, for errors.

    Returns:
      ``(blocks, scales)``: uint8 [..., O, I/32, 16] and [..., O, I/32].

    Raises:
      ValueError: I is not a multiple of 32, or a value is not finite (named).
    """
    blocks_shape, scales_shape = packed_shapes(name, value.shape)
    if value.ndim > 2:  # one leading index (an expert) at a time: small temporaries
        blocks, scales = np.empty(blocks_shape, np.uint8), np.empty(scales_shape, np.uint8)
        for i in range(value.shape[0]):
            blocks[i], scales[i] = quantize(value[i], name)
        return blocks, scales
    x = np.asarray(value, np.float32).T
    if not np.all(np.isfinite(x)):
        raise ValueError(f"tensor {name} has values that are not finite; MXFP4 cannot hold them")
    x = x.reshape(*x.shape[:-1], -1, BLOCK)
    amax = np.abs(x).max(-1)
    exponent = np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - 2
    exponent = np.clip(np.where(amax > 0, exponent, -SCALE_BIAS), -SCALE_BIAS, SCALE_BIAS)
    magnitude = np.abs(x) / np.exp2(exponent)[..., None]
    grid = E2M1[:8]
    low = np.clip(np.searchsorted(grid, magnitude, side="right") - 1, 0, 7)
    high = np.minimum(low + 1, 7)
    above = magnitude - grid[low] > grid[high] - magnitude
    tie = (magnitude - grid[low] == grid[high] - magnitude) & (low % 2 == 1)
    codes = np.where(above | tie, high, low).astype(np.uint8) | (np.signbit(x) << 3).astype(
        np.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.astype(np.uint8), (exponent + SCALE_BIAS).astype(np.uint8)


def packed_shapes(name: str, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of ``name``'s ``_blocks`` and ``_scales`` for its value's ``shape`` [..., I, O].

    Raises:
      ValueError: I is not a multiple of 32, naming the tensor.
    """
    *lead, n_in, n_out = shape
    if n_in % BLOCK:
        raise ValueError(f"tensor {name} cannot be MXFP4: its input width {n_in} is not a "
                         f"multiple of {BLOCK}")
    groups = n_in // BLOCK
    return (*lead, n_out, groups, BLOCK // 2), (*lead, n_out, groups)


def packable(name: str) -> bool:
    """Whether MXFP4 checkpoints store a tensor packed (the experts' projections)."""
    return _PACKABLE.search(name) is not None


def packed_tensors(hf_config: Mapping[str, Any], names: Collection[str],
                   stored: Collection[str]) -> dict[str, Packing]:
    """The tensors of ``names`` an MXFP4 checkpoint stores packed (``stored`` as blocks and
    scales only): name -> its ``Packing``; empty unless the checkpoint is MXFP4."""
    quant = hf_config.get("quantization_config")
    if not isinstance(quant, Mapping) or quant.get("quant_method") != METHOD:
        return {}
    return {name: _packing(name) for name in sorted(names)
            if packable(name) and name not in stored
            and (name + BLOCKS_SUFFIX in stored or name + SCALES_SUFFIX in stored)}


def _packing(name: str) -> Packing:
    def layout(shape: tuple[int, ...]) -> PartLayout:
        return tuple((part, frozenset({DTYPE_CODE})) for part in packed_shapes(name, shape))

    return Packing(METHOD, (name + BLOCKS_SUFFIX, name + SCALES_SUFFIX), layout,
                   lambda shape, reads: Packed(name, shape, *reads))


class Packed:
    """An MXFP4 tensor seen as its float32 value [..., I, O], indexable by step-1 slices on I
    (steps allowed on the others): ``packed[index]`` reads the blocks and scales covering
    ``index`` and returns ``value[index]``.

    Args:
      name: the tensor (``X``, without the suffixes), for errors.
      shape: its value's shape [..., I, O].
      blocks: index over ``_blocks``' shape -> that uint8 block.
      scales: index over ``_scales``' shape -> that uint8 block.
    """

    def __init__(self, name: str, shape: tuple[int, ...], blocks: Read, scales: Read) -> None:
        packed_shapes(name, shape)  # (checks I)
        self.name, self.shape, self._blocks, self._scales = name, tuple(shape), blocks, scales

    def __getitem__(self, index: tuple[slice, ...]) -> np.ndarray:
        *lead, rows, cols = index
        start, stop, step = rows.indices(self.shape[-2])
        if step != 1:
            raise ValueError(f"tensor {self.name}: MXFP4 reads take step-1 input slices")
        stop = max(start, stop)
        first, last = start // BLOCK, math.ceil(stop / BLOCK)
        part = (*lead, cols, slice(first, last))
        values = dequantize(self._blocks((*part, slice(None))), self._scales(part), self.name)
        values = values[..., start - first * BLOCK:stop - first * BLOCK]
        return np.swapaxes(values, -1, -2)


__all__ = ["BLOCK", "CONFIG", "E2M1", "METHOD", "Packed", "dequantize", "packable",
           "packed_shapes", "packed_tensors", "quantize"]
