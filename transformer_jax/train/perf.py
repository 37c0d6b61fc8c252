"""Speed accounting: FLOPs per token, a measured matmul peak (MFU), XLA:CPU fast-math flags."""

from __future__ import annotations

import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.model.config import ModelConfig
from transformer_jax.model.layers import EMBEDDING_PARAM, is_vector_param
from transformer_jax.model.transformer import abstract_params

# Vectorised approximations of exp/logistic (docs/cli.md); NaN/inf semantics and exact
# division are kept, so non-finite losses are still detected.
CPU_FAST_MATH_FLAGS = (
    "--xla_cpu_enable_fast_math=true",
    "--xla_cpu_fast_math_honor_nans=true",
    "--xla_cpu_fast_math_honor_infs=true",
    "--xla_cpu_fast_math_honor_division=true",
)


def enable_cpu_fast_math() -> bool:
    """Adds ``CPU_FAST_MATH_FLAGS`` to ``XLA_FLAGS`` (unless the user set fast math) before JAX
    creates its CPU backend.

    Returns:
      Whether the flags were added.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_enable_fast_math" in flags:
        return False
    os.environ["XLA_FLAGS"] = " ".join([flags, *CPU_FAST_MATH_FLAGS]).strip()
    return True


def flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: ``6 N`` plus attention, ``12 L T N H`` (PaLM's convention).

    N counts the matmul weights (not norms, biases, an untied embedding; of routed experts the k
    of E a token reaches); attention the full T x T matmuls, forward and backward.
    """
    n = 0.0
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_params(config))[0]:
        name = str(getattr(path[-1], "key", path[-1]))
        if is_vector_param(name) or name == EMBEDDING_PARAM and not config.tie_embeddings:
            continue
        n += int(np.prod(leaf.shape)) * _active_fraction(config, path)
    qk, v = ((config.mla.qk_head_dim, config.mla.v_head_dim) if config.mla is not None
             else (config.head_dim, config.head_dim))
    attention = 6 * config.n_layers * seq_len * config.n_heads * (qk + v)
    return 6.0 * n + attention


def _active_fraction(config: ModelConfig, path: tuple) -> float:
    """k/E for a routed expert's stacked matrix or bias, else 1."""
    keys = [str(getattr(p, "key", p)) for p in path]
    if config.moe is not None and len(keys) >= 2 and keys[-2] == "moe" and \
            keys[-1] in ("gate", "up", "down", "gate_bias", "up_bias", "down_bias"):
        return config.moe.top_k / config.moe.n_experts
    return 1.0


def param_counts(config: ModelConfig) -> tuple[int, int]:
    """``(total, active)`` parameters, from shapes (active: of the routed experts only k of E)."""
    total = active = 0.0
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_params(config))[0]:
        size = int(np.prod(leaf.shape))
        total += size
        active += size * _active_fraction(config, path)
    return int(total), int(round(active))


def describe_params(config: ModelConfig) -> str:
    """``"6,738,415,616 params"``, or for a mixture of experts ``"46,702,792,704 params,
    12,879,925,248 active per token"``."""
    total, active = param_counts(config)
    return f"{total:,} params" + (f", {active:,} active per token" if active != total else "")


def measure_matmul_peak(size: int = 1024, dtype: str = "float32", repeats: int = 10,
                        device: jax.Device | None = None) -> float:
    """Dense-matmul FLOP/s on ``device`` (default: the first): the fastest of ``repeats`` timed
    [size, size] x [size, size] matmuls of ``dtype`` (2 size^3 FLOPs)."""
    device = device or jax.devices()[0]
    a = jax.device_put(jnp.ones((size, size), dtype), device)
    matmul = jax.jit(lambda x: x @ x)
    jax.block_until_ready(matmul(a))
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(matmul(a))
        best = min(best, time.perf_counter() - start)
    return 2 * size ** 3 / best
