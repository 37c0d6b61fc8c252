"""Scaled dot-product attention, masks given as structure (positions, segments, window).

``q`` [B, T, N, H]; keys and values [B, K, S, H], query head r reading kv head ``r // G``. A
query at m sees a key at n iff ``n <= m`` (causal), ``n > m - window`` and both are in the same
non-zero segment (0: padding); one that sees none returns zeros. ``attention`` runs one of
``ATTENTION_IMPLS`` (docs/long-context.md): the einsum reference ``"xla"``, which the others
are tested against, ``"chunked"``, or a kernel (per device under a mesh).
"""

import functools
import importlib.util
import logging
import sys

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from transformer_jax.model.config import ATTENTION_IMPLS
from transformer_jax.model.ops import target
from transformer_jax.model.ops.chunked_attention import check_qkv as _check_qkv
from transformer_jax.model.ops.chunked_attention import check_structure as _check_structure
from transformer_jax.model.ops.chunked_attention import chunked_attention, softcap, visibility_mask
from transformer_jax.model.ops.chunked_attention import einsum_f32 as _dot
from transformer_jax.model.ops.chunked_attention import softcap as _softcap  # args shadow it
from transformer_jax.model.ops.context_attention import context_split, gathered_attention
from transformer_jax.model.ops.layouts import SlotsLast, stored_keys
from transformer_jax.model.ops.positions import chunk_segments

logger = logging.getLogger(__name__)


# Masked logits get this value rather than -inf, so that a row with no visible key stays finite.
_MASK_VALUE = float(jnp.finfo(jnp.float32).min)

# Platforms (``ops.target.platform()``) each accelerator implementation can run on.
_IMPL_BACKENDS = {"cudnn": ("gpu", "cuda"), "pallas": ("tpu", "gpu", "cuda"),
                  "mosaic": ("tpu", "gpu", "cuda")}

# "auto" on CPU leaves the einsum reference for the chunked path once the reference's float32
# logits [B, N, T, S] reach this many elements (measured: docs/long-context.md).
_AUTO_CHUNKED_MIN_LOGITS = 2 ** 23

_logged_choices: set[tuple[str, str]] = set()


# Masks -------------------------------------------------------------------------------------------

def attention_mask(q_positions: jax.Array, k_positions: jax.Array, *,
                   q_segments: jax.Array | None = None,
                   k_segments: jax.Array | None = None,
                   k_valid: jax.Array | None = None,
                   window: int | jax.Array | None = None,
                   causal: bool = True) -> jax.Array:
    """Boolean mask of which keys each query may attend to (the module docstring's rule).

    Args:
      q_positions, k_positions: [B, T], [B, S] int positions of the queries and keys.
      q_segments, k_segments: optional [B, T], [B, S] segment ids (0 = padding), together.
      k_valid: optional [B, S] bool, False for keys that must never be seen.
      window, causal: the sliding window (an int, maybe a traced scalar), causality.

    Returns:
      [B, T, S] bool.
    """
    chex.assert_rank([q_positions, k_positions], 2)
    if (q_segments is None) != (k_segments is None):
        raise ValueError("q_segments and k_segments must be given together")
    return visibility_mask(q_positions, k_positions, q_segments, k_segments, k_valid,
                           causal=causal, window=window)


# Reference ---------------------------------------------------------------------------------------

def attention_weights(q: jax.Array, k: jax.Array | SlotsLast, mask: jax.Array | None,
                      scale: float | None = None, *, softcap: float | None = None,
                      sinks: jax.Array | None = None) -> jax.Array:
    """Softmax attention probabilities, grouped over kv heads.

    Args:
      q, k: [B, T, N, H] queries, [B, K, S, H] keys (or ``SlotsLast`` [B, K, H, S]).
      mask: optional [B, T, S] bool (True = visible).
      scale: logit scale, default ``1/sqrt(H)``.
      softcap: optional logit soft-cap c: scaled logits x become ``c tanh(x / c)``.
      sinks: optional [N] sink logits: one more key per head, always visible, of value zero.

    Returns:
      [B, N, T, S] float32 probabilities, 0 on masked keys (and rows with no visible key).
    """
    # Batch dimensions (B, K): a tensor split of the kv heads keeps every row on its device.
    k, slots_last = stored_keys(k)
    logits_spec, k_rows = (("BKQH,BKHS->BKQS", k.swapaxes(2, 3)) if slots_last  # k_rows: for
                           else ("BKQH,BKSH->BKQS", k))  # the shape checks only
    _check_qkv(q, k_rows, k_rows, mask)
    b, t, n, h = q.shape
    kv, s = k_rows.shape[1], k_rows.shape[2]
    g = n // kv
    scale = h ** -0.5 if scale is None else scale
    qg = q.reshape(b, t, kv, g, h).transpose(0, 2, 3, 1, 4).reshape(b, kv, g * t, h)
    logits = _dot(logits_spec, qg, k) * scale
    if softcap is not None:
        logits = _softcap(logits, softcap)
    logits = logits.reshape(b, kv, g, t, s)
    if mask is not None:
        logits = jnp.where(mask[:, None, None], logits, _MASK_VALUE)
    if sinks is None:
        probs = jax.nn.softmax(logits, axis=-1)
    else:  # the sink: one more logit in the denominator, with no value
        sink = sinks.astype(jnp.float32).reshape(1, kv, g, 1, 1)
        top = jax.lax.stop_gradient(jnp.maximum(logits.max(-1, keepdims=True), sink))
        e = jnp.exp(logits - top)
        probs = e / (e.sum(-1, keepdims=True) + jnp.exp(sink - top))
    if mask is not None:
        probs = jnp.where(mask[:, None, None], probs, 0.0)
    return probs.reshape(b, n, t, s)


def reference_attention(q: jax.Array, k: jax.Array | SlotsLast, v: jax.Array,
                        mask: jax.Array | None, scale: float | None = None, *,
                        softcap: float | None = None, sinks: jax.Array | None = None
                        ) -> jax.Array:
    """Attention written out with einsums: ``softmax(q k^T * scale + mask) v``.

    Args:
      q, k, v: [B, T, N, H] queries, [B, K, S, H] keys (or ``SlotsLast``) and values.
      mask, scale, softcap, sinks: as ``attention_weights`` takes them.

    Returns:
      [B, T, N, H] in q's dtype.
    """
    _check_qkv(q, v, v, mask)
    b, t, n, h = q.shape
    kv, s = v.shape[1], v.shape[2]
    probs = attention_weights(q, k, mask, scale, softcap=softcap, sinks=sinks).reshape(
        b, kv, n // kv, t, s)
    out = _dot("BKQS,BKSH->BKQH", probs.astype(v.dtype).reshape(b, kv, n // kv * t, s), v)
    out = out.reshape(b, kv, n // kv, t, h).transpose(0, 3, 1, 2, 4)
    return out.reshape(b, t, n, h).astype(q.dtype)


# Entry point -------------------------------------------------------------------------------------

def _have_tokamax() -> bool:
    """Whether tokamax (the ``kernels`` extra) can be imported, without importing it."""
    if "tokamax" in sys.modules:
        return sys.modules["tokamax"] is not None
    return importlib.util.find_spec("tokamax") is not None


def choose_impl(q: jax.Array, k: jax.Array, backend: str | None = None, *,
                softcap: float | None = None, window: int | jax.Array | None = None,
                aligned: bool = True) -> str:
    """The implementation ``impl="auto"`` runs for these shapes on ``backend``: on GPU ``"cudnn"``
    for float16/bfloat16, H a multiple of 8 up to 128 and no soft-cap; on TPU ``"mosaic"`` for T
    and S multiples of 128 (without tokamax ``"pallas"`` where it applies); else ``"xla"`` while
    the [B, N, T, S] logits stay under ``_AUTO_CHUNKED_MIN_LOGITS`` elements, ``"chunked"`` above.

    Args:
      q, k: [B, T, N, H] queries and [B, K, S, H] keys (only shapes and dtype are read).
      backend: default the target's (``ops.target.platform()``).
      softcap, window: the call's logit soft-cap and sliding window.
      aligned: queries and keys are the same positions (training, a prefill from empty).

    Returns:
      One of ``ATTENTION_IMPLS`` other than ``"auto"``.
    """
    backend = target.platform() if backend is None else backend
    b, t, n, h = q.shape
    s = k.shape[2]
    if backend in ("gpu", "cuda") and q.dtype in (jnp.bfloat16, jnp.float16) and h % 8 == 0 \
            and h <= 128 and softcap is None:
        return "cudnn"
    if backend == "tpu" and t % 128 == 0 and s % 128 == 0:
        if _have_tokamax():
            return "mosaic"
        if aligned and t == s and window is None and softcap is None:
            return "pallas"
    if not all(isinstance(dim, int) for dim in (b, n, t, s)):
        return "xla"  # symbolic shapes (jax.export): the size test cannot be decided
    return "chunked" if b * n * t * s >= _AUTO_CHUNKED_MIN_LOGITS else "xla"


def _check_kernel(impl: str, softcap: float | None, sinks: jax.Array | None) -> None:
    """Refuses sinks, a backend and a soft-cap that kernel ``impl`` cannot take."""
    if sinks is not None:
        raise ValueError(f"attention impl={impl!r} has no attention sinks; use impl='auto', "
                         "'xla' or 'chunked'")
    backend = target.platform()
    if backend not in _IMPL_BACKENDS[impl]:
        raise ValueError(f"attention impl {impl!r} cannot run on backend {backend!r}; it needs "
                         f"one of {_IMPL_BACKENDS[impl]}. Use impl='auto', 'xla' or 'chunked'.")
    if softcap is not None and (impl == "cudnn" or (impl == "pallas" and backend == "tpu")):
        name = "cuDNN" if impl == "cudnn" else "JAX's Pallas TPU flash attention"
        raise ValueError(f"attention impl={impl!r} ({name}) has no logit softcap (got softcap="
                         f"{softcap}); use impl='xla' or 'chunked' (or 'mosaic', tokamax's "
                         "kernel, which caps)")


def _kernel_attention(impl, q, k, v, mask, scale, softcap=None):
    """The library kernels over a dense [B, T, S] mask, k/v in their [B, S, K, H] layout."""
    kt, vt = k.swapaxes(1, 2), v.swapaxes(1, 2)
    if impl == "cudnn":
        out = jax.nn.dot_product_attention(q, kt, vt, mask=mask[:, None], scale=scale,
                                           implementation="cudnn")
    else:
        import tokamax  # noqa: PLC0415 - heavy import, only for the kernel paths

        gpu = target.platform() in ("gpu", "cuda")
        name = "triton" if impl == "pallas" and gpu else "mosaic"
        out = tokamax.dot_product_attention(q, kt, vt, mask=mask[:, None], scale=scale,
                                            logits_soft_cap=softcap, implementation=name)
    # The kernels leave a row with no visible key undefined (uniform or NaN); define it as zero.
    return jnp.where(jnp.any(mask, axis=-1)[:, :, None, None], out, 0).astype(q.dtype)


def _pallas_tpu_attention(q, k, v, q_segments, k_segments, *, causal, scale):
    """JAX's Pallas TPU flash attention: causal by index, no window (callers ensure T == S and
    positions ascending per segment); K/V heads repeated G times."""
    from jax.experimental.pallas.ops.tpu import flash_attention as tpu_flash  # noqa: PLC0415

    g = q.shape[2] // k.shape[1]
    segment_ids = None if q_segments is None else tpu_flash.SegmentIds(
        q_segments.astype(jnp.int32), k_segments.astype(jnp.int32))
    out = tpu_flash.flash_attention(
        q.swapaxes(1, 2), jnp.repeat(k, g, axis=1), jnp.repeat(v, g, axis=1),
        segment_ids=segment_ids, causal=causal,
        sm_scale=q.shape[-1] ** -0.5 if scale is None else scale).swapaxes(1, 2)
    if q_segments is not None:  # the kernel lets padding (segment 0) attend to padding
        out = jnp.where((q_segments != 0)[:, :, None, None], out, 0)
    return out.astype(q.dtype)


def attention(q: jax.Array, k: jax.Array | SlotsLast, v: jax.Array, *, q_positions: jax.Array,
              k_positions: jax.Array | None = None, q_segments: jax.Array | None = None,
              k_segments: jax.Array | None = None, window: int | jax.Array | None = None,
              causal: bool = True, scale: float | None = None, impl: str = "auto",
              softcap: float | None = None, sinks: jax.Array | None = None,
              chunk: int | None = None) -> jax.Array:
    """Scaled dot-product attention with grouped kv heads and a structural mask.

    Args:
      q, k, v: [B, T, N, H] queries, [B, K, S, H] keys (or ``SlotsLast``) and values.
      q_positions, k_positions: [B, T] and optional [B, S] (default ``arange(S)``) positions.
      q_segments, k_segments: optional [B, T], [B, S] segment ids (0 = padding), together.
      window: optional sliding window, maybe a traced scalar (JAX's Pallas TPU kernel has none).
      causal, scale: as ``attention_mask`` and ``attention_weights`` take them.
      impl: one of ``ATTENTION_IMPLS``; a kernel raises ``ValueError`` on a backend it cannot
        run on, never falling back.
      softcap: optional logit soft-cap c (``"cudnn"`` and TPU ``"pallas"`` refuse one).
      sinks: optional [N] sink logits (``"xla"`` and ``"chunked"`` only).
      chunk: optional C (a Python int): a query at m sees only keys with ``n // C == m // C``.

    Returns:
      [B, T, N, H] in q's dtype; exactly zero for a query with no visible key.
    """
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
    if chunk is not None:
        if k_positions is None:
            k_positions = jnp.broadcast_to(jnp.arange(v.shape[2], dtype=jnp.int32),
                                           (v.shape[0], v.shape[2]))
        q_segments, k_segments = chunk_segments(q_positions, k_positions, chunk, q_segments,
                                                k_segments)
    # Self-attention of a sequence over itself (training's: keys at the queries' positions);
    # a KV cache's keys are never split.
    split = (context_split(q.shape[0], v.shape[1], q.shape[1])
             if k_positions is q_positions and q.shape[1] == v.shape[2]
             and not isinstance(k, SlotsLast) else None)
    if split is not None:  # the sequence is split over devices: keys and values gathered
        return gathered_attention(
            split, attention, q, k, v, q_positions=q_positions, k_positions=k_positions,
            q_segments=q_segments, k_segments=k_segments, sinks=sinks, window=window,
            causal=causal, scale=scale, impl=impl, softcap=softcap)
    pick = functools.partial(choose_impl, q, v, softcap=softcap, window=window,
                             aligned=k_positions is not None and k_positions is q_positions,
                             backend=None if sinks is None else "cpu")  # no kernel has sinks
    if isinstance(k, SlotsLast) and impl != "xla" and (impl != "auto" or pick() != "xla"):
        k = k.k.swapaxes(2, 3)
    if impl == "auto":
        impl = pick()
        key = (target.platform(), impl)
        if key not in _logged_choices:
            _logged_choices.add(key)
            fallback = (" (tokamax, the kernels extra, is not installed: JAX's Pallas TPU "
                        "flash attention instead of its 'mosaic')"
                        if key == ("tpu", "pallas") else "")
            logger.info("attention impl='auto' picked %r on backend %r%s (first seen at q %s, "
                        "k %s, %s)", impl, key[0], fallback, q.shape, k.shape, q.dtype)
    if impl in _IMPL_BACKENDS:
        _check_kernel(impl, softcap, sinks)
        split = _kernel_split(q.shape[0], v.shape[1])
        if split is not None:  # XLA cannot partition a kernel: each device runs its part
            return _per_device(split, functools.partial(
                attention, causal=causal, scale=scale, impl=impl, softcap=softcap), q, k, v,
                q_positions=q_positions, k_positions=k_positions, q_segments=q_segments,
                k_segments=k_segments, window=window)
    if impl == "chunked":
        return chunked_attention(q, k, v, q_positions=q_positions, k_positions=k_positions,
                                 q_segments=q_segments, k_segments=k_segments, window=window,
                                 causal=causal, scale=scale, softcap=softcap, sinks=sinks)
    q_positions, k_positions = _check_structure(q, v, v, q_positions, k_positions, q_segments,
                                                k_segments)
    if impl == "pallas" and target.platform() == "tpu":
        if window is not None or q.shape[1] != k.shape[2]:
            raise ValueError("impl='pallas' on TPU (index-causal flash attention) needs T == S "
                             "and no window; use impl='mosaic' or 'chunked'")
        return _pallas_tpu_attention(q, k, v, q_segments, k_segments, causal=causal, scale=scale)
    mask = attention_mask(q_positions, k_positions, q_segments=q_segments, k_segments=k_segments,
                          window=window, causal=causal)
    if impl == "xla":
        return reference_attention(q, k, v, mask, scale, softcap=softcap, sinks=sinks)
    return _kernel_attention(impl, q, k, v, mask, scale, softcap)


def _kernel_split(b: int, kv: int) -> tuple[jax.sharding.AbstractMesh, tuple[str, ...],
                                           tuple[str, ...]] | None:
    """(mesh, batch axes, kv-head axes) over which a kernel runs per device, or None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    batch_rule, heads_rule = nn.logical_to_mesh_axes(("batch", "kv_heads"))
    batch, heads = target.mesh_axes(mesh, batch_rule, b), target.mesh_axes(mesh, heads_rule, kv)
    return (mesh, batch, heads) if batch or heads else None


def _per_device(split, fn, q, k, v, **structure) -> jax.Array:
    """``fn(q, k, v, **structure)`` per device, on its rows, kv heads and their query heads."""
    mesh, batch, heads = split
    rows, by_head = batch or None, heads or None
    arrays = {name: x for name, x in structure.items() if isinstance(x, jax.Array)}
    specs = {name: P() if x.ndim == 0 else P(rows) for name, x in arrays.items()}

    def body(q, k, v, arrays):
        return fn(q, k, v, **{**structure, **arrays})

    return jax.shard_map(body, mesh=mesh, check_vma=False,
                         in_specs=(P(rows, None, by_head), P(rows, by_head), P(rows, by_head),
                                   specs),
                         out_specs=P(rows, None, by_head))(q, k, v, arrays)


__all__ = ["ATTENTION_IMPLS", "attention", "attention_mask", "attention_weights", "choose_impl",
           "chunked_attention", "reference_attention", "softcap"]
