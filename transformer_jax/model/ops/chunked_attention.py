"""Chunked (flash-style) attention in plain JAX, memory linear in the context on any backend:
each query block runs an online softmax over the key blocks it can see, and a ``custom_vjp``
recomputes each block from the saved log-sum-exp. Also the shared shape checks and einsum."""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp

from transformer_jax.model.ops import target

# Default blocks: [B, N, 256, 512] float32 logits per step (512 KiB per sequence and head).
BLOCK_Q = 256
BLOCK_K = 512


# Shared checks and einsum ------------------------------------------------------------------------

def check_qkv(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None) -> None:
    """Checks q [B, T, N, H], k/v [B, K, S, H] and an optional mask [B, T, S]."""
    chex.assert_rank([q, k, v], 4)
    chex.assert_equal_shape([k, v])
    chex.assert_equal(q.shape[0], k.shape[0])
    chex.assert_equal(q.shape[3], k.shape[3])
    if q.shape[2] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[2]}) must be a multiple of kv heads "
                         f"({k.shape[1]})")
    if mask is not None:
        chex.assert_shape(mask, (q.shape[0], q.shape[1], k.shape[2]))


def softcap(x: jax.Array, cap: float | jax.Array) -> jax.Array:
    """Soft-capping ``tanh(x / cap) * cap`` (~x for |x| << cap, bounded by ``cap``), any shape."""
    return jnp.tanh(x / cap) * cap


def einsum_f32(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """float32-accumulating einsum (on CPU, low-precision operands widened first: exact)."""
    if target.platform() == "cpu":
        a, b = a.astype(jnp.promote_types(a.dtype, jnp.float32)), b.astype(
            jnp.promote_types(b.dtype, jnp.float32))
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def check_structure(q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array,
                    k_positions: jax.Array | None, q_segments: jax.Array | None,
                    k_segments: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """Checks shapes; returns int32 positions with the default ``arange(S)`` filled in."""
    check_qkv(q, k, v, None)
    b, t, s = q.shape[0], q.shape[1], k.shape[2]
    if (q_segments is None) != (k_segments is None):
        raise ValueError("q_segments and k_segments must be given together")
    if k_positions is None:
        k_positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    chex.assert_shape(q_positions, (b, t))
    chex.assert_shape(k_positions, (b, s))
    if q_segments is not None:
        chex.assert_shape(q_segments, (b, t))
        chex.assert_shape(k_segments, (b, s))
    return q_positions.astype(jnp.int32), k_positions.astype(jnp.int32)


# Blockwise forward and backward -------------------------------------------------------------------

def visibility_mask(q_positions: jax.Array, k_positions: jax.Array, q_segments: jax.Array | None,
                    k_segments: jax.Array | None, k_valid: jax.Array | None, *, causal: bool,
                    window: int | jax.Array | None) -> jax.Array:
    """``ops.attention.attention_mask`` without its checks ([B, T, S] bool); k_valid [B?, S]."""
    qp, kp = q_positions[:, :, None], k_positions[:, None, :]
    mask = jnp.ones((qp.shape[0], qp.shape[1], kp.shape[2]), bool)
    if causal:
        mask &= kp <= qp
    if window is not None:
        mask &= kp > qp - window
    if q_segments is not None:
        mask &= (q_segments[:, :, None] == k_segments[:, None, :]) & (q_segments != 0)[:, :, None]
    if k_valid is not None:
        mask &= k_valid[..., None, :]
    return mask


def _pad_axis(x, axis, size, mode="constant"):
    if x is None or x.shape[axis] == size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, mode=mode)


def _block_ranges(pos, block):
    """Per-block [min, max] position over the batch: pos [B, nb * block] -> two [nb] arrays."""
    blocks = pos.reshape(pos.shape[0], -1, block)
    return blocks.min(axis=(0, 2)), blocks.max(axis=(0, 2))


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static layout of one chunked call: block sizes, lengths and the mask's flags."""

    t: int
    s: int
    bq: int
    bk: int
    causal: bool
    windowed: bool
    scale: float
    softcap: float | None = None
    sinks: bool = False

    @property
    def nq(self) -> int:
        return -(-self.t // self.bq)

    @property
    def nk(self) -> int:
        return -(-self.s // self.bk)

    def visible(self, q_range, k_range, window, i, j):
        """Whether block (i, j) may hold a visible pair (``window``: int32 scalar, maybe traced)."""
        ok = jnp.bool_(True)
        if self.causal:
            ok &= k_range[0][j] <= q_range[1][i]
        if self.windowed:
            ok &= k_range[1][j] > q_range[0][i] - window
        return ok

    def logits(self, q, k):
        """A block's scaled (and soft-capped) float32 logits [B, K, G, bq, bk]."""
        logits = einsum_f32("BKGTH,BKSH->BKGTS", q, k) * self.scale
        return logits if self.softcap is None else softcap(logits, self.softcap)


def _prepare(plan, q, k, v, qpos, kpos, qseg, kseg):
    """Pads to whole blocks (positions edge-padded) and views q as [B, K, G, Tp, H]."""
    b, t, n, h = q.shape
    kv = k.shape[1]
    tp, sp = plan.nq * plan.bq, plan.nk * plan.bk
    qg = q.reshape(b, t, kv, n // kv, h).transpose(0, 2, 3, 1, 4)
    qg = _pad_axis(qg, 3, tp)
    k, v = _pad_axis(k, 2, sp), _pad_axis(v, 2, sp)
    qpos, kpos = _pad_axis(qpos, 1, tp, "edge"), _pad_axis(kpos, 1, sp, "edge")
    qseg, kseg = _pad_axis(qseg, 1, tp), _pad_axis(kseg, 1, sp)
    return qg, k, v, qpos, kpos, qseg, kseg


def _loop(n, body, init):
    """``fori_loop(0, n, body, init)`` as a ``while_loop``: a ``scan`` under ``jax.checkpoint`` in
    ``nn.scan`` would stack each block's mask, [B, N, T, S] in all (docs/long-context.md)."""
    def step(carry):
        i, x = carry
        return i + 1, body(i, x)

    return jax.lax.while_loop(lambda carry: carry[0] < n, step, (jnp.int32(0), init))[1]


def _slice(x, start, size, axis):
    return None if x is None else jax.lax.dynamic_slice_in_dim(x, start, size, axis)


def online_softmax_init(rows: tuple[int, ...], h: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The empty (acc, max, sum) carry of ``online_softmax_step`` for query rows ``rows``."""
    return (jnp.zeros((*rows, h), jnp.float32), jnp.full(rows, -jnp.inf, jnp.float32),
            jnp.zeros(rows, jnp.float32))


def online_softmax_step(carry: tuple[jax.Array, jax.Array, jax.Array], logits: jax.Array,
                        values: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One key block of an online softmax (the flash-attention recurrence).

    Args:
      carry: float32 (acc [..., Q, H], m [..., Q], l [..., Q]): the value sum weighted by
        ``exp(logit - m)``, the running maximum logit and the running sum of ``exp(logit - m)``.
      logits: [..., Q, S] float32 scaled logits of this block, -inf at keys a query does not see.
      values: [..., S, H] this block's values.

    Returns:
      The carry with this block folded in.
    """
    acc, m, l = carry
    m_new = jnp.maximum(m, logits.max(-1))
    # A row with nothing visible yet keeps m = -inf; shift it by 0 so exp gives 0.
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(logits - m_safe[..., None])
    alpha = jnp.exp(m - m_safe)
    pv = einsum_f32("...QS,...SH->...QH", p.astype(values.dtype), values)
    return acc * alpha[..., None] + pv, m_new, l * alpha + p.sum(-1)


def online_softmax_merge(carry: tuple[jax.Array, jax.Array, jax.Array],
                         segments: jax.Array, num_segments: int
                         ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Merges ``online_softmax_step`` carries of disjoint key blocks by segment (split-K).

    Args:
      carry, segments, num_segments: U partial carries [U, ...], [U] their segment, R.

    Returns:
      R carries [R, ...], as if one loop had run over each segment's blocks.
    """
    acc, m, l = carry
    top = jax.ops.segment_max(m, segments, num_segments)
    top_safe = jnp.where(jnp.isfinite(top), top, 0.0)
    scale = jnp.exp(m - top_safe[segments])  # 0 for a partial that saw nothing (m = -inf)
    return (jax.ops.segment_sum(acc * scale[..., None], segments, num_segments), top,
            jax.ops.segment_sum(l * scale, segments, num_segments))


def online_softmax_sink(carry: tuple[jax.Array, jax.Array, jax.Array], sink: jax.Array
                        ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Folds a sink logit (broadcast against m [..., Q]) into a finished ``online_softmax_step``
    carry: one more denominator term with no value; a row that saw no key stays zero."""
    acc, m, l = carry
    m_new = jnp.maximum(m, sink)
    alpha = jnp.exp(m - m_new)  # 0 where m = -inf
    return acc * alpha[..., None], m_new, l * alpha + jnp.exp(sink - m_new)


def online_softmax_result(carry: tuple[jax.Array, jax.Array, jax.Array], dtype: jnp.dtype
                          ) -> tuple[jax.Array, jax.Array]:
    """(output [..., Q, H] in ``dtype``, log-sum-exp [..., Q]) of a finished ``online_softmax_step``
    carry: zeros and lse = +inf for a query that saw no key."""
    acc, m, l = carry
    empty = l == 0
    out = (acc / jnp.where(empty, 1.0, l)[..., None]).astype(dtype)
    # Rows with no visible key get lse = +inf, so the backward pass gives them p = 0.
    return out, jnp.where(empty, jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l)))


def _chunked_fwd_impl(plan, q, k, v, qpos, kpos, qseg, kseg, window, sinks):
    """Forward pass; returns the output [B, T, N, H] and its residuals (padded internal layout)."""
    b, t, n, h = q.shape
    qg, kp_, vp, qpos, kpos, qseg, kseg = _prepare(plan, q, k, v, qpos, kpos, qseg, kseg)
    q_range, k_range = _block_ranges(qpos, plan.bq), _block_ranges(kpos, plan.bk)
    bq, bk = plan.bq, plan.bk
    kv, g = qg.shape[1], qg.shape[2]
    rows = (b, kv, g * bq)  # each block's G query heads x bq queries, one row axis

    def q_block(i, carry):
        out, lse = carry
        qi = _slice(qg, i * bq, bq, 3)
        qp_i, qs_i = _slice(qpos, i * bq, bq, 1), _slice(qseg, i * bq, bq, 1)

        def k_block(j, c):
            def update(c):
                kj, vj = _slice(kp_, j * bk, bk, 2), _slice(vp, j * bk, bk, 2)
                valid = j * bk + jnp.arange(bk) < plan.s
                mask = visibility_mask(qp_i, _slice(kpos, j * bk, bk, 1), qs_i,
                                       _slice(kseg, j * bk, bk, 1), valid, causal=plan.causal,
                                       window=window if plan.windowed else None)
                logits = jnp.where(mask[:, None, None], plan.logits(qi, kj), -jnp.inf)
                return online_softmax_step(c, logits.reshape(*rows, bk), vj)

            return jax.lax.cond(plan.visible(q_range, k_range, window, i, j), update,
                                lambda c: c, c)

        carry = _loop(plan.nk, k_block, online_softmax_init(rows, h))
        if plan.sinks:  # the [N] sinks as each block row's [B, K, G * bq] sink
            carry = online_softmax_sink(carry, jnp.broadcast_to(
                sinks.astype(jnp.float32).reshape(1, kv, g, 1), (b, kv, g, bq)).reshape(rows))
        o_i, lse_i = online_softmax_result(carry, q.dtype)
        out = jax.lax.dynamic_update_slice_in_dim(out, o_i.reshape(b, kv, g, bq, h), i * bq, 3)
        lse = jax.lax.dynamic_update_slice_in_dim(lse, lse_i.reshape(b, kv, g, bq), i * bq, 3)
        return out, lse

    out = jnp.zeros(qg.shape, q.dtype)
    lse = jnp.zeros(qg.shape[:4], jnp.float32)
    out, lse = _loop(plan.nq, q_block, (out, lse))
    result = out[:, :, :, :t].transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)
    return result, (out, lse)


def _chunked_bwd_impl(plan, q, k, v, qpos, kpos, qseg, kseg, window, sinks, out, lse, d_out):
    """Backward pass: each block's probabilities recomputed from the saved log-sum-exp (outer loop
    over key blocks, inner over query blocks; dq a carried float32 accumulator)."""
    b, t, n, h = q.shape
    kv = k.shape[1]
    qg, kp_, vp, qpos, kpos, qseg, kseg = _prepare(plan, q, k, v, qpos, kpos, qseg, kseg)
    do = _pad_axis(d_out.reshape(b, t, kv, n // kv, h).transpose(0, 2, 3, 1, 4), 3, qg.shape[3])
    # D_r = sum_h dO_rh O_rh = sum_s P_rs dP_rs: the softmax backward's row term.
    delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    q_range, k_range = _block_ranges(qpos, plan.bq), _block_ranges(kpos, plan.bk)
    bq, bk = plan.bq, plan.bk

    def k_block(j, carry):
        dq, dk, dv = carry
        kj, vj = _slice(kp_, j * bk, bk, 2), _slice(vp, j * bk, bk, 2)
        kp_j, ks_j = _slice(kpos, j * bk, bk, 1), _slice(kseg, j * bk, bk, 1)
        valid = j * bk + jnp.arange(bk) < plan.s

        def q_block(i, c):
            def update(c):
                dk_j, dv_j, dq = c
                qi, do_i = _slice(qg, i * bq, bq, 3), _slice(do, i * bq, bq, 3)
                mask = visibility_mask(_slice(qpos, i * bq, bq, 1), kp_j,
                                       _slice(qseg, i * bq, bq, 1), ks_j, valid,
                                       causal=plan.causal, window=window if plan.windowed else None)
                logits = plan.logits(qi, kj)
                p = jnp.exp(logits - _slice(lse, i * bq, bq, 3)[..., None])
                p = jnp.where(mask[:, None, None], p, 0.0)
                dv_j += einsum_f32("BKGTS,BKGTH->BKSH", p.astype(do_i.dtype), do_i)
                dp = einsum_f32("BKGTH,BKSH->BKGTS", do_i, vj)
                ds = p * (dp - _slice(delta, i * bq, bq, 3)[..., None])  # d capped logits
                if plan.softcap is not None:  # d/dx c tanh(x / c) = 1 - tanh(x / c)^2
                    ds = ds * (1 - jnp.square(logits / plan.softcap))
                ds = ds * plan.scale
                dk_j += einsum_f32("BKGTS,BKGTH->BKSH", ds, qi.astype(jnp.float32))
                dq_i = _slice(dq, i * bq, bq, 3) + einsum_f32(
                    "BKGTS,BKSH->BKGTH", ds, kj.astype(jnp.float32))
                return dk_j, dv_j, jax.lax.dynamic_update_slice_in_dim(dq, dq_i, i * bq, 3)

            return jax.lax.cond(plan.visible(q_range, k_range, window, i, j), update,
                                lambda c: c, c)

        zeros = jnp.zeros(kj.shape, jnp.float32)
        dk_j, dv_j, dq = _loop(plan.nq, q_block, (zeros, zeros, dq))
        dk = jax.lax.dynamic_update_slice_in_dim(dk, dk_j, j * bk, 2)
        dv = jax.lax.dynamic_update_slice_in_dim(dv, dv_j, j * bk, 2)
        return dq, dk, dv

    init = (jnp.zeros(qg.shape, jnp.float32), jnp.zeros(kp_.shape, jnp.float32),
            jnp.zeros(vp.shape, jnp.float32))
    dq, dk, dv = _loop(plan.nk, k_block, init)
    dq = dq[:, :, :, :t].transpose(0, 3, 1, 2, 4).reshape(b, t, n, h).astype(q.dtype)
    s = k.shape[2]
    # A sink's probability is exp(sink - lse) and its value zero: d sink = -sum p_sink D.
    d_sinks = jnp.zeros_like(sinks)
    if plan.sinks:
        p_sink = jnp.exp(sinks.astype(jnp.float32).reshape(1, kv, n // kv, 1) - lse)
        d_sinks = -jnp.sum(p_sink * delta, axis=(0, 3)).reshape(n).astype(sinks.dtype)
    return dq, dk[:, :, :s].astype(k.dtype), dv[:, :, :s].astype(v.dtype), d_sinks


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunked(plan, q, k, v, qpos, kpos, qseg, kseg, window, sinks):
    return _chunked_fwd_impl(plan, q, k, v, qpos, kpos, qseg, kseg, window, sinks)[0]


def _chunked_fwd(plan, *args):
    result, (out, lse) = _chunked_fwd_impl(plan, *args)
    return result, (*args, out, lse)


def _chunked_bwd(plan, residuals, d_out):
    dq, dk, dv, d_sinks = _chunked_bwd_impl(plan, *residuals, d_out)
    return dq, dk, dv, None, None, None, None, None, d_sinks  # integers have no cotangent


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def chunked_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, q_positions: jax.Array,
                      k_positions: jax.Array | None = None,
                      q_segments: jax.Array | None = None,
                      k_segments: jax.Array | None = None,
                      window: int | jax.Array | None = None, causal: bool = True,
                      scale: float | None = None, softcap: float | None = None,
                      sinks: jax.Array | None = None,
                      block_q: int = BLOCK_Q, block_k: int = BLOCK_K) -> jax.Array:
    """Memory-efficient attention on any backend: memory linear in the context, plus one [B, N,
    block_q, block_k] block of float32 logits at a time.

    Args:
      q, k, v: [B, T, N, H] queries, [B, K, S, H] keys and values.
      q_positions, k_positions, q_segments, k_segments: as ``ops.attention.attention``'s.
      window, causal, scale, softcap, sinks: the same (sinks differentiable).
      block_q, block_k: block sizes (clipped to T and S).

    Returns:
      [B, T, N, H] in q's dtype; zeros for a query with no visible key.
    """
    q_positions, k_positions = check_structure(q, k, v, q_positions, k_positions, q_segments,
                                                k_segments)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    t, s = q.shape[1], k.shape[2]
    plan = _Plan(t, s, min(block_q, t), min(block_k, s), causal, window is not None,
                 float(scale), None if softcap is None else float(softcap), sinks is not None)
    window = jnp.asarray(0 if window is None else window, jnp.int32)
    if sinks is None:
        sinks = jnp.zeros((q.shape[2],), jnp.float32)
    else:
        chex.assert_shape(sinks, (q.shape[2],))
    return _chunked(plan, q, k, v, q_positions, k_positions, q_segments, k_segments, window, sinks)


__all__ = ["BLOCK_K", "BLOCK_Q", "check_qkv", "check_structure", "chunked_attention",
           "einsum_f32", "online_softmax_init", "online_softmax_merge", "online_softmax_result",
           "online_softmax_sink", "online_softmax_step", "softcap", "visibility_mask"]
