"""Stored layouts as typed leaves: a CPU layout lives in the prepared weights (``OutFirst``,
which ``ops.dense`` computes with) and the cache (``SlotsLast``), not in a flag of the model."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax.numpy as jnp


class Wrapped:
    """A stored matrix ``w`` with more beside it: shape, dtype and ``astype`` are the matrix's."""

    w: Any

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.w.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self) -> jnp.dtype:
        return self.w.dtype

    def astype(self, dtype: Any) -> Any:
        return self.replace(w=self.w.astype(dtype))


@flax.struct.dataclass
class OutFirst(Wrapped):
    """A matrix stored with its output axes first and its input axes last.

    ``w`` holds the in-first matrix (e.g. q_proj [D, N, H]) as [out..., in...] ([N, H, D]),
    after a leading layers axis when stacked; float or quantised. A tied LM head is the [V, D]
    token table as an ``OutFirst`` [D, V] head.
    """

    w: Any


def out_first_order(n: int, n_in: int, lead: int = 0) -> tuple[int, ...]:
    """The permutation from an in-first [lead..., in..., out...] matrix to out-first storage."""
    axes = list(range(n))
    return tuple(axes[:lead] + axes[lead + n_in:] + axes[lead:lead + n_in])


def split_spec(spec: str) -> tuple[str, str, str, str, str]:
    """``"<x>,<w>-><out>"`` -> (x's axes, w's in (shared with x) and out axes, x's own, out)."""
    inputs, out = spec.split("->")
    x_axes, w_axes = inputs.split(",")
    w_in = "".join(a for a in w_axes if a in x_axes)
    w_out = "".join(a for a in w_axes if a not in x_axes)
    rows = "".join(a for a in out if a not in w_out)
    return x_axes, w_in, w_out, rows, out


@flax.struct.dataclass
class SlotsLast:
    """Keys stored with their slots last, [..., H, S], where attention reads [..., S, H].

    A CPU cache layout (``kv_cache``), read as it is by ``ops.attention``. ``k`` is one array,
    or a tuple of them (one per layer); indexing picks a layer and keeps the layout.
    """

    k: Any

    def __getitem__(self, i: Any) -> SlotsLast:
        return SlotsLast(self.k[i])

    @property
    def shape(self) -> tuple[int, ...]:
        """The stored ([..., H, S]) shape."""
        return tuple(self.k.shape)


def stored_keys(keys: Any) -> tuple[Any, bool]:
    """(the stored array(s) of ``keys``, whether they are stored slots last)."""
    return (keys.k, True) if isinstance(keys, SlotsLast) else (keys, False)
