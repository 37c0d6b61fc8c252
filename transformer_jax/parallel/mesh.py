"""The device mesh: its axes (data, fsdp, tensor, expert, context), their sizes, and the CPU
devices a host is split into (``parallel/sharding.py`` maps the model onto it)."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import AxisType, Mesh

from transformer_jax.model.config import check_keys

logger = logging.getLogger(__name__)

#: The axes of every mesh without expert parallelism (``MeshConfig.expert == 1``).
MESH_AXES = ("data", "fsdp", "tensor")
#: The axes of a mesh with an ``expert`` axis (``MeshConfig.expert > 1``): inside fsdp, outside
#: tensor (whose per-sublayer all-reduces stay on the closest devices).
EXPERT_MESH_AXES = ("data", "fsdp", "expert", "tensor")
#: The axes of a mesh with a ``context`` axis (``MeshConfig.context > 1``), placed as expert is.
CONTEXT_MESH_AXES = ("data", "fsdp", "context", "tensor")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the ``data``, ``fsdp``, ``tensor``, ``expert`` and ``context`` mesh axes.

    One of data, fsdp and tensor may be -1: all the devices the others leave. The default is
    pure data parallelism over every device.

    Attributes:
      data, fsdp, tensor: replicas holding whole parameters; devices that split parameters and
        optimizer state along the embed axis; devices that split heads, FFN width and vocab.
      expert: devices that split a mixture's experts (E/expert each, tokens routed by
        all_to_all); FSDP devices for every other layer. 1 (the default): no expert axis.
      context: devices that split every sequence (T) of a training batch
        (``parallel.context``); FSDP devices for the weights. 1 (the default): none.
    """

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    expert: int = 1
    context: int = 1

    def __post_init__(self) -> None:
        for name in (*MESH_AXES, "expert", "context"):
            value, free = getattr(self, name), name in MESH_AXES
            if not isinstance(value, int) or isinstance(value, bool) or (
                    value < 1 and not (free and value == -1)):
                allowed = "or -1" if free else "(-1 is for data, fsdp or tensor)"
                raise ValueError(f"mesh.{name} must be a positive int {allowed}, got {value!r}")
        if self.expert > 1 and self.context > 1:
            raise ValueError(f"mesh expert={self.expert} with context={self.context} is not "
                             "supported: split the sequence (context) or the experts (expert)")
        if self.sizes.count(-1) > 1:
            raise ValueError(f"at most one mesh axis may be -1, got {self.describe()}")

    @property
    def axes(self) -> tuple[str, ...]:
        """The mesh's axis names: ``MESH_AXES``, or with an expert or context axis its own."""
        if self.context > 1:
            return CONTEXT_MESH_AXES
        return EXPERT_MESH_AXES if self.expert > 1 else MESH_AXES

    @property
    def sizes(self) -> tuple[int, ...]:
        """The sizes of ``axes`` as configured, -1 included."""
        return tuple(getattr(self, name) for name in self.axes)

    def describe(self) -> str:
        """``"data=2 x fsdp=-1 x tensor=2"``, for messages."""
        return " x ".join(f"{n}={s}" for n, s in zip(self.axes, self.sizes, strict=True))

    def resolve(self, n_devices: int) -> tuple[int, ...]:
        """The concrete sizes of ``axes`` for ``n_devices`` devices.

        Raises:
          ValueError: when the sizes do not multiply to ``n_devices`` (or, with a -1, the fixed
            sizes do not divide it).
        """
        fixed = math.prod(s for s in self.sizes if s != -1)
        if -1 in self.sizes:
            if n_devices % fixed:
                raise ValueError(
                    f"mesh {self.describe()} does not fit {n_devices} devices: the fixed axes "
                    f"need a multiple of {fixed} devices")
            return tuple(n_devices // fixed if s == -1 else s for s in self.sizes)
        if fixed != n_devices:
            raise ValueError(
                f"mesh {self.describe()} needs {fixed} devices but {n_devices} are available; "
                "set one axis to -1 to take the rest")
        return self.sizes

    @classmethod
    def parse(cls, text: str) -> MeshConfig:
        """``"1,8,1"`` -> ``MeshConfig(data=1, fsdp=8, tensor=1)`` (-1 allowed); a fourth size
        is the expert axis (``"-1,1,1,4"``); named sizes may be given in any order, the rest
        taking their defaults (``"expert=4,data=-1"``, ``"context=4,fsdp=2,data=1"``: the
        context axis is only named)."""
        parts = [p.strip() for p in text.split(",")]
        form = ("three sizes data,fsdp,tensor (a fourth: expert) or NAME=SIZE,... (names data, "
                "fsdp, tensor, expert, context)")
        if any("=" in p for p in parts):
            if not all("=" in p for p in parts):
                raise ValueError(f"mesh {text!r} mixes named and plain sizes; use {form}")
            names, values = zip(*(p.split("=", 1) for p in parts), strict=True)
            names = [name.strip() for name in names]
            check_keys(dict.fromkeys(names), cls, "mesh")
            if len(set(names)) != len(names):
                raise ValueError(f"mesh {text!r} names an axis twice")
        else:
            if len(parts) not in (3, 4):
                raise ValueError(f"mesh {text!r} must be {form}")
            names, values = [*MESH_AXES, "expert"][:len(parts)], parts
        try:
            sizes = [int(v) for v in values]
        except ValueError:
            raise ValueError(f"mesh {text!r} must be integer {form}") from None
        return cls(**dict(zip(names, sizes, strict=True)))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> MeshConfig:
        """From a ``[mesh]`` TOML table; unknown keys are an error naming close matches."""
        check_keys(dict(values), cls, "mesh")
        return cls(**values)


def configure_cpu_devices(divides: int | None = None, devices: int = 0) -> int:
    """Splits the host CPU into several XLA devices, one per core, to run a mesh across cores.

    Sets JAX's ``jax_num_cpu_devices`` unless the user chose a count (that option,
    ``JAX_NUM_CPU_DEVICES`` or ``--xla_force_host_platform_device_count`` in ``XLA_FLAGS``);
    only possible before JAX creates its backends (afterwards it logs and changes nothing).

    Args:
      divides: if given, the chosen count is reduced until it divides this (e.g. the batch
        rows); an explicit ``devices`` must divide it.
      devices: the count to use; 0 means one per available core (at most 16).

    Returns:
      The device count set (or 0 if the user chose one or JAX had already started).

    Raises:
      ValueError: ``devices`` is negative, or does not divide ``divides``.
    """
    if not isinstance(devices, int) or devices < 0:
        raise ValueError(f"the CPU device count must be an int >= 0 (0: one per core), got "
                         f"{devices!r}")
    if devices and divides is not None and divides % devices:
        fits = [n for n in range(1, min(divides, 16) + 1) if divides % n == 0]
        raise ValueError(f"{devices} devices do not divide {divides}; use one of {fits}")
    if ("xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")
            or jax.config.jax_num_cpu_devices != -1):
        return 0
    n = devices or min(16, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                       else os.cpu_count() or 1)
    while divides is not None and n > 1 and divides % n:
        n -= 1
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:  # the backends exist already
        logger.info("JAX has started: keeping its %d devices instead of %d CPU devices",
                    jax.device_count(), n)
        return 0
    return n


#: The DCN mesh of a run that sets none: every slice on the data axis (``train.dcn_mesh``).
DEFAULT_DCN = "-1,1,1"


def slice_count(devices: Sequence[Any]) -> int:
    """How many TPU slices (distinct ``slice_index``) the devices span; 1 without (CPU, GPU)."""
    return len({getattr(d, "slice_index", 0) for d in devices})


def hybrid_sizes(mesh_config: MeshConfig, dcn_config: MeshConfig, n_devices: int,
                 slices: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Each axis of ``mesh_config.axes`` over ``n_devices`` split into its size within a slice
    (ICI) and the number of the ``slices`` that ``dcn_config`` has it span (DCN).

    Returns:
      ``(ici, dcn)``, both in ``mesh_config.axes`` order; ``ici[i] * dcn[i]`` is axis i's size.

    Raises:
      ValueError: the mesh does not fit the devices, the DCN sizes do not multiply to the
        slice count, name an expert axis the mesh lacks, or do not divide their axis.
    """
    sizes = mesh_config.resolve(n_devices)
    axes = mesh_config.axes
    where = f"dcn_mesh {dcn_config.describe()}"
    for name in ("expert", "context"):
        if getattr(dcn_config, name) > 1 and name not in axes:
            raise ValueError(f"{where} spans slices with an {name} axis, but the mesh "
                             f"{mesh_config.describe()} has none")
    try:
        by_axis = dict(zip(dcn_config.axes, dcn_config.resolve(slices), strict=True))
    except ValueError:
        raise ValueError(f"{where} does not fit the devices' {slices} slice(s): its sizes must "
                         "multiply to the slice count (one may be -1: the rest)") from None
    dcn = tuple(by_axis.get(a, 1) for a in axes)
    for axis, size, d in zip(axes, sizes, dcn, strict=True):
        if size % d:
            raise ValueError(f"{where}: mesh axis {axis}={size} cannot span {d} slices; make "
                             f"{axis} a multiple of {d} (train.mesh gives whole-mesh sizes)")
    return tuple(s // d for s, d in zip(sizes, dcn, strict=True)), dcn


def make_mesh(mesh_config: MeshConfig, devices: Sequence[jax.Device] | None = None,
              dcn_config: MeshConfig | None = None) -> Mesh:
    """A mesh of ``mesh_config.axes`` over ``devices`` (default: all devices of all processes),
    its axes of the automatic (propagated) kind. Devices of several TPU slices make a hybrid
    mesh, each axis spanning the slices ``dcn_config`` gives it (``hybrid_sizes``).

    Args:
      mesh_config, devices: whole-mesh axis sizes, and the devices (all used).
      dcn_config: slices spanned per axis (``train.dcn_mesh``); None: all on data.

    Returns:
      A ``jax.sharding.Mesh`` with axis names ``mesh_config.axes``.

    Raises:
      ValueError: the mesh does not fit the devices, or the DCN sizes the slices or the axes.
    """
    devices = list(jax.devices() if devices is None else devices)
    slices = slice_count(devices)
    ici, dcn = hybrid_sizes(mesh_config, dcn_config or MeshConfig.parse(DEFAULT_DCN),
                            len(devices), slices)
    axes = mesh_config.axes
    types = (AxisType.Auto,) * len(axes)
    if slices == 1:
        mesh = jax.make_mesh(ici, axes, axis_types=types, devices=devices)
    else:
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices)
        mesh = Mesh(grid, axes, axis_types=types)
    logger.info("mesh %s over %d devices (%d processes)",
                dict(mesh.shape), len(devices), jax.process_count())
    return mesh
