"""Will a run fit in memory: a rough per-device estimate from shapes alone (the train state,
gradients, activations kept for the backward pass, the loss's logits), checked before any data
is read. It leaves out XLA's scratch; ``transformer-jax bench memory`` measures a compiled step.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from transformer_jax.model import remat as remat_lib
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.ops import moe as moe_ops
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

    Per layer and token: no remat keeps the norms' and matmuls' inputs (4 D + 2 N H + 2 K H +
    3 F values), ``save_dots`` the matmul outputs (2 D + N H + 2 K H + 2 F), ``full`` the block
    input D, a named policy that plus what it saves; sparse layers as ``moe_values``. Plus the
    einsum attention's [N, T, T] and the loss's [T, V] float32 values, split as the arrays are.

    Args:
      model_config: the model.
      train_config: the run (micro-batch, ``seq_len``, ``loss_chunk``).
      mesh_shape: ``{"data": .., "fsdp": .., "tensor": ..}`` sizes.

    Returns:
      Bytes per device.
    """
    c, tc = model_config, train_config
    batch_devices = mesh_shape["data"] * mesh_shape["fsdp"] * mesh_shape.get("expert", 1)
    rows = max(1, tc.micro_batch_size // batch_devices)
    tensor = mesh_shape["tensor"]
    s, d, h, n, k = tc.seq_len, c.d_model, c.head_dim, c.n_heads, c.n_kv_heads
    t = s // mesh_shape.get("context", 1)  # the tokens of a sequence a device holds
    size = np.dtype(c.dtype).itemsize
    width = c.d_ff / tensor
    dense_ffn = {"none": 3 * width, "save_dots": 2 * width, "full": 0.0,
                 **_named({remat_lib.MLP_GATE: width, remat_lib.MLP_UP: width,
                           remat_lib.MLP_DOWN: d})}
    attn = {"none": 4 * d + (2 * n * h + 2 * k * h) / tensor,
            "save_dots": 2 * d + (n * h + 2 * k * h) / tensor, "full": d,
            **_named({remat_lib.QUERY: n * h / tensor, remat_lib.KEY: k * h / tensor,
                      remat_lib.VALUE: k * h / tensor, remat_lib.CONTEXT: n * h / tensor,
                      remat_lib.OUT: d}, base=d)}
    sparse = set(c.sparse_layers)
    ffn = [moe_values(c, tensor, size, rows * t) if i in sparse else dense_ffn
           for i in range(c.n_layers)]
    per_token = sum(attn[c.remat] + f[c.remat] for f in ffn)
    total = rows * t * per_token * size
    logits = rows * n * t * s
    impl = c.attention_impl
    if impl == "xla" or (impl == "auto" and logits < _XLA_ATTENTION_MAX_LOGITS):
        total += c.n_layers * 4 * logits / tensor
    if c.remat not in ("none", "save_dots"):  # the block being recomputed
        total += rows * t * (attn["none"] + max(f["none"] for f in ffn)) * size
    elif sparse and mesh_shape["fsdp"] > 1:  # each sparse layer's gathered experts, kept
        m = c.moe
        total += len(sparse) * 3 * m.n_experts * d * m.d_ff * size / (
            tensor * mesh_shape.get("expert", 1))
    loss_tokens = rows * (min(tc.loss_chunk, t) if tc.loss_chunk else t)
    total += 2 * 4 * loss_tokens * c.vocab_size / tensor
    return int(total)


def moe_values(config: ModelConfig, tensor: int, itemsize: int, tokens: int = 0
               ) -> dict[str, float]:
    """Values per token (of ``itemsize`` bytes) a sparse layer's FFN keeps for the backward
    pass, by remat policy: no remat k (D + 3 F) + 2 k D + 2 E (router, float32) + 3 F_s;
    ``save_dots`` k (2 F + D) + E + 2 F_s; ``full`` none. The ``"tiled"`` products' padding
    of the N k sorted rows (``ops.moe.tile_layout``) is included."""
    m, d = config.moe, config.d_model
    f, fs = m.d_ff / tensor, m.shared_d_ff / tensor
    router = m.n_experts * 4 / itemsize
    pairs = max(1, tokens * m.top_k)
    rows = float(m.top_k)
    if tokens and moe_ops.choose_impl(config.moe_impl, tokens, m.top_k, m.n_experts) == "tiled":
        tile = min(128, max(8, 1 << max(0, (-(-pairs // m.n_experts) - 1).bit_length())))
        rows *= (pairs + m.n_experts * tile) / pairs
    return {"none": rows * (d + 3 * f + 2 * d) + 2 * router + 3 * fs,
            "save_dots": rows * (2 * f + d) + router + 2 * fs, "full": 0.0,
            **_named({remat_lib.MOE_GATE: rows * f, remat_lib.MOE_UP: rows * f,
                      remat_lib.MOE_OUT: d, remat_lib.MLP_GATE: fs, remat_lib.MLP_UP: fs,
                      remat_lib.MLP_DOWN: d if fs else 0.0})}


def _named(widths: dict[str, float], base: float = 0.0) -> dict[str, float]:
    """Values per token each named ``model.remat`` policy keeps in device memory: ``base`` plus
    the widths of the names it saves (not those it offloads)."""
    return {remat: base + sum(widths.get(name, 0.0) for name in remat_lib.saved_names(remat)[0])
            for remat in remat_lib.REMATS if remat not in ("none", "full", "save_dots")}


def _bytes_where(abstract_state: Any, state_shardings: Any, keep: Callable[[tuple], bool]) -> int:
    """Per-device bytes of the leaves of a train state whose path keys ``keep`` accepts."""
    flat = dict(jax.tree_util.tree_flatten_with_path(state_shardings)[0])
    return sum(sharding_lib.per_device_bytes(leaf, flat[path])
               for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_state)[0]
               if keep(sharding_lib._path_keys(path)))


def expert_bytes(abstract_state: Any, state_shardings: Any) -> int:
    """Per-device bytes of the routed experts' matrices and Adam moments in a train state."""
    return _bytes_where(abstract_state, state_shardings, lambda keys: keys[-2:-1] == ("moe",)
                        and keys[-1] in ("gate", "up", "down"))


def estimate(model_config: ModelConfig, train_config: TrainConfig, abstract_state: Any,
             state_shardings: Any, mesh_shape: dict[str, int]) -> dict[str, int]:
    """Per-device bytes of a run: ``{"state", "gradients", "activations", "total", "experts"}``,
    from ``jax.eval_shape`` of the run's init, its shardings and the mesh's axis sizes."""
    state = sharding_lib.per_device_bytes(abstract_state, state_shardings)
    # Adam's first moment mirrors the trained parameters: one gradient's worth of bytes.
    moments = _bytes_where(abstract_state, state_shardings, lambda keys: "mu" in keys)
    gradients = moments or sharding_lib.per_device_bytes(abstract_state.params,
                                                         state_shardings.params)
    activations = activation_bytes(model_config, train_config, mesh_shape)
    return {"state": state, "gradients": gradients, "activations": activations,
            "total": state + gradients + activations,
            "experts": expert_bytes(abstract_state, state_shardings)}


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
        return None if free is None else (free, jax.local_device_count(),
                                          "this host's available memory")
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
    """The ``estimate`` (same arguments), or None when the available memory is unknown.

    Raises:
      ValueError: the estimate is above the available memory; the one-line message gives
        both, the parts, and what to change (``--no-memory-check`` to try anyway).
    """
    if (have := available_bytes()) is None:
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
    experts = f" (experts {need['experts'] / GIB:.1f})" if need["experts"] else ""
    raise ValueError(
        f"this run will not fit in memory: it needs about {total / GIB:.1f} GiB "
        f"({per_device}: train state {need['state'] / GIB:.1f}{experts}, gradients "
        f"{need['gradients'] / GIB:.1f}, activations {need['activations'] / GIB:.1f} GiB; a "
        f"rough estimate from the shapes) and {where} is {free / GIB:.1f} GiB; use a smaller "
        "model, a shorter train.seq_len, a smaller micro-batch (train.batch_size / "
        "train.grad_accum), model.remat=full, train.lora_rank, or a mesh that shards the state "
        "over more accelerators (train.mesh), or pass --no-memory-check to try anyway")


__all__ = ["activation_bytes", "available_bytes", "check_fits", "estimate", "expert_bytes",
           "moe_values"]
