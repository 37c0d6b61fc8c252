"""Multi-process (multi-host) set-up on JAX's own runtime: ``jax.distributed`` and global arrays.

``maybe_initialize`` connects the processes before anything touches a device; then a mesh spans
all their devices, and each process feeds only the batch rows its own devices hold
(``process_batch_shard``, ``global_batch``).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Sharding

logger = logging.getLogger(__name__)

# Environment variables read when the arguments are not given.
ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"

# Cluster launchers jax.distributed detects: (the variable that marks one, its process count).
_CLUSTER_SIZE_VARS = (
    ("SLURM_JOB_ID", "SLURM_NTASKS"),
    ("OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE"),
)


def maybe_initialize(coordinator_address: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None,
                     local_device_ids: Sequence[int] | None = None,
                     initialization_timeout: int = 300) -> bool:
    """Calls ``jax.distributed.initialize`` when this run has several processes.

    Arguments left None are read from ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and
    ``JAX_PROCESS_ID``; without any, a SLURM or Open MPI launch is left to jax's detection. Must
    run before any JAX call touches a device. CPU cross-process collectives use gloo.

    Args:
      coordinator_address: ``host:port`` of process 0's coordinator service.
      num_processes, process_id: the number of processes P, and this one's index in [0, P).
      local_device_ids: devices of this host this process uses (default: all).
      initialization_timeout: seconds to wait for all processes to connect.

    Returns:
      True if ``jax.distributed`` was initialised (now or before), False for a single process.

    Raises:
      ValueError: for an incomplete or inconsistent set of values (naming them).
    """
    if jax.distributed.is_initialized():
        return True
    coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR) or None
    num_processes = _int_or_env("num_processes", num_processes, ENV_NUM_PROCESSES)
    process_id = _int_or_env("process_id", process_id, ENV_PROCESS_ID)

    if num_processes is None and process_id is None and coordinator_address is None:
        launcher_size = next((int(os.environ[size]) for marker, size in _CLUSTER_SIZE_VARS
                              if marker in os.environ and os.environ.get(size, "").isdigit()), 0)
        if launcher_size <= 1:
            return False
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        logger.info("initialising jax.distributed from the cluster launcher (%d processes)",
                    launcher_size)
        jax.distributed.initialize(initialization_timeout=initialization_timeout)
        return True
    if num_processes is None:
        raise ValueError(f"num_processes (or {ENV_NUM_PROCESSES}) is needed when "
                         f"coordinator_address={coordinator_address!r} or "
                         f"process_id={process_id!r} is given")
    if num_processes < 1:
        raise ValueError(f"num_processes must be >= 1, got {num_processes}")
    if num_processes == 1:
        if process_id not in (None, 0):
            raise ValueError(f"process_id must be 0 with one process, got {process_id}")
        return False
    if coordinator_address is None or process_id is None:
        raise ValueError(f"num_processes={num_processes} needs coordinator_address "
                         f"(or {ENV_COORDINATOR}) and process_id (or {ENV_PROCESS_ID}); got "
                         f"coordinator_address={coordinator_address!r}, process_id={process_id!r}")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id must be in [0, {num_processes}), got {process_id}")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    logger.info("initialising jax.distributed: process %d of %d, coordinator %s",
                process_id, num_processes, coordinator_address)
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id,
                               local_device_ids=local_device_ids,
                               initialization_timeout=initialization_timeout)
    return True


def is_main_process() -> bool:
    """Whether this is process 0, the one that logs, prints and shows progress bars."""
    return jax.process_index() == 0


def any_process(flag: bool) -> bool:
    """Whether ``flag`` is true on any process (a collective: every process must call it),
    for decisions all processes take together (stopping after a SIGTERM that reached one host).

    Args:
      flag: this process's value.

    Returns:
      The OR over all processes (``flag`` itself with one process).
    """
    if jax.process_count() == 1:
        return bool(flag)
    from jax.experimental import multihost_utils

    flags = multihost_utils.process_allgather(np.asarray([flag], np.int32))
    return bool(np.any(flags))


def process_batch_shard(sharding: Sharding, global_batch_size: int) -> tuple[int, int]:
    """Which contiguous part of the global batch this process must load (process p of P:
    rows ``[p B/P, (p+1) B/P)``), for ``data.get_batch(..., process_index, process_count)``.

    Args:
      sharding: the batch sharding (``sharding.batch_sharding(mesh)``).
      global_batch_size: B.

    Returns:
      ``(index, count)``: this process loads part ``index`` of ``count`` equal parts.

    Raises:
      ValueError: B does not split over the batch axes, or this process's rows are not contiguous.
    """
    # A sharding that also splits T (context parallelism) is asked about [B, parts of T] rows.
    extra = tuple(math.prod(sharding.mesh.shape[a] for a in
                            ((axes,) if isinstance(axes, str) else axes or ()))
                  for axes in tuple(getattr(sharding, "spec", ()))[1:])
    index_map = sharding.addressable_devices_indices_map((global_batch_size, *extra))
    rows = set()
    for index in index_map.values():
        start, stop, step = index[0].indices(global_batch_size)
        if step != 1:
            raise ValueError(f"batch sharding {sharding} takes strided rows")
        rows.add((start, stop))
    ordered = sorted(rows)
    start, stop = ordered[0][0], ordered[-1][1]
    if sum(b - a for a, b in ordered) != stop - start:
        raise ValueError(f"process {jax.process_index()} holds non-contiguous batch rows "
                         f"{ordered} of {global_batch_size}; reorder the mesh devices")
    size = stop - start
    if global_batch_size % size or start % size:
        raise ValueError(f"batch rows [{start}, {stop}) of process {jax.process_index()} do not "
                         f"tile a global batch of {global_batch_size}")
    return start // size, global_batch_size // size


def global_batch(local_batch: Any, sharding: Sharding, global_batch_size: int) -> Any:
    """Assembles each process's rows into global arrays sharded by ``sharding``.

    Args:
      local_batch: a tree of host arrays, each [B_local, ...]: this process's rows
        (``process_batch_shard``).
      sharding, global_batch_size: the batch sharding, and B.

    Returns:
      The same tree of ``jax.Array``s of shape [B, ...], without any cross-host copy.
    """
    def one(x):
        x = np.asarray(x)
        return jax.make_array_from_process_local_data(
            sharding, x, (global_batch_size,) + x.shape[1:])

    return jax.tree.map(one, local_batch)


def _int_or_env(name: str, value: int | None, env: str) -> int | None:
    if value is not None:
        return int(value)
    text = os.environ.get(env)
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{env} must be an integer (for {name}), got {text!r}") from None
