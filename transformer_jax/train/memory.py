"""Will a run fit in memory: a rough per-device estimate from shapes alone, checked before any
data is read or any array allocated (``train.run.run``; ``train.py --no-memory-check`` skips it).

The estimate is the train state (exact: ``jax.eval_shape`` of the real init, split by the run's
shardings), the gradients (one copy of the trained parameters), and the activations kept for
the backward pass, counted per layer from the model's shapes and its remat policy, plus the
logits of the loss. It leaves out XLA's scratch and fragmentation, so a run it passes may still
not fit; a run it refuses would need at least that much. ``transformer-jax bench
memory`` measures a compiled step instead.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import jax
import numpy as np

from transformer_jax.model.config import ModelConfig
from transformer_jax.parallel import sharding as sharding_lib
from transformer_jax.train.config import TrainConfig

logger = logging.getLogger(__name__)

GIB = 2.0 ** 30

#: Attention logits up to this many elements run on the einsum reference under "auto" on CPU
#: (see ``ops.attention.choose_impl``); the reference keeps [B, N, T, S] float32 probabilities.
_XLA_ATTENTION_MAX_LOGITS = 2 ** 23


def activation_bytes(model_config: ModelConfig, train_config: TrainConfig,
                     mesh_shape: dict[str, int]) -> int:
    """Rough per-device bytes the backward pass keeps from one micro-batch's forward.

    Per layer and token, with ``D`` the width, ``F`` the FFN width, ``N``/``K`` query/kv heads
    of ``H`` dims: no remat keeps the inputs of the norms and matmuls (4 D + 2 N H + 2 K H +
    3 F values); ``save_dots`` the matmul outputs (2 D + N H + 2 K H + 2 F); ``full`` the block
    input (D), plus one block recomputed at a time. The einsum attention adds its [N, T, T]
    float32 probabilities per layer; the loss adds the [T, V] float32 logits and their gradient
    (or a chunk of them with ``train.loss_chunk``). Head, FFN and vocabulary dimensions are split
    over ``tensor``, rows over ``data`` x ``fsdp``.

    Args:
      model_config: the model.
      train_config: the run (micro-batch, ``seq_len``, ``loss_chunk``).
      mesh_shape: ``{"data": .., "fsdp": .., "tensor": ..}`` sizes.

    Returns:
      Bytes per device.
    """
    c, tc = model_config, train_config
    rows = max(1, tc.micro_batch_size // (mesh_shape["data"] * mesh_shape["fsdp"]))
    tensor = mesh_shape["tensor"]
    t, d, f, h = tc.seq_len, c.d_model, c.d_ff, c.head_dim
    n, k = c.n_heads, c.n_kv_heads
    size = np.dtype(c.dtype).itemsize
    split = (2 * n * h + 2 * k * h + 3 * f) / tensor
    every = 4 * d + split  # values per token of one block without remat
    kept = {"none": every, "save_dots": 2 * d + (n * h + 2 * k * h + 2 * f) / tensor,
            "full": d}[c.remat]
    per_layer = rows * t * kept * size
    logits = rows * n * t * t
    impl = c.attention_impl
    if impl == "xla" or (impl == "auto" and logits < _XLA_ATTENTION_MAX_LOGITS):
        per_layer += 4 * logits / tensor
    total = c.n_layers * per_layer
    if c.remat == "full":
        total += rows * t * every * size  # the block being recomputed
    loss_tokens = rows * (min(tc.loss_chunk, t) if tc.loss_chunk else t)
    total += 2 * 4 * loss_tokens * c.vocab_size / tensor
    return int(total)


def estimate(model_config: ModelConfig, train_config: TrainConfig, abstract_state: Any,
             state_shardings: Any, mesh_shape: dict[str, int]) -> dict[str, int]:
    """Per-device bytes of a run: ``{"state", "gradients", "activations", "total"}``.

    Args:
      model_config: the model.
      train_config: the run.
      abstract_state: ``jax.eval_shape`` of the run's init.
      state_shardings: its shardings (``sharding.state_shardings``).
      mesh_shape: the mesh's axis sizes.
    """
    state = sharding_lib.per_device_bytes(abstract_state, state_shardings)
    # Adam's first moment mirrors the trained parameters: one gradient's worth of bytes.
    flat = dict(jax.tree_util.tree_flatten_with_path(state_shardings)[0])
    moments = sum(sharding_lib.per_device_bytes(leaf, flat[path])
                  for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_state)[0]
                  if "mu" in sharding_lib._path_keys(path))
    gradients = moments or sharding_lib.per_device_bytes(abstract_state.params,
                                                         state_shardings.params)
    activations = activation_bytes(model_config, train_config, mesh_shape)
    return {"state": state, "gradients": gradients, "activations": activations,
            "total": state + gradients + activations}


def available_bytes(device: jax.Device | None = None) -> tuple[int, int, str] | None:
    """What memory one device of this process can use.

    Returns:
      ``(bytes, devices sharing them, what it is)``: on CPU the host's available memory
      (``MemAvailable``), shared by this process's devices; elsewhere the device's own limit
      (``memory_stats()["bytes_limit"]``); None when unknown.
    """
    device = device or jax.local_devices()[0]
    if device.platform == "cpu":
        free = _host_available()
        if free is None:
            return None
        return free, jax.local_device_count(), "this host's available memory"
    try:
        limit = (device.memory_stats() or {}).get("bytes_limit")
    except Exception:  # noqa: BLE001 - a backend without memory stats
        return None
    return (int(limit), 1, f"one {device.device_kind}") if limit else None


def _host_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_fits(model_config: ModelConfig, train_config: TrainConfig, abstract_state: Any,
               state_shardings: Any, mesh_shape: dict[str, int]) -> dict[str, int] | None:
    """Raises ValueError, in one line, for a run that will not fit in memory.

    Args:
      model_config: the model.
      train_config: the run.
      abstract_state: ``jax.eval_shape`` of the run's init.
      state_shardings: its shardings.
      mesh_shape: the mesh's axis sizes.

    Returns:
      The estimate (``estimate``), or None when the available memory is unknown.

    Raises:
      ValueError: the estimate is above the available memory; the message gives both, the
        parts, and what to change (``--no-memory-check`` to try anyway).
    """
    have = available_bytes()
    if have is None:
        return None
    free, sharing, where = have
    need = estimate(model_config, train_config, abstract_state, state_shardings, mesh_shape)
    total = need["total"] * sharing
    logger.debug("memory estimate per device: %s; %s: %.2f GiB for %d device(s)",
                 {k: f"{v / GIB:.2f} GiB" for k, v in need.items()}, where, free / GIB, sharing)
    if total <= free:
        return need
    per_device = f"{need['total'] / GIB:.1f} GiB per device x {sharing} devices" if sharing > 1 \
        else "per device"
    raise ValueError(
        f"this run will not fit in memory: it needs about {total / GIB:.1f} GiB "
        f"({per_device}: train state {need['state'] / GIB:.1f}, gradients "
        f"{need['gradients'] / GIB:.1f}, activations {need['activations'] / GIB:.1f} GiB; a "
        f"rough estimate from the shapes) and {where} is {free / GIB:.1f} GiB; use a smaller "
        "model, a shorter train.seq_len, a smaller micro-batch (train.batch_size / "
        "train.grad_accum), model.remat=full, train.lora_rank, or a mesh that shards the state "
        "over more accelerators (train.mesh), or pass --no-memory-check to try anyway")


__all__ = ["activation_bytes", "available_bytes", "check_fits", "estimate"]
