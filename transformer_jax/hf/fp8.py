"""Block-scaled FP8 tensors of HF checkpoints (DeepSeek-V3, Kimi K2, Qwen3-*-FP8), read as
their values (the format and what is refused: docs/models.md).

A quantised Linear weight ``X.weight`` [..., O, I] is float8 e4m3fn beside
``X.weight_scale_inv`` [..., ceil(O/B0), ceil(I/B1)]; its value is ``float32(weight) *
scale_inv`` over each B0 x B1 block. Pure numpy, no file I/O: ``Scaled`` reads any block of a
value through two reading functions, reading only the scales it needs.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Mapping
from typing import Any

import ml_dtypes
import numpy as np

from transformer_jax.hf.tensors import Packing, PartLayout, Read

METHOD = "fp8"
FMT = "e4m3"
ACTIVATION_SCHEME = "dynamic"
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E4M3_MAX = 448.0  # e4m3fn's largest finite value
DTYPE_CODE = "F8_E4M3"
SCALE_CODES = frozenset({"F32", "BF16"})
SCALE_SUFFIX = "_scale_inv"
DEFAULT_BLOCK = (128, 128)  # transformers' FineGrainedFP8Config default, and the published one
# The Linear weights an FP8 ``save`` quantises: the attention and FFN projections (experts too).
_QUANTIZABLE = re.compile(r"^model\.layers\.\d+\..*(_proj|_proj_with_mqa|\.w[123])\.weight$")
# The 256 e4m3fn values by byte: a gather decodes 4x faster than ml_dtypes' cast.
_VALUES = np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float32)


def block_size(quant: Mapping[str, Any]) -> tuple[int, int]:
    """The [B0, B1] blocks of an FP8 ``quantization_config``, once the rest of it is checked.

    Raises:
      ValueError: a format, activation scheme or block size that loading does not read.
    """
    fmt = quant.get("fmt", FMT)
    if fmt != FMT:
        raise ValueError(f"FP8 checkpoints with fmt {fmt!r} are not supported (only {FMT!r}, "
                         "e4m3fn with block scales)")
    scheme = quant.get("activation_scheme", ACTIVATION_SCHEME)
    if scheme != ACTIVATION_SCHEME:
        raise ValueError(f"FP8 checkpoints with activation_scheme {scheme!r} are not supported: "
                         "loading dequantises the weights and runs activations unquantised, "
                         "which only 'dynamic' (scales computed at run time) leaves unchanged")
    block = quant.get("weight_block_size", list(DEFAULT_BLOCK))
    if (not isinstance(block, list | tuple) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(f"FP8 weight_block_size must be two positive ints, got {block!r} "
                         "(per-tensor or per-channel FP8 scales are not supported)")
    return int(block[0]), int(block[1])


def config(block: tuple[int, int] = DEFAULT_BLOCK) -> dict[str, Any]:
    """``config.json``'s ``quantization_config`` of an FP8 export with these blocks."""
    return {"quant_method": METHOD, "fmt": FMT, "activation_scheme": ACTIVATION_SCHEME,
            "weight_block_size": list(block)}


def scale_shape(name: str, shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The block grid [..., ceil(O/B0), ceil(I/B1)] of a weight of ``shape`` [..., O, I].

    Raises:
      ValueError: the tensor has fewer than two dimensions (named).
    """
    if len(shape) < 2:
        raise ValueError(f"tensor {name} cannot be block-scaled FP8: it has shape {list(shape)}")
    *lead, rows, cols = shape
    return (*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1]))


def _expand(scales: np.ndarray, rows: np.ndarray, cols: np.ndarray, block: tuple[int, int]
            ) -> np.ndarray:
    """Each entry's block scale: ``scales`` [..., g0, g1] (the grid from ``rows[0]``'s and
    ``cols[0]``'s blocks) at rows x cols -> [..., len(rows), len(cols)]."""
    return _spread(_spread(scales, rows, block[0], -2), cols, block[1], -1)


def _spread(x: np.ndarray, index: np.ndarray, size: int, axis: int) -> np.ndarray:
    """``x`` with each entry repeated ``size`` times on ``axis``, at ``index`` (whose first
    block is ``x``'s first): a slice where ``index`` is one (a copy, not a gather)."""
    x, at = np.repeat(x, size, axis), index - index.min() // size * size
    if at[-1] - at[0] + 1 == at.size:
        return x[(Ellipsis, slice(at[0], at[-1] + 1)) + (slice(None),) * (-1 - axis)]
    return np.take(x, at, axis)


def dequantize(weight: np.ndarray, scales: np.ndarray, block: tuple[int, int],
               name: str = "tensor") -> np.ndarray:
    """e4m3 values and their block scales -> float32 values.

    Args:
      weight: [..., O, I], float8 e4m3fn (``E4M3``).
      scales: [..., ceil(O/B0), ceil(I/B1)] ``scale_inv``, any float dtype.
      block: (B0, B1).
      name: the tensor, for the error.

    Returns:
      float32 [..., O, I]: ``float32(weight) * scales`` over each block.

    Raises:
      ValueError: a value is not finite (e4m3fn's NaN, or a scale that is not finite), named.
    """
    values = _decode(weight)
    rows, cols = np.arange(values.shape[-2]), np.arange(values.shape[-1])
    if not (rows.size and cols.size):
        return values
    return _scaled(values, _expand(np.asarray(scales, np.float32), rows, cols, block), name)


def _decode(weight: np.ndarray) -> np.ndarray:
    """e4m3fn values (any 1-byte view of them) -> float32."""
    return np.take(_VALUES, np.asarray(weight).view(np.uint8))


def _scaled(values: np.ndarray, scales: np.ndarray, name: str) -> np.ndarray:
    """``values *= scales`` (float32, each entry's scale), refusing what is not finite."""
    with np.errstate(over="ignore", invalid="ignore"):  # refused below
        values *= scales
    if not np.all(np.isfinite(values)):
        raise ValueError(f"tensor {name} has FP8 values that are not finite (e4m3fn's NaN, or a "
                         "scale_inv that is not finite)")
    return values


def quantize(value: np.ndarray, block: tuple[int, int], name: str = "tensor"
             ) -> tuple[np.ndarray, np.ndarray]:
    """A weight's value -> e4m3 values and their block scales: each block's ``scale_inv`` is
    ``max|w| / 448`` (1 for an all-zero block), each value rounded to the nearest e4m3.

    Args:
      value: [..., O, I], finite.
      block: (B0, B1).
      name: the tensor, for errors.

    Returns:
      ``(weight, scale_inv)``: e4m3fn [..., O, I] and float32 [..., ceil(O/B0), ceil(I/B1)].

    Raises:
      ValueError: a value is not finite, or the tensor is not at least 2-D (named).
    """
    grid = scale_shape(name, value.shape, block)
    x = np.asarray(value, np.float32)
    if not np.all(np.isfinite(x)):
        raise ValueError(f"tensor {name} has values that are not finite; FP8 cannot hold them")
    *lead, rows, cols = x.shape
    padded = np.zeros((*lead, grid[-2] * block[0], grid[-1] * block[1]), np.float32)
    padded[..., :rows, :cols] = np.abs(x)
    amax = padded.reshape(*lead, grid[-2], block[0], grid[-1], block[1]).max((-3, -1))
    scales = np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1)).astype(np.float32)
    q = x / _expand(scales, np.arange(rows), np.arange(cols), block)
    return np.clip(q, -E4M3_MAX, E4M3_MAX).astype(E4M3), scales


def quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """Whether an FP8 ``save`` stores an HF tensor in FP8: a layer's 2-D projection weight."""
    return len(shape) == 2 and _QUANTIZABLE.match(name) is not None


def packed_tensors(hf_config: Mapping[str, Any], names: Collection[str],
                   stored: Collection[str]) -> dict[str, Packing]:
    """The tensors of ``names`` an FP8 checkpoint stores block-scaled (their ``_scale_inv`` is
    ``stored``): name -> its ``Packing``; empty unless the checkpoint is FP8."""
    quant = hf_config.get("quantization_config")
    if not isinstance(quant, Mapping) or quant.get("quant_method") != METHOD:
        return {}
    block = block_size(quant)
    return {name: _packing(name, block) for name in sorted(names)
            if name + SCALE_SUFFIX in stored}


def _packing(name: str, block: tuple[int, int]) -> Packing:
    def layout(shape: tuple[int, ...]) -> PartLayout:
        return ((shape, frozenset({DTYPE_CODE})), (scale_shape(name, shape, block), SCALE_CODES))

    return Packing(METHOD, (name, name + SCALE_SUFFIX), layout,
                   lambda shape, reads: Scaled(name, shape, block, *reads))


class Scaled:
    """A block-scaled FP8 tensor seen as its float32 value [..., O, I]: ``scaled[index]`` (slices,
    steps allowed) reads that block of the weight and its scales and returns ``value[index]``.

    Args:
      name: the tensor, for errors.
      shape: its shape [..., O, I].
      block: (B0, B1).
      weight: index over ``shape`` -> that e4m3 block.
      scales: index over the block grid -> those scales.
    """

    def __init__(self, name: str, shape: tuple[int, ...], block: tuple[int, int], weight: Read,
                 scales: Read) -> None:
        scale_shape(name, shape, block)  # (checks the rank)
        self.name, self.shape, self.block = name, tuple(shape), block
        self._weight, self._scales = weight, scales

    def __getitem__(self, index: tuple[slice, ...]) -> np.ndarray:
        *lead, rows, cols = index
        r = np.arange(*rows.indices(self.shape[-2]))
        c = np.arange(*cols.indices(self.shape[-1]))
        values = _decode(self._weight(index))
        if not (r.size and c.size):
            return values
        r0, c0 = r.min() // self.block[0], c.min() // self.block[1]
        grid = (*lead, slice(r0, r.max() // self.block[0] + 1),
                slice(c0, c.max() // self.block[1] + 1))
        scales = np.asarray(self._scales(grid), np.float32)
        return _scaled(values, _expand(scales, r, c, self.block), self.name)


__all__ = ["DEFAULT_BLOCK", "E4M3", "E4M3_MAX", "METHOD", "Scaled", "block_size", "config",
           "dequantize", "packed_tensors", "quantizable", "quantize", "scale_shape"]
