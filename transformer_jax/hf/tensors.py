"""One HF tensor and the param (or part of a param) it becomes (``_Tensor``), the layouts every
family's tensors are built from, and the param tree's path helpers. Pure, no file I/O."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """One HF tensor and the param it becomes.

    Every mapping is a reshape then a transpose: the HF array [hf_shape] is viewed as [split],
    then transposed by ``perm``, so ``read`` can fetch any block of our array from the file.

    Attributes:
      hf_name: the safetensors key.
      path: the param's path in the unrolled tree.
      hf_shape: shape in the HF checkpoint.
      split: ``hf_shape`` with merged dimensions split apart.
      groups: how many split dimensions each HF dimension holds.
      perm: the transpose from ``split`` to our layout (our dimension k is ``split[perm[k]]``).
      rows: for one part of a fused tensor (Phi-3's ``qkv_proj``), (its first index, the
        fused tensor's size) on HF dimension ``axis``; ``hf_shape`` is the part's.
      axis: the HF dimension ``rows`` indexes.
      stack: for one of several HF tensors stacked into one param (experts stored one by
        one), (its index, their number): ``shape`` is then the slice ``param[index]``.
      interleave: for one part of a tensor whose parts alternate on HF dimension ``axis``
        (GPT-OSS's ``gate_up_proj``), (index, count): the part is entries ``index::count``.
    """

    hf_name: str
    path: tuple[str, ...]
    hf_shape: tuple[int, ...]
    split: tuple[int, ...]
    groups: tuple[int, ...]
    perm: tuple[int, ...]
    rows: tuple[int, int] | None = None
    axis: int = 0
    stack: tuple[int, int] | None = None
    interleave: tuple[int, int] | None = None

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """Shape of the tensor in the file (the whole fused tensor for a part)."""
        if self.interleave is None and self.rows is None:
            return self.hf_shape
        a = self.axis
        size = self.rows[1] if self.interleave is None else self.hf_shape[a] * self.interleave[1]
        return (*self.hf_shape[:a], size, *self.hf_shape[a + 1:])

    def place(self, stored: np.ndarray | None, part: np.ndarray) -> np.ndarray:
        """The stored tensor with this interleaved part written in (``stored`` None: zeros
        of ``stored_shape`` first)."""
        out = np.zeros(self.stored_shape, part.dtype) if stored is None else stored
        index, count = self.interleave
        np.moveaxis(out, self.axis, 0)[index::count] = np.moveaxis(part, self.axis, 0)
        return out

    @property
    def row_range(self) -> tuple[int, int]:
        """(start, stop) of this part's rows in the stored tensor's dimension ``axis``."""
        start = 0 if self.rows is None else self.rows[0]
        return start, start + self.hf_shape[self.axis]

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape in our tree (of this tensor's slice, for a ``stack`` part)."""
        return tuple(self.split[p] for p in self.perm)

    @property
    def param_shape(self) -> tuple[int, ...]:
        """Shape of the whole param this tensor is (or is a slice of) in the unrolled tree."""
        return self.shape if self.stack is None else (self.stack[1], *self.shape)

    def to_ours(self, x: np.ndarray) -> np.ndarray:
        """HF array [hf_shape] -> our array [shape]."""
        return x.reshape(self.split).transpose(self.perm)

    def to_hf(self, x: np.ndarray) -> np.ndarray:
        """Our array [shape] -> HF array [hf_shape]."""
        return x.transpose(np.argsort(self.perm)).reshape(self.hf_shape)

    def read(self, tensor: Any, index: tuple[slice, ...]) -> np.ndarray:
        """The block ``ours[index]`` read from the HF tensor, and nothing much more.

        Args:
          tensor: indexable by a tuple of slices over ``stored_shape`` (safetensors'
            ``get_slice``, a ``Packing`` view), returning a numpy array.
          index: one step-1 slice per dimension of our layout (``shape``).

        Returns:
          ``to_ours(hf)[index]``, reading just that block when the inner dimensions of each
          merged HF dimension (head_dim) are whole, as every sharding rule keeps them.
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
            offset = self.row_range[0] if len(hf_index) == self.axis else 0
            if self.interleave is not None and len(hf_index) == self.axis:
                index, count = self.interleave  # (``axis`` is one split dimension)
                first = start * count + index  # stop at the last entry read (in bounds)
                hf_index.append(slice(first, first + max(0, (stop - start - 1) * count + 1),
                                      count))
                block_shape.append(stop - start)
                inner.append(slice(None))
                continue
            hf_index.append(slice(start * rest + offset, stop * rest + offset))
            block_shape += [stop - start, *(self.split[d] for d in dims[1:])]
            inner += [slice(None), *(slice(*ranges[d]) for d in dims[1:])]
        block = np.asarray(tensor[tuple(hf_index)])
        return block.reshape(block_shape)[tuple(inner)].transpose(self.perm)


#: A reading function over one stored tensor: a tuple of slices -> that block, as stored.
Read = Callable[[tuple[slice, ...]], np.ndarray]
#: Each stored part's shape and the safetensors dtype codes it may have.
PartLayout = tuple[tuple[tuple[int, ...], frozenset[str]], ...]


@dataclasses.dataclass(frozen=True)
class Packing:
    """How a quantised checkpoint stores one HF tensor as several (``hf.mxfp4``'s blocks and
    scales, ``hf.fp8``'s e4m3 weight and block scales), read back as its float32 value.

    Attributes:
      method: the ``quantization_config`` method (for errors).
      parts: the stored tensors' names, in the order ``layout`` and ``view`` take them.
      layout: the tensor's (value's) shape -> each part's shape and accepted dtype codes;
        raises ValueError, naming the tensor, for a shape the format cannot hold.
      view: (the value's shape, one ``Read`` per part) -> an object that a tuple of slices
        indexes as a safetensors slice, giving that block of the value as float32.
    """

    method: str
    parts: tuple[str, ...]
    layout: Callable[[tuple[int, ...]], PartLayout]
    view: Callable[[tuple[int, ...], Sequence[Read]], Any]


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


def _fused(specs: list[_Tensor], hf_name: str, axis: int = 0) -> list[_Tensor]:
    """``specs`` as consecutive ranges on HF dimension ``axis`` of one tensor ``hf_name``."""
    total, out = sum(s.hf_shape[axis] for s in specs), []
    for s in specs:
        start = sum(p.hf_shape[axis] for p in out)
        out.append(dataclasses.replace(s, hf_name=hf_name, rows=(start, total), axis=axis))
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
