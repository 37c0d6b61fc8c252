"""Attention over a paged KV cache with JAX's Pallas kernels (``attention_impl="pallas"``).

``PagedKVCache.attend`` asks ``plan`` how to attend a chunk of T queries per row; with
``impl="pallas"`` the answer is one of these kernels, or the cache's own XLA views:

- ``"gpu_paged"``: the Triton paged attention, ``jax.experimental.pallas.ops.gpu.paged_attention``
  (GPU decode: T = 1, no sliding window). Prefill chunks and windows keep the gather view, whose
  contiguous attention is then ``attention(impl="pallas")``'s Triton flash kernel.
- ``"tpu_paged"``: the Mosaic TPU paged attention, ``jax.experimental.pallas.ops.tpu.
  paged_attention`` (TPU decode: T = 1, no window).
- ``"tpu_ragged"``: the Mosaic TPU ragged paged attention, ``jax.experimental.pallas.ops.tpu.
  ragged_paged_attention`` (TPU prefill chunks, and decode with a sliding window): causal over
  each row's pages, windows natively.

``"auto"`` does not pick them: none has been measured on an accelerator yet, so ``"auto"`` keeps
the cache's XLA views. On any other backend ``"pallas"`` is a ``ValueError``, as
``ops.attention`` raises for a kernel the backend cannot run.

The adapters take the layout ``PagedKVCache`` stores, one layer's pool: values [K, P, ps, H], keys
[K, P, ps, H], the page table [B, W] and the chunk's positions [B, T] (consecutive per row,
already written into the pages). What each adaptation costs is said where it is made; in short:
the two paged kernels read the pool in place, and the ragged kernel wants keys and values
interleaved by head in one [P, ps, 2K, H] array, one copy of the layer's whole pool per call.
Within a layer scan (a stacked cache) ``k[i]`` is a dynamic slice of the stacked pool that XLA
may materialise as the kernel's operand (not measured: no accelerator here).

Over a mesh whose logical rules split the kv heads (the engine's tensor axis, ``decode_context``)
a kernel runs per device under ``shard_map``, on its K/T kv heads of the pool and their query
heads (XLA cannot partition a Mosaic or Triton call), as ``ops.attention`` runs its kernels.

Off an accelerator, ``kernel_target(backend, interpret=...)`` traces the kernels for another
backend: to export them for it (``jax.export`` from a CPU), or to run the ones Pallas can
interpret on a CPU (the Triton kernel with ``interpret=True``, the TPU paged kernel under
``pltpu.force_tpu_interpret_mode``; the ragged kernel does not run in interpret mode with jax
0.10.2, so under interpretation the parts that would use it, or the Triton flash kernel, run the
gather view with the XLA reference instead). The target is a ``jax.make_user_context``, part of
jit's cache key: a program traced under one target is never reused under another.
"""

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

# Block sizes, untuned (no GPU or TPU ran them here). The Triton kernel reads up to
# GPU_PAGES_PER_BLOCK pages per block (more for tiny pages, so a block holds at least
# GPU_MIN_BLOCK_KEYS keys where W allows: Triton's tl.dot has wanted dimensions of 16 or more),
# its blocks split into up to GPU_MAX_SPLITS partitions run in parallel; the TPU paged kernel
# reads blocks of up to TPU_BLOCK_POSITIONS positions. Each is the largest divisor of W within
# its bound (the kernels require divisors).
GPU_PAGES_PER_BLOCK = 8
GPU_MIN_BLOCK_KEYS = 16
GPU_MAX_SPLITS = 16
TPU_BLOCK_POSITIONS = 512
#: The TPU kernels' head size must be a multiple of this (the vector lanes; ``plan``).
TPU_LANES = 128

# The ragged kernel's block sizes where its tuned table cannot be read (it asks the device kind,
# so only on a TPU): the defaults its lookup takes on TPU v4 (pages per KV block, queries per
# block), each capped at the size of the call.
_RAGGED_UNTUNED_BLOCKS = (32, 32)


@dataclasses.dataclass(frozen=True)
class KernelTarget:
    """The backend the paged kernels are traced for, and whether Pallas interprets them."""

    backend: str
    interpret: bool = False


_TARGET = jax.make_user_context(None)


@contextlib.contextmanager
def kernel_target(backend: str, *, interpret: bool = False) -> Iterator[KernelTarget]:
    """Within this context the paged kernels are traced for ``backend`` (``"gpu"``, ``"cuda"``
    or ``"tpu"``) rather than ``jax.default_backend()``; with ``interpret`` those Pallas can
    interpret run in interpret mode (see the module docstring). For tests and export only."""
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
      kernel: one of ``KERNELS``, or None for the cache's XLA views (gather or pool).
      impl: the ``attention_impl`` those views pass to ``ops.attention.attention``.
    """

    kernel: str | None
    impl: str


def plan(impl: str, t: int, window: int | None, head_dim: int | None = None) -> Plan:
    """The kernel (or view implementation) for a chunk of T queries per row.

    Args:
      impl: the config's ``attention_impl``.
      t: T, queries per row (1 for decode rows).
      window: the sliding window, or None.
      head_dim: H; compiled for a TPU, both kernels need H a multiple of ``TPU_LANES`` (jax
        0.10.2: at H = 64 the paged kernel's block shapes are refused and the ragged kernel
        fails an assertion while tracing), so other head sizes take the XLA views there.

    Raises:
      ValueError: ``impl="pallas"`` on a backend with no paged kernel (CPU: use
        ``kernel_target``), as ``ops.attention`` raises for its kernels.
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
    if target.interpret and kernel not in INTERPRETABLE:
        return Plan(None, "xla")
    if target.backend == "tpu" and not target.interpret and head_dim is not None \
            and head_dim % TPU_LANES:
        return Plan(None, "xla")
    return Plan(kernel, "pallas")


def paged_attention(kernel: str, q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                    page_table: jax.Array, positions: jax.Array, *, window: int | None = None
                    ) -> jax.Array:
    """One layer's attention of each row's queries over its own pages, with ``kernel``.

    A query at position m of row b sees the keys of row b's positions n <= m (and n > m -
    window with a window): exactly what the gather view's position mask gives.

    Args:
      kernel: one of ``KERNELS`` (``plan``'s choice).
      q: [B, T, N, H] queries (rotated), N a multiple of K.
      k_pages: [K, P, ps, H] the layer's key pool.
      v_pages: [K, P, ps, H] the layer's value pool.
      page_table: [B, W] int32 each row's pages in position order.
      positions: [B, T] int positions of the chunk, consecutive per row, already written.
      window: optional sliding window length (``"tpu_ragged"`` only).

    Returns:
      [B, T, N, H] in the pages' dtype.
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if window is not None and kernel != "tpu_ragged":
        raise ValueError(f"kernel {kernel!r} has no sliding window (window={window}); "
                         "plan() sends windows elsewhere")
    split = _head_split(q.shape[0], k_pages.shape[0])
    if split is not None:  # Mosaic and Triton calls are not partitioned by XLA: per device
        mesh, heads = split
        body = functools.partial(paged_attention, kernel, window=window)
        return jax.shard_map(body, mesh=mesh, check_vma=False,
                             in_specs=(P(None, None, heads), P(heads), P(heads), P(), P()),
                             out_specs=P(None, None, heads))(q, k_pages, v_pages, page_table,
                                                              positions)
    q = q.astype(v_pages.dtype)
    interpret = current_target().interpret
    if kernel == "tpu_ragged":
        return tpu_ragged_attention(q, k_pages, v_pages, page_table, positions, window=window)
    if q.shape[1] != 1:
        raise ValueError(f"kernel {kernel!r} decodes one query per row, got T = {q.shape[1]}")
    fn = gpu_paged_attention if kernel == "gpu_paged" else tpu_paged_attention
    return fn(q[:, 0], k_pages, v_pages, page_table, positions[:, 0],
              interpret=interpret)[:, None]


def _head_split(b: int, kv: int) -> tuple[jax.sharding.AbstractMesh, tuple[str, ...]] | None:
    """(mesh, kv-head axes) over which a paged kernel runs per device: the axes the mesh and
    logical rules in context (``decode.decode_context``) split the K kv heads over (tensor),
    as ``ops.attention`` runs its kernels. The pool is every row's, so a row split is not one
    (the engine's mesh splits only heads). None when the heads are not split."""
    split = _kernel_split(b, kv)
    return None if split is None or not split[2] else (split[0], split[2])


def _divisor_at_most(n: int, cap: int) -> int:
    """The largest divisor of n that is at most cap (at least 1)."""
    return max(d for d in range(1, min(n, max(cap, 1)) + 1) if n % d == 0)


def _decode_lengths(position: jax.Array, page_table: jax.Array, page_size: int) -> jax.Array:
    """[B] keys each decode row sees: positions 0..position, capped at the table's W pages (the
    kernels read ``cdiv(length, ps)`` table entries; only an idle row could ask for more)."""
    return jnp.minimum(position + 1, page_table.shape[1] * page_size).astype(jnp.int32)


def gpu_paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                        page_table: jax.Array, position: jax.Array, *,
                        interpret: bool = False) -> jax.Array:
    """The Triton paged attention for one decode query per row.

    The kernel takes the pool as it is stored ([K, P, ps, H]) and the page table; it has no
    softmax scale, so q is scaled by ``1/sqrt(H)`` first (in q's dtype). Its ``block_h`` (16, the
    least it takes) blocks the G query heads of a kv head, padded up to 16: for G < 16 part of
    each block is idle work. Block sizes: ``GPU_PAGES_PER_BLOCK`` and the bounds beside it.

    Args:
      q: [B, N, H] queries.
      k_pages, v_pages: [K, P, ps, H].
      page_table: [B, W] int32.
      position: [B] int position of each row's query.
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
    """The Mosaic TPU paged attention for one decode query per row.

    The kernel takes the pool as it is stored ([K, P, ps, H]) and DMAs each row's pages from it;
    it has no softmax scale (q is scaled first) and reads every page as bfloat16 (its loader
    casts), so float32 pages are attended at bfloat16 precision. Pages are read in blocks of up
    to ``TPU_BLOCK_POSITIONS`` positions. Args and result as ``gpu_paged_attention``'s
    (``interpret``: run under ``pltpu.force_tpu_interpret_mode``, on a CPU).
    """
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
    """The ragged kernel's operands for B rows of T consecutive queries each.

    Every row is one of the kernel's sequences with T queries (``cu_q_lens = [0, T, 2T, ..]``)
    and ``start + T`` keys, its last T positions being the queries' own: the kernel's causal
    mask is then the position mask. A right-padded chunk's tail may run past the table's W
    pages; the table gets ``ceil(T / ps)`` more columns of the null page (page 0) so that those
    padding queries read something the kernel may index (their outputs are never used).

    Cost: the kernel wants keys and values interleaved by head in one [P, ps, 2K, H] array
    (head 2j keys, 2j + 1 values of kv head j): building it copies the layer's whole pool, per
    call. Storing the pages in that layout would remove the copy (not done: the other views and
    kernels read [K, P, ps, H]).

    Args:
      q: [B, T, N, H] queries.
      k_pages, v_pages: [K, P, ps, H] (keys already in this layout).
      page_table: [B, W] int32.
      positions: [B, T] int positions, consecutive per row.

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
    """The Mosaic TPU ragged paged attention over B rows of T queries (``ragged_inputs``).

    On a TPU its block sizes come from the kernel's tuned table; traced for a TPU from another
    backend (``kernel_target``, to export) the untuned defaults ``_RAGGED_UNTUNED_BLOCKS``.

    Args:
      q: [B, T, N, H] queries.
      k_pages, v_pages: [K, P, ps, H].
      page_table: [B, W] int32.
      positions: [B, T] int positions, consecutive per row.
      window: optional sliding window length.

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
