"""The platform a program is traced for (``targeting``, ``platform``; part of jit's cache key):
kernel and layout choices follow it, not the process (a TPU program compiled on a CPU host);
and ``mesh_axes``, the mesh axes the logical rules in context give a dimension."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import jax
from jax.sharding import AxisType

#: The platforms a target may name (``jax.Device.platform``'s values).
PLATFORMS = ("cpu", "gpu", "cuda", "rocm", "tpu")

_TARGET = jax.make_user_context(None)


@contextlib.contextmanager
def targeting(platform: str | None) -> Iterator[None]:
    """Traces inside are for ``platform`` (None: leaves the target as it is).

    Raises:
      ValueError: a platform not in ``PLATFORMS``.
    """
    if platform is None:
        yield
        return
    if platform not in PLATFORMS:
        raise ValueError(f"target platform must be one of {PLATFORMS}, got {platform!r}")
    with _TARGET(platform):
        yield


def platform() -> str:
    """The platform traces are for: ``targeting``'s, else ``jax.default_backend()``."""
    return _TARGET.value or jax.default_backend()


def of_mesh(mesh: Any) -> str | None:
    """The platform of a mesh's devices (None without a mesh)."""
    return None if mesh is None else mesh.devices.flat[0].platform


def mesh_axes(mesh: jax.sharding.AbstractMesh, rule: Any, size: int | None = None
              ) -> tuple[str, ...]:
    """The axes of ``mesh`` of more than one device that a logical rule's value (a name, a
    tuple of names or None) maps to; () when one of them is manual (inside a ``shard_map``)
    or, given ``size``, when they do not divide it."""
    names = () if rule is None else (rule,) if isinstance(rule, str) else tuple(rule)
    names = tuple(a for a in names if a in mesh.axis_names and mesh.shape[a] > 1)
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    if any(types[a] == AxisType.Manual for a in names):
        return ()
    if size is not None and size % math.prod(mesh.shape[a] for a in names):
        return ()
    return names
