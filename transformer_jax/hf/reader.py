"""Reading a checkpoint's safetensors files: headers, whole tensors, rows and blocks of them,
and MXFP4-packed tensors as their dequantised values (``hf.mxfp4``). Errors name the file or the
tensor. ``transformer_jax.hf.load`` builds on it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from transformer_jax.hf import mxfp4
from transformer_jax.hf.tensors import _Tensor

# safetensors dtype codes we read, and the ModelConfig dtype names they become.
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


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

    ``packed`` names the tensors stored as MXFP4 (name -> its blocks' and scales' names, which
    ``files`` maps): they are read as their float32 values, never as stored.
    """

    def __init__(self, files: dict[str, Path], handles: dict[Path, Any],
                 packed: Mapping[str, tuple[str, str]] | None = None) -> None:
        self.files = files
        self.handles = handles
        self.packed = dict(packed or {})
        self.stored = {file: set(handle.keys()) for file, handle in handles.items()}

    def check(self, name: str, shape: tuple[int, ...]) -> str | None:
        """Checks a tensor's presence, shape and dtype from the header; returns its dtype name
        (None for an MXFP4 tensor, whose parts' shapes and uint8 dtype it checks)."""
        if name in self.packed:
            for part, part_shape in zip(self.packed[name], mxfp4.packed_shapes(name, shape),
                                        strict=True):
                code = self._header(part, part_shape)
                if code != mxfp4.DTYPE_CODE:
                    raise ValueError(f"tensor {part} has dtype {code}, expected "
                                     f"{mxfp4.DTYPE_CODE} (MXFP4)")
            return None
        code = self._header(name, shape)
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
        """A reader over fresh handles of the files holding ``names``, closed on exit.

        Pages of a memory-mapped file count in the process's resident set while it stays
        mapped; reopening per param and closing after lets them go, so a load never keeps
        the whole file resident on top of the arrays it built.
        """
        files = {part: self.files[part] for name in names
                 for part in self.packed.get(name, (name,))}
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
        (of an MXFP4 tensor: the 32-value blocks covering it, dequantised)."""
        name = spec.hf_name
        if name in self.packed:
            def part(stored: str) -> mxfp4.Read:
                return lambda i: self._guard(stored, lambda handle: handle.get_slice(stored)[i])

            blocks, scales = self.packed[name]
            return spec.read(mxfp4.Packed(name, spec.stored_shape, part(blocks), part(scales)),
                             index)
        return self._guard(name, lambda handle: spec.read(handle.get_slice(name), index))

    def _guard(self, name: str, read: Callable[[Any], np.ndarray]) -> np.ndarray:
        file = self.files[name]
        try:
            return read(self.handles[file])
        except Exception as e:  # data cut short or unreadable
            raise ValueError(f"{file}: tensor {name} is unreadable ({_first_line(e)}); the file "
                             "may be truncated or corrupt") from None
