"""Attention over a paged KV cache with JAX's Pallas kernels (``attention_impl="pallas"``):
``plan`` picks one of ``KERNELS`` (GPU/TPU decode, TPU ragged prefill) or the cache's XLA views
(``"auto"`` never picks a kernel: none measured yet); ``kernel_target`` traces them for another
backend (export, or interpretation on a CPU)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from transformer_jax.model.ops import target
from transformer_jax.model.ops.attention import _kernel_split

#: The paged kernels ``plan`` may choose.
KERNELS = ("gpu_paged", "tpu_paged", "tpu_ragged")
#: Those Pallas can interpret on a CPU (see the module docstring).
INTERPRETABLE = ("gpu_paged", "tpu_paged")
GPU_BACKENDS = ("gpu", "cuda")
TARGET_BACKENDS = (*GPU_BACKENDS, "tpu")

# Block sizes, untuned: each is the largest divisor of W within its bound. A Triton block holds
# at least GPU_MIN_BLOCK_KEYS keys where W allows (tl.dot wants dimensions of 16 or more).
GPU_PAGES_PER_BLOCK = 8
GPU_MIN_BLOCK_KEYS = 16
GPU_MAX_SPLITS = 16
TPU_BLOCK_POSITIONS = 512
#: The TPU kernels' head size must be a multiple of this (the vector lanes; ``plan``).
TPU_LANES = 128

# The ragged kernel's (pages per KV block, queries per block) off a TPU, where its tuned table
# cannot be read: its TPU v4 defaults, capped at the size of the call.
_RAGGED_UNTUNED_BLOCKS = (32, 32)


@dataclasses.dataclass(frozen=True)
class KernelTarget:
    """The backend the paged kernels are traced for, and whether Pallas interprets them."""

    backend: str
    interpret: bool = False


_TARGET = jax.make_user_context(None)


@contextlib.contextmanager
def kernel_target(backend: str, *, interpret: bool = False) -> Iterator[KernelTarget]:
    """Traces the paged kernels inside for ``backend`` (Pallas-interpreted with ``interpret``)."""
    if backend not in TARGET_BACKENDS:
        raise ValueError(f"kernel_target backend must be one of {TARGET_BACKENDS}, got "
                         f"{backend!r}")
    target = KernelTarget(backend, bool(interpret))
    with _TARGET(target):
        yield target


def current_target() -> KernelTarget:
    """The ``kernel_target`` in force, else the default backend without interpretation."""
    return _TARGET.value or KernelTarget(target.platform())


@dataclasses.dataclass(frozen=True)
class Plan:
    """How ``PagedKVCache.attend`` attends one chunk.

    Attributes:
      kernel: one of ``KERNELS``, or None for the cache's XLA views.
      impl: the ``attention_impl`` those views pass to ``ops.attention.attention``.
    """

    kernel: str | None
    impl: str


def plan(impl: str, t: int, window: int | None, head_dim: int | None = None) -> Plan:
    """The kernel (or view implementation) for a chunk of T queries per row.

    Args:
      impl, t, window: the config's ``attention_impl``, T queries per row, the sliding window.
      head_dim: H; on a TPU both kernels need a multiple of ``TPU_LANES`` (else: XLA views).

    Raises:
      ValueError: ``impl="pallas"`` on a backend with no paged kernel.
    """
    if impl != "pallas":
        return Plan(None, impl)
    target = current_target()
    decode = t == 1 and window is None
    if target.backend in GPU_BACKENDS:
        kernel = "gpu_paged" if decode else None
    elif target.backend == "tpu":
        kernel = "tpu_paged" if decode else "tpu_ragged"
    else:
        raise ValueError(f"attention impl 'pallas' over a paged cache cannot run on backend "
                         f"{target.backend!r}; it needs one of {TARGET_BACKENDS}. Use "
                         f"impl='auto', 'xla' or 'chunked' (or ops.paged_attention."
                         f"kernel_target to interpret or export the kernels).")
    if (kernel not in INTERPRETABLE if target.interpret else
            target.backend == "tpu" and head_dim is not None and head_dim % TPU_LANES):
        return Plan(None, "xla")
    return Plan(kernel, "pallas")


def paged_attention(kernel: str, q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                    page_table: jax.Array, positions: jax.Array, *, window: int | None = None
                    ) -> jax.Array:
    """One layer's attention of each row's queries over its own pages, with ``kernel``.

    Args:
      kernel: one of ``KERNELS`` (``plan``'s choice).
      q, k_pages, v_pages: [B, T, N, H] queries (rotated), [K, P, ps, H] key and value pools.
      page_table: [B, W] int32 each row's pages in position order.
      positions: [B, T] int positions, consecutive per row, already written.
      window: optional sliding window length (``"tpu_ragged"`` only).

    Returns:
      [B, T, N, H] in the pages' dtype.
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if window is not None and kernel != "tpu_ragged":
        raise ValueError(f"kernel {kernel!r} has no sliding window (window={window}); "
                         "plan() sends windows elsewhere")
    split = _kernel_split(q.shape[0], k_pages.shape[0])
    if split is not None and split[2]:  # Mosaic and Triton calls are not partitioned by XLA:
        mesh, _, heads = split  # per device, on its kv heads
        body = functools.partial(paged_attention, kernel, window=window)
        return jax.shard_map(body, mesh=mesh, check_vma=False, out_specs=P(None, None, heads),
                             in_specs=(P(None, None, heads), P(heads), P(heads), P(), P()))(
            q, k_pages, v_pages, page_table, positions)
    q = q.astype(v_pages.dtype)
    interpret = current_target().interpret
    if kernel == "tpu_ragged":
        return tpu_ragged_attention(q, k_pages, v_pages, page_table, positions, window=window)
    if q.shape[1] != 1:
        raise ValueError(f"kernel {kernel!r} decodes one query per row, got T = {q.shape[1]}")
    fn = gpu_paged_attention if kernel == "gpu_paged" else tpu_paged_attention
    return fn(q[:, 0], k_pages, v_pages, page_table, positions[:, 0], interpret=interpret)[:, None]


def _divisor_at_most(n: int, cap: int) -> int:
    return max(d for d in range(1, min(n, max(cap, 1)) + 1) if n % d == 0)


def _decode_lengths(position: jax.Array, page_table: jax.Array, page_size: int) -> jax.Array:
    """[B] keys each decode row sees: positions 0..position, capped at the table's W pages."""
    return jnp.minimum(position + 1, page_table.shape[1] * page_size).astype(jnp.int32)


def gpu_paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                        page_table: jax.Array, position: jax.Array, *,
                        interpret: bool = False) -> jax.Array:
    """The Triton paged attention for one decode query per row, over the pool as stored (it
    has no softmax scale: q is scaled by ``1/sqrt(H)`` first).

    Args:
      q, position: [B, N, H] queries, [B] int position of each row's query.
      k_pages, v_pages, page_table: as ``paged_attention`` takes them.
      interpret: run in Pallas interpret mode (any backend).

    Returns:
      [B, N, H] in q's dtype.
    """
    from jax.experimental.pallas.ops.gpu import paged_attention as gpu  # noqa: PLC0415

    w, ps = page_table.shape[1], k_pages.shape[2]
    pages_per_block = _divisor_at_most(w, max(GPU_PAGES_PER_BLOCK, -(-GPU_MIN_BLOCK_KEYS // ps)))
    return gpu.paged_attention(
        q * jnp.asarray(q.shape[-1] ** -0.5, q.dtype), k_pages, v_pages,
        page_table.astype(jnp.int32), _decode_lengths(position, page_table, ps), block_h=16,
        pages_per_compute_block=pages_per_block,
        k_splits=_divisor_at_most(w // pages_per_block, GPU_MAX_SPLITS), interpret=interpret)


def tpu_paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                        page_table: jax.Array, position: jax.Array, *,
                        interpret: bool = False) -> jax.Array:
    """The Mosaic TPU paged attention, as ``gpu_paged_attention`` (pages read as bfloat16)."""
    from jax.experimental.pallas import tpu as pltpu  # noqa: PLC0415
    from jax.experimental.pallas.ops.tpu.paged_attention import (  # noqa: PLC0415
        paged_attention as tpu_paged,
    )

    w, ps = page_table.shape[1], k_pages.shape[2]
    call = pltpu.force_tpu_interpret_mode() if interpret else contextlib.nullcontext()
    with call:  # the interpret mode is read when the kernel is traced, i.e. here
        return tpu_paged(q * jnp.asarray(q.shape[-1] ** -0.5, q.dtype), k_pages, v_pages,
                         _decode_lengths(position, page_table, ps),
                         page_table.astype(jnp.int32),
                         pages_per_compute_block=_divisor_at_most(w, TPU_BLOCK_POSITIONS // ps))


def ragged_inputs(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                  positions: jax.Array) -> tuple[jax.Array, ...]:
    """The ragged kernel's operands for B rows of T consecutive queries each: each row a sequence of
    T queries and ``start + T`` keys, the table padded with ``ceil(T / ps)`` null pages, keys and
    values interleaved by head (a copy of the pool).

    Args:
      q, k_pages, v_pages, page_table, positions: as ``paged_attention`` takes them.

    Returns:
      (queries [B * T, N, H], kv pages [P, ps, 2K, H], kv_lens [B], page_indices [B, W'],
      cu_q_lens [B + 1], num_seqs [1]), all indices int32.
    """
    b, t, n, h = q.shape
    kv, p, ps, _ = v_pages.shape
    kv_pages = jnp.stack([k_pages, v_pages], axis=1)  # [K, 2, P, ps, H]
    kv_pages = kv_pages.transpose(2, 3, 0, 1, 4).reshape(p, ps, 2 * kv, h)
    extra = -(-t // ps)
    table = jnp.pad(page_table.astype(jnp.int32), ((0, 0), (0, extra)))  # pad with page 0
    kv_lens = (positions[:, 0] + t).astype(jnp.int32)
    cu_q_lens = jnp.arange(b + 1, dtype=jnp.int32) * t
    return (q.reshape(b * t, n, h), kv_pages, kv_lens, table, cu_q_lens,
            jnp.full((1,), b, jnp.int32))


def tpu_ragged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                         page_table: jax.Array, positions: jax.Array, *,
                         window: int | None = None) -> jax.Array:
    """The Mosaic TPU ragged paged attention over B rows of T queries (``ragged_inputs``), with the
    kernel's tuned block sizes on a TPU (elsewhere ``_RAGGED_UNTUNED_BLOCKS``).

    Args:
      q, k_pages, v_pages, page_table, positions, window: as ``paged_attention`` takes them.

    Returns:
      [B, T, N, H] in q's dtype.
    """
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (  # noqa: PLC0415
        ragged_paged_attention,
    )

    b, t, n, h = q.shape
    args = ragged_inputs(q, k_pages, v_pages, page_table, positions)
    blocks = {}
    if jax.default_backend() != "tpu":  # the tuned sizes query the TPU this runs on
        pages, queries = _RAGGED_UNTUNED_BLOCKS
        blocks = dict(num_kv_pages_per_block=min(pages, args[3].shape[1]),
                      num_queries_per_block=min(queries, b * t))
    out = ragged_paged_attention(*args, sm_scale=h ** -0.5, sliding_window=window, **blocks)
    return out.reshape(b, t, n, h)


__all__ = ["INTERPRETABLE", "KERNELS", "KernelTarget", "Plan", "current_target",
           "gpu_paged_attention", "kernel_target", "paged_attention", "plan", "ragged_inputs",
           "tpu_paged_attention", "tpu_ragged_attention"]
