"""Reading a checkpoint's safetensors files: headers, whole tensors, rows and blocks of them,
and quantised tensors (``tensors.Packing``) as their dequantised values; errors name the file or
the tensor. Float8 tensors, which numpy lacks, are read from the memory-mapped bytes.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from transformer_jax.hf.tensors import Packing, Read, _Tensor

# safetensors dtype codes we read, and the ModelConfig dtype names they become.
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
# Codes safetensors' numpy reader cannot read (numpy has no such dtype): read from the bytes.
_RAW = {"F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2)}


def _safetensors() -> Any:
    try:
        import safetensors
        import safetensors.numpy  # noqa: F401  (loads the numpy save/load API)
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("transformer_jax.hf needs the 'hf' extra: pip install "
                          "'transformer_jax[hf]' (safetensors)") from e
    return safetensors


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


class _Reader:
    """Reads tensors, or blocks of them, from open safetensors files; errors name the file.
    ``packed`` (name -> ``Packing``) are read as their float32 values, never as stored."""

    def __init__(self, files: dict[str, Path], handles: dict[Path, Any],
                 packed: Mapping[str, Packing] | None = None) -> None:
        self.files = files
        self.handles = handles
        self.packed = dict(packed or {})
        self.stored = {file: set(handle.keys()) for file, handle in handles.items()}
        self._headers: dict[Path, tuple[int, dict[str, Any]]] = {}  # (data offset, header)

    def check(self, name: str, shape: tuple[int, ...]) -> str | None:
        """Checks a tensor's presence, shape and dtype from the header; returns its dtype name
        (None for a quantised tensor, whose parts' shapes and dtypes it checks)."""
        if name in self.packed:
            packing = self.packed[name]
            for part, (part_shape, codes) in zip(packing.parts, packing.layout(shape),
                                                 strict=True):
                code = self._header(part, part_shape)
                if code not in codes:
                    raise ValueError(f"tensor {part} has dtype {code}, expected "
                                     f"{' or '.join(sorted(codes))} ({packing.method})")
            return None
        code = self._header(name, shape)
        if code in _RAW:
            raise ValueError(f"tensor {name} is {code} without block scales "
                             f"({name}_scale_inv) and a quantization_config of quant_method "
                             "'fp8' naming them; only block-scaled FP8 checkpoints are read")
        if code not in _SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {name} has unsupported dtype {code}; supported: "
                             f"{sorted(_SAFETENSORS_DTYPES)}")
        return _SAFETENSORS_DTYPES[code]

    def _header(self, name: str, shape: tuple[int, ...]) -> str:
        """A stored tensor's safetensors dtype code, once its presence and shape are checked."""
        file = self.files[name]
        if name not in self.stored[file]:
            raise ValueError(f"tensor {name} is not in {file.name} as the index says")
        info = self.handles[file].get_slice(name)
        found = tuple(info.get_shape())
        if found != shape:
            raise ValueError(f"tensor {name} has shape {list(found)}, expected {list(shape)}")
        return info.get_dtype()

    @contextlib.contextmanager
    def reopened(self, names: Sequence[str]) -> Iterator[_Reader]:
        """A reader over fresh handles of the files holding ``names``, closed on exit: a
        memory-mapped file's pages stay resident while it is mapped, so a load reopens per param
        and never keeps the whole file resident on top of the arrays it built."""
        files = {part: self.files[part] for name in names
                 for part in (self.packed[name].parts if name in self.packed else (name,))}
        with ExitStack() as stack:
            handles = {file: stack.enter_context(_open_safetensors(file))
                       for file in sorted(set(files.values()))}
            yield _Reader(files, handles, {n: self.packed[n] for n in names if n in self.packed})

    def whole(self, name: str) -> np.ndarray:
        """The whole tensor, as stored."""
        return self._guard(name, lambda handle: handle.get_tensor(name))

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` of the tensor's first dimension."""
        return self._guard(name, lambda handle: handle.get_slice(name)[start:stop])

    def block(self, spec: _Tensor, index: tuple[slice, ...]) -> np.ndarray:
        """``spec.to_ours(tensor)[index]``, reading only that block from the memory-mapped file
        (of a quantised tensor: the blocks of its parts covering it, dequantised)."""
        name = spec.hf_name
        if name in self.packed:
            packing = self.packed[name]
            reads = [self._slicer(part) for part in packing.parts]
            return spec.read(packing.view(spec.stored_shape, reads), index)
        return self._guard(name, lambda handle: spec.read(self._sliceable(name, handle), index))

    def _slicer(self, name: str) -> Read:
        """A ``Read`` of a stored tensor's blocks, as stored (float8 as ``ml_dtypes``)."""
        return lambda i: self._guard(name, lambda handle: self._sliceable(name, handle)[i])

    def _sliceable(self, name: str, handle: Any) -> Any:
        """The tensor indexable by slices: safetensors' lazy slice, or for a dtype numpy lacks
        (``_RAW``) the memory-mapped bytes viewed as it (only the pages a block touches read)."""
        info = handle.get_slice(name)
        dtype = _RAW.get(info.get_dtype())
        if dtype is None:
            return info
        file = self.files[name]
        if file not in self._headers:
            with open(file, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                self._headers[file] = 8 + size, json.loads(f.read(size))
        data, header = self._headers[file]
        (start, stop), shape = header[name]["data_offsets"], tuple(header[name]["shape"])
        if stop == start:
            return np.zeros(shape, dtype)
        raw = np.memmap(file, np.uint8, "r", offset=data + start, shape=(stop - start,))
        return raw.view(dtype).reshape(shape)

    def _guard(self, name: str, read: Callable[[Any], np.ndarray]) -> np.ndarray:
        file = self.files[name]
        try:
            return read(self.handles[file])
        except Exception as e:  # data cut short or unreadable
            raise ValueError(f"{file}: tensor {name} is unreadable ({_first_line(e)}); the file "
                             "may be truncated or corrupt") from None
