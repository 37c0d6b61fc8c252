"""TPU pods without a TPU: a topology's device descriptions, a mesh over them, each chip's HBM.

With libtpu (the ``tpu`` extra, imported only when asked for), ``jax.experimental.topologies``
describes any TPU topology on a CPU host, and compiling over a mesh of it runs the real TPU
compiler. Several slices make a hybrid mesh (``parallel.mesh.hybrid_sizes``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from jax.sharding import Mesh

from transformer_jax.parallel.mesh import MeshConfig, make_mesh, slice_count

GIB = 2**30

#: HBM of one TPU chip by ``jax.Device.device_kind``, in GiB (published figures).
HBM_GIB = {"TPU v4": 32, "TPU v5 lite": 16, "TPU v5e": 16, "TPU v5": 95, "TPU v5p": 95,
           "TPU v6 lite": 32, "TPU v6e": 32}


class TopologyError(ValueError):
    """A topology that cannot be described here: no libtpu, or a bad name."""


def topology_devices(name: str, slices: int = 1) -> list[Any]:
    """The TPU device descriptions of topology ``name`` (``"v5e:2x2"``, ``"v5p:4x4x4"``, ...).

    Args:
      name: ``VERSION:AxBxC``, as ``jax.experimental.topologies`` takes it.
      slices: how many such slices, joined by DCN.

    Returns:
      ``slices`` x chips devices (``platform == "tpu"``; ``slice_index`` tells their slice).

    Raises:
      TopologyError: libtpu is not installed (the ``tpu`` extra), or does not know the name.
    """
    if slices < 1:
        raise TopologyError(f"--slices must be >= 1, got {slices}")
    import jax
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc(platform="tpu", topology_name=name,
                                            num_slices=slices)
    except RuntimeError as e:
        if isinstance(e, jax.errors.JaxRuntimeError):
            raise TopologyError(f"topology {name!r}: {str(e).splitlines()[0]}") from None
        raise TopologyError(f"topology {name!r} needs libtpu, which is not installed: "
                            "pip install -e '.[tpu]' (the jax[tpu] of this jax)") from None
    return list(topo.devices)


def hbm_bytes(device: Any) -> int | None:
    """HBM of a device of this kind in bytes (its chip's, shared by its devices); None: unknown."""
    gib = HBM_GIB.get(device.device_kind)
    return None if gib is None else int(gib * GIB)


def devices_per_chip(devices: Sequence[Any]) -> int:
    """How many devices each chip shows (2 where each TensorCore is a device, e.g. v4)."""
    chips = {(getattr(d, "slice_index", 0), tuple(d.coords)) for d in devices}
    return max(1, len(devices) // len(chips))


def pod_mesh(mesh_config: MeshConfig, devices: Sequence[Any], slices: int = 1,
             dcn_config: MeshConfig | None = None) -> Mesh:
    """A mesh of ``mesh_config``'s axes over a topology's devices (``parallel.mesh.make_mesh``;
    ``slices`` as the devices' ``slice_index`` tell).

    Raises:
      ValueError: the sizes do not fit the devices, or the DCN sizes the slices or the axes.
    """
    if slice_count(devices) != slices:
        raise ValueError(f"the devices span {slice_count(devices)} slices, not {slices}")
    return make_mesh(mesh_config, devices, dcn_config)


def default_mesh(slices: int = 1, dcn_config: MeshConfig | None = None) -> MeshConfig:
    """The mesh of a run that sets none, on a pod: every chip an FSDP device, but for the slices
    the DCN mesh puts on data (default: all of them)."""
    data = slices if dcn_config is None else dict(
        zip(dcn_config.axes, dcn_config.resolve(slices), strict=True))["data"]
    return MeshConfig(data=data, fsdp=-1, tensor=1)


def dcn_sizes(mesh: Mesh) -> tuple[int, ...]:
    """How many slices each axis of ``mesh`` spans (all 1 on one slice)."""
    ids = np.vectorize(lambda d: getattr(d, "slice_index", 0), otypes=[int])(mesh.devices)
    return tuple(len(set(np.moveaxis(ids, i, 0)[(slice(None),) + (0,) * (ids.ndim - 1)]))
                 for i in range(ids.ndim))


def dcn_axes(mesh: Mesh) -> str:
    """The mesh axes that span slices, ``"+"``-joined (``"data"``; ``""`` on one slice)."""
    return "+".join(a for a, d in zip(mesh.axis_names, dcn_sizes(mesh), strict=True) if d > 1)


def slice_mesh(mesh: Mesh) -> tuple[np.ndarray, tuple[str, ...]]:
    """The first slice's part of ``mesh`` as an [per-slice axis sizes] array of partition ids
    (a multi-slice program's collectives name one slice's devices), with the axis names."""
    shape = tuple(s // d for s, d in zip(mesh.devices.shape, dcn_sizes(mesh), strict=True))
    return np.arange(math.prod(shape)).reshape(shape), tuple(mesh.axis_names)


def largest_fitting(fits: Callable[[int], bool], most: int = 4096
                    ) -> tuple[int, list[tuple[int, bool]]]:
    """The largest ``n`` in [1, ``most``] for which a monotone ``fits(n)`` holds: doubling from
    1, then bisection.

    Returns:
      ``(n, probes)``: 0 when ``fits(1)`` is False; ``probes`` the ``(n, fits(n))`` asked.
    """
    probes: list[tuple[int, bool]] = []

    def probe(n: int) -> bool:
        probes.append((n, fits(n)))
        return probes[-1][1]

    lo, hi, n = 0, None, 1
    while hi is None:
        if probe(n):
            lo = n
            if n == most:
                return lo, probes
            n = min(2 * n, most)
        else:
            hi = n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if probe(mid) else (lo, mid)
    return lo, probes


def compile_memory(lowered: Any) -> tuple[Any, dict[str, Any]]:
    """Compiles ``lowered``; returns ``(compiled, fields)``: ``compile_s`` and the per-device
    ``memory`` (bytes; ``peak`` = arguments + non-aliased output + temporaries, in HBM;
    ``host_*``: host memory), or ``(None, {"fits": False, "error": line, "compile_s"})`` on
    RESOURCE_EXHAUSTED. Other compiler errors propagate."""
    import jax

    start = time.perf_counter()
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
        text = str(e).splitlines()[0]
        if "RESOURCE_EXHAUSTED" not in text:
            raise
        return None, {"fits": False, "error": text, "compile_s": time.perf_counter() - start}
    seconds = time.perf_counter() - start
    stats = compiled.memory_analysis()
    memory = {n: int(getattr(stats, f"{n}_size_in_bytes", 0) or 0)
              for n in ("argument", "output", "alias", "temp", "generated_code",
                        "host_argument", "host_output", "host_temp")}
    memory["peak"] = memory["argument"] + memory["output"] - memory["alias"] + memory["temp"]
    return compiled, {"compile_s": seconds, "memory": memory}
