"""Inference: one jitted call from a batch of prompts to completions.

``generate`` validates everything on the host, right-pads the prompts to a length bucket (so
prompt lengths within a bucket share one compiled program) and runs ``generate_padded``, a
single traced function:

1. **Prefill.** ``forward`` over the padded [B, T] prompts at once, from an empty cache, on the
   same prepared weights as the decode (``decode_params``, or ``DecodeWeights`` prepared once by
   ``prepare``). Slot s holds position s, so the junk written at pad slots is hidden by
   causality and later overwritten. The LM head runs only at each prompt's last real token;
   those logits give the first new token.
2. **Decode.** A ``lax.while_loop`` that stops as soon as every sequence is done. Each step
   feeds the previous new token of every sequence at its own position and picks the next one.
   Finished sequences emit padding and their positions stop advancing.

Decode layout and why. Every step reads all weights and the whole cache, so a step should cost
about (weight bytes + cache bytes) / memory bandwidth. Measured on CPU, the model's own cached
forward run in such a loop was several times slower than that, for reasons the decode step here
avoids:

* the model stacks the per-layer caches into one [L, B, S, K, H] array each step, a full copy of
  the cache; here the loop carries one array per layer, which XLA updates in place;
* attention over a [B, S, K, H] cache makes XLA transpose the cache (batch dims B, K must be
  leading for its dot), i.e. another full copy per layer per step. Here a layer's cache is one
  row per (sequence, kv head): keys [B * K, H, S] (stored transposed) and values [B * K, S, H],
  so q [G, H] @ keys and probs [G, S] @ values both stream the cache in storage order, reading
  it once for all G query heads of a kv head (keys as [S, H] were read 2-4x slower). Merging B
  and K also matters at B = 1: a size-1 batch dimension made XLA duplicate the in-place cache
  update into a second fusion, three copies of the cache per step;
* stacked (scanned) weights are sliced per layer inside the loop, a copy of every weight per
  step; here the blocks are split once, with the rest of the preparation below;
* XLA transposed ``o_proj`` every step to match the attention output's layout; here every
  matrix is stored [out, in] (the faster layout for B-row products on CPU), with q/k/v and
  gate/up fused into one matrix each (``decode_params``). ``prepare`` does this once;
  ``generate`` on raw parameters does it per call (a transient copy of the weights).

The cache is stored in the compute dtype unless ``cache_dtype`` says otherwise; a bfloat16 cache
halves its memory, and the attention contractions then take bfloat16 operands with float32
accumulation. (On CPU, XLA's bfloat16 batched contractions stream 4-5x slower than float32
ones, so there it saves memory, not time.)

Tensor parallelism. XLA:CPU runs the attention contractions and most small ops of a step on
one thread, and one decode step is a chain of dependent ops, so a single device leaves cores
idle. With a mesh whose ``tensor`` axis has T devices (on CPU: one device per core, see
``sharding.configure_cpu_devices``), prefill and decode run under ``shard_map``: each device
holds K/T kv heads of the cache and the matching slices of every matrix, computes its heads'
attention and its part of the FFN, and the partial [D, B] outputs are summed with two
all-reduces per layer (the Megatron split); the logits' vocabulary rows are gathered at the end.
On GPU/TPU the same split is the usual multi-chip decode.

Prefill and decode are one function, ``forward`` (T tokens per sequence; T = 1 per decode
step), and under a tensor axis both run split. It reuses the model's ``Norm`` module and the
``ops`` functions; tests check its logits against a full forward of ``Transformer`` at every
step, its prefilled cache against the model's own cached forward, and tensor-parallel
generation against one device.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import numbers
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from transformer_jax import ops, sampling
from transformer_jax.config import ModelConfig
from transformer_jax.kv_cache import KVCache, cache_bytes
from transformer_jax.layers import Norm
from transformer_jax.model import abstract_params, unstack_blocks

logger = logging.getLogger(__name__)

Params = dict[str, Any]

#: Prompt lengths up to this are padded to the next power of two (at least ``MIN_BUCKET``);
#: longer ones to the next multiple of it. Powers of two keep the number of programs small for
#: short prompts, multiples of 64 keep the cache (which every step reads) tight for long ones.
BUCKET_MULTIPLE = 64
MIN_BUCKET = 8

#: The mesh axis a tensor-parallel decode splits heads, FFN and vocabulary over (as in training).
TENSOR_AXIS = "tensor"

# Masked attention logits; finite so a fully masked row cannot produce NaN.
_MASK_VALUE = float(jnp.finfo(jnp.float32).min)


# Shapes ------------------------------------------------------------------------------------------

def prompt_bucket(length: int) -> int:
    """The padded prompt length T used for a longest prompt of ``length`` tokens.

    Args:
      length: the longest prompt of the batch (>= 1).

    Returns:
      ``max(MIN_BUCKET, next power of two)`` up to ``BUCKET_MULTIPLE``, otherwise ``length``
      rounded up to a multiple of ``BUCKET_MULTIPLE``.
    """
    if length <= 0:
        raise ValueError(f"prompt length must be positive, got {length}")
    if length <= BUCKET_MULTIPLE:
        return max(MIN_BUCKET, 1 << (length - 1).bit_length())
    return -(-length // BUCKET_MULTIPLE) * BUCKET_MULTIPLE


def default_cache_size(config: ModelConfig, padded_len: int, max_new_tokens: int) -> int:
    """S_max for a padded prompt length T: ``T + max_new_tokens``, capped at the model's maximum.

    Decode reads every slot at every step, so the cache is kept as small as the request allows;
    it never needs more than ``max_seq_len`` slots because no position reaches it, and never
    fewer than T because prefill writes T slots.
    """
    return max(padded_len, min(padded_len + max_new_tokens, config.max_seq_len))


# Pytrees -----------------------------------------------------------------------------------------

@flax.struct.dataclass
class DecodeCache:
    """The decode-time KV cache: one keys array and one values array per layer.

    Rows are (tensor shard, sequence, kv head within the shard) in that order, so the rows of
    shard j are one contiguous block: with T shards of K / T kv heads each, a shard's block is
    [B * K/T, ...] (with T = 1, row ``b * K + k`` is kv head k of sequence b). Keys are stored
    transposed, so both attention contractions stream the cache in its storage order:
    q [G, H] @ keys [H, S] and probs [G, S] @ values [S, H], per row.

    Slot s of sequence b holds the key/value at position s (as in ``KVCache``); which slots are
    valid is tracked by the caller (``SamplingState.positions``).

    Attributes:
      k: L arrays [T * B * K/T, H, S_max] of keys (already rotated by RoPE).
      v: L arrays [T * B * K/T, S_max, H] of values.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @property
    def max_len(self) -> int:
        return self.v[0].shape[1]

    @property
    def nbytes(self) -> int:
        """``2 * L * B * S_max * K * H * bytes_per_element``."""
        return sum(x.size * x.dtype.itemsize for x in (*self.k, *self.v))

    @classmethod
    def from_kv_cache(cls, cache: KVCache, max_len: int | None = None,
                      shards: int = 1) -> DecodeCache:
        """Converts the model's [L, B, S, K, H] cache, padding it to ``max_len`` slots.

        Args:
          cache: a ``KVCache`` with S slots.
          max_len: S_max >= S; default S.
          shards: T, the number of tensor shards the kv heads are split into (divides K).

        Returns:
          The same keys/values in the layout above (new slots are zero).
        """
        n_layers, b, s, kv, h = cache.k.shape
        pad = 0 if max_len is None else max_len - s

        def convert(x: jax.Array, keys: bool) -> tuple[jax.Array, ...]:
            x = x.reshape(n_layers, b, s, shards, kv // shards, h)
            # -> [L, T, B, K/T, H, S] for keys, [L, T, B, K/T, S, H] for values.
            x = x.transpose((0, 3, 1, 4, 5, 2) if keys else (0, 3, 1, 4, 2, 5))
            x = x.reshape(n_layers, b * kv, *x.shape[-2:])
            if pad:
                widths = [(0, 0)] * 4
                widths[3 if keys else 2] = (0, pad)
                x = jnp.pad(x, widths)
            return tuple(x[i] for i in range(n_layers))

        return cls(k=convert(cache.k, True), v=convert(cache.v, False))


@flax.struct.dataclass
class SamplingState:
    """The carry of the decode loop.

    Attributes:
      step: [] int32 decode steps taken so far.
      tokens: [B, N] int32 generated ids; ``pad_id`` after a sequence stopped.
      logprobs: [B, N] float32 log-probabilities of ``tokens`` under the model (0 at padding).
      next_token: [B] int32 token each sequence feeds at the next step.
      positions: [B] int32 position (= cache slot) of ``next_token``.
      done: [B] bool sequences that emitted a stop token or ``max_new_tokens`` tokens.
      num_tokens: [B] int32 tokens generated so far (stop token included).
      keys: [B, 2] uint32 raw PRNG key data, one key per sequence; step i draws with
        ``fold_in(key, i)``.
      cache: the ``DecodeCache``.
    """

    step: jax.Array
    tokens: jax.Array
    logprobs: jax.Array
    next_token: jax.Array
    positions: jax.Array
    done: jax.Array
    num_tokens: jax.Array
    keys: jax.Array
    cache: DecodeCache


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
    """Static (compile-time) sampling settings; see ``transformer_jax.sampling``.

    Attributes:
      temperature: >= 0; 0 is greedy.
      top_k: None or k in [1, V].
      top_p: None or p in (0, 1].
      min_p: None or a value in [0, 1].
      stop_tokens: ids that end a sequence (the stop token is part of the output).
      pad_id: id emitted by finished sequences.
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    stop_tokens: tuple[int, ...] = ()
    pad_id: int = 0

    def validate(self, vocab_size: int) -> None:
        """Raises ValueError for any setting out of range for a vocabulary of V tokens."""
        sampling.validate_sampling_args(self.temperature, self.top_k, self.top_p, self.min_p,
                                        vocab_size)
        for tok in self.stop_tokens:
            if not _is_int(tok) or not 0 <= tok < vocab_size:
                raise ValueError(f"stop token {tok!r} is not a token id in [0, {vocab_size})")
        if not _is_int(self.pad_id) or not 0 <= self.pad_id < vocab_size:
            raise ValueError(f"pad_id {self.pad_id!r} is not a token id in [0, {vocab_size})")


@dataclasses.dataclass(frozen=True)
class GenerateResult:
    """What ``generate`` returns.

    Attributes:
      tokens: one list per prompt of the newly generated ids, without the prompt and without
        padding; a stop token that ended the sequence is included as its last id (as in
        HuggingFace's ``generate``).
      logprobs: per prompt, the log-probability of each id in ``tokens`` under the model's raw
        softmax (temperature 1, no filtering).
      lengths: per prompt, ``len(tokens[b])``.
      token_array: [B, N] int32, ``tokens`` right-padded with ``pad_id``.
      logprob_array: [B, N] float32, ``logprobs`` right-padded with 0.
    """

    tokens: list[list[int]]
    logprobs: list[list[float]]
    lengths: list[int]
    token_array: np.ndarray
    logprob_array: np.ndarray


# Model pieces ------------------------------------------------------------------------------------

def decode_params(config: ModelConfig, params: Params, shards: int = 1) -> Params:
    """The weights in the layout the decode step reads: prepared once per call, outside the loop.

    Per layer: ``qkv`` [(N + 2K) * H, D] (the q, k and v projections fused and transposed),
    ``o`` [D, N * H], and for the FFN ``inner`` [F or 2F, D] (``gate`` and ``up`` fused) and
    ``down`` [D, F]; norms and biases as they are; ``head`` [V, D] is the LM head (the embedding
    table when tied). Matrices are stored [out, in] because every decode matmul has only B rows,
    and on CPU such a product streams an [out, in] matrix about twice as fast as an [in, out]
    one at B = 8 (and no slower at B = 1); fusing also halves the number of matmuls per step.
    Scanned blocks are split per layer here too.

    For tensor parallelism over T shards, the fused rows are ordered shard by shard (shard j's
    q heads, then its k heads, its v heads; its gate rows, then its up rows), so splitting the
    ``qkv`` and ``inner`` rows, the ``o`` and ``down`` columns and the ``head`` rows into T
    equal blocks gives each shard the weights of its K/T kv heads, N/T query heads, F/T hidden
    units and V/T vocabulary rows (``decode_param_specs``).

    Args:
      config: the model's config.
      params: parameters in either layout.
      shards: T (divides K, N and F; see ``check_tensor_parallel``).

    Returns:
      A tree with ``embed``, ``final_norm``, ``head`` and ``blocks_{i}``.
    """
    c = config
    if "blocks" in params:
        params = unstack_blocks(params)
    if f"blocks_{c.n_layers - 1}" not in params:
        raise ValueError("params have neither 'blocks' nor 'blocks_{i}' entries for "
                         f"{c.n_layers} layers")
    d, dt = c.d_model, c.jnp_dtype

    def by_shard(*columns: jax.Array) -> jax.Array:
        """Columns [..., X_i] of each matrix, interleaved shard by shard along the last axis."""
        parts = [jnp.split(x, shards, axis=-1) for x in columns]
        return jnp.concatenate([p[j] for j in range(shards) for p in parts], axis=-1)

    table = params["embed"]["embedding"]
    out: Params = {"embed": params["embed"], "final_norm": params["final_norm"],
                   "head": (table if c.tie_embeddings else params["lm_head"].T).astype(dt)}
    for i in range(c.n_layers):
        p = params[f"blocks_{i}"]
        a, m = p["attn"], p["mlp"]
        qkv = by_shard(*(a[name].astype(dt).reshape(d, -1)
                         for name in ("q_proj", "k_proj", "v_proj")))
        inner = by_shard(m["gate"], m["up"]) if "gate" in m else m["up"]
        layer = {
            "qkv": qkv.T,
            "o": a["o_proj"].astype(dt).reshape(-1, d).T,
            "inner": inner.astype(dt).T,
            "down": m["down"].astype(dt).T,
            "attn_norm": p["attn_norm"],
            "mlp_norm": p["mlp_norm"],
        }
        if c.qkv_bias:
            layer["qkv_bias"] = by_shard(*(a[name].astype(dt).reshape(-1)
                                           for name in ("q_bias", "k_bias", "v_bias")))
        out[f"blocks_{i}"] = layer
    # Materialise the transposed copies: otherwise XLA folds the transposes back into the dots.
    return jax.lax.optimization_barrier(out)


def check_tensor_parallel(config: ModelConfig, shards: int) -> None:
    """Raises ValueError unless T = ``shards`` divides the kv heads, query heads and FFN width."""
    c = config
    if not _is_int(shards) or shards < 1:
        raise ValueError(f"the tensor axis size must be a positive int, got {shards!r}")
    bad = [f"{name}={value}" for name, value in (("n_kv_heads", c.n_kv_heads),
                                                 ("n_heads", c.n_heads), ("d_ff", c.d_ff))
           if value % shards]
    if bad:
        raise ValueError(f"tensor-parallel decode over {shards} shards needs each of n_kv_heads, "
                         f"n_heads and d_ff divisible by {shards}; got {', '.join(bad)}")


def decode_param_specs(config: ModelConfig, dparams: Params, axis: str, shards: int) -> Params:
    """``PartitionSpec``s splitting ``decode_params(config, params, T)`` over mesh axis ``axis``.

    The head's rows are split only when T divides V; otherwise every shard holds it whole.
    """
    rows, cols, whole = P(axis, None), P(None, axis), P()
    specs = jax.tree.map(lambda _: whole, dparams)
    if config.vocab_size % shards == 0:
        specs["head"] = rows
    for name, layer in dparams.items():
        if name.startswith("blocks_"):
            specs[name].update(qkv=rows, o=cols, inner=rows, down=cols)
            if "qkv_bias" in layer:
                specs[name]["qkv_bias"] = P(axis)
    return specs


@flax.struct.dataclass
class DecodeWeights:
    """A model's weights prepared once for ``generate``: the ``decode_params`` layout, placed.

    ``prepare`` builds it; ``generate(config, weights, ...)`` then skips the per-call
    preparation (a transient copy of every weight, tens of milliseconds of the time to first
    token even for a 25M model), and with a mesh each device holds only its block, so the
    original parameters can be dropped.

    Attributes:
      params: the ``decode_params`` tree (split over the mesh's tensor axis when there is one).
      config: the config they were prepared for (static).
      mesh: the mesh they are placed on, or None (static).
    """

    params: Params
    config: ModelConfig = flax.struct.field(pytree_node=False)
    mesh: Mesh | None = flax.struct.field(pytree_node=False, default=None)

    @property
    def nbytes(self) -> int:
        """Bytes of all the prepared weights (summed over their shards)."""
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self.params))


def prepare(config: ModelConfig, params: Params, mesh: Mesh | None = None) -> DecodeWeights:
    """Prepares ``params`` for ``generate`` once (see ``DecodeWeights``).

    Args:
      config: the model's config.
      params: the model's parameters (scanned or unrolled layout), on any device.
      mesh: optional mesh with a ``"tensor"`` axis (other axes of size 1): the weights are split
        over it as the tensor-parallel decode reads them (``decode_param_specs``).

    Returns:
      The ``DecodeWeights``; pass them to ``generate`` in place of ``params`` (with the same
      config; the mesh comes with them).

    Raises:
      ValueError: for a mesh the config cannot be split over (``check_tensor_parallel``).
    """
    check_tensor_parallel(config, tensor_shards(mesh))
    if mesh is not None:
        params = jax.device_put(params, NamedSharding(mesh, P()))
    return DecodeWeights(_prepare_fn(config, mesh)(params), config, mesh)


@functools.lru_cache(maxsize=32)
def _prepare_fn(config: ModelConfig, mesh: Mesh | None) -> Callable[[Params], Params]:
    """``decode_params`` jitted for one config and mesh, its outputs placed on the mesh."""
    shards = tensor_shards(mesh)
    fn = functools.partial(decode_params, config, shards=shards)
    if mesh is None:
        return jax.jit(fn)
    shapes = jax.eval_shape(fn, abstract_params(config))
    specs = decode_param_specs(config, shapes, TENSOR_AXIS, shards)
    return jax.jit(fn, out_shardings=jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                                                  is_leaf=lambda x: isinstance(x, P)))


def prefill(config: ModelConfig, params: Params, tokens: jax.Array, lengths: jax.Array,
            max_len: int | None = None, axis_name: str | None = None,
            dtype: jnp.dtype | str | None = None) -> tuple[jax.Array, DecodeCache]:
    """Runs right-padded prompts through the decode weights: next-token logits and the cache.

    ``forward`` over all T prompt tokens at once, from an empty cache; attention reads only the
    T slots being written (``span``), so the prefill's cost does not grow with S_max, and the
    LM head runs only at each prompt's last token.

    Args:
      config: the model's config.
      params: the weights from ``decode_params`` (this shard's block under ``shard_map``).
      tokens: [B, T] int32 prompts, right-padded; position t of row b goes to slot t.
      lengths: [B] int32 true prompt lengths, each in [1, T].
      max_len: S_max >= T slots of the returned cache; default T.
      axis_name: the tensor axis under ``shard_map``, or None.
      dtype: the cache's storage dtype; the model's compute dtype by default.

    Returns:
      ([B, V] float32 logits after each prompt's last token, a ``DecodeCache`` with slots
      0..T-1 written: pad slots hold junk that causality hides and the decode overwrites).
    """
    b, t = tokens.shape
    cache = empty_cache(config, params, b, max_len or t, dtype)
    return forward(config, params, cache, tokens, jnp.zeros((b,), jnp.int32),
                   axis_name=axis_name, span=t, logits_at=lengths.astype(jnp.int32) - 1)


def empty_cache(config: ModelConfig, params: Params, batch: int, max_len: int,
                dtype: jnp.dtype | str | None = None) -> DecodeCache:
    """A zero ``DecodeCache`` of S_max = ``max_len`` slots for the kv heads ``params`` hold.

    Under ``shard_map`` the rows are this shard's B * K/T (read off its ``qkv`` block). The
    storage dtype is ``dtype`` (default: the compute dtype); attention computes in the compute
    dtype either way.
    """
    h, g = config.head_dim, config.n_heads // config.n_kv_heads
    kv = params["blocks_0"]["qkv"].shape[0] // (h * (g + 2))
    dt = jnp.dtype(dtype or config.dtype)
    k = tuple(jnp.zeros((batch * kv, h, max_len), dt) for _ in range(config.n_layers))
    v = tuple(jnp.zeros((batch * kv, max_len, h), dt) for _ in range(config.n_layers))
    return DecodeCache(k=k, v=v)


def _write(cache: jax.Array, new: jax.Array, starts: jax.Array, keys: bool) -> jax.Array:
    """Writes T new slots per row at slots starts[b] .. starts[b] + T - 1 of its sequence.

    Args:
      cache: keys [R, H, S] (a column per slot) or values [R, S, H], R = B * K' rows.
      new: keys [R, H, T] or values [R, T, H].
      starts: [B] int32 slot of each sequence's first new token.

    Both forms update the loop-carried cache in place. At B = 1 the batched form (a scatter)
    would become a bounds-checked select that copies the whole cache every step, so a plain
    dynamic-update-slice is used there.
    """
    rows = cache.shape[0]
    b = starts.shape[0]
    new = new.astype(cache.dtype)
    if isinstance(b, int) and b == 1:
        start = (0, 0, starts[0]) if keys else (0, starts[0], 0)
        return jax.lax.dynamic_update_slice(cache, new, start)
    row_starts = jnp.broadcast_to(starts[:, None], (b, rows // b)).reshape(rows)

    def one(c: jax.Array, n: jax.Array, start: jax.Array) -> jax.Array:
        return jax.lax.dynamic_update_slice(c, n, (0, start) if keys else (start, 0))
    return jax.vmap(one)(cache, new, row_starts)


def _linear(w: jax.Array, x: jax.Array) -> jax.Array:
    """[Out, In] x [In, B*T] -> [Out, B*T], materialised in that orientation.

    Activations are kept feature-major ([D, B*T]) through the forward: XLA's CPU matmul streams
    an [Out, In] matrix 1.4-2.3x faster at B = 8 (no slower at B = 1) when the output is
    [Out, B] rather than [B, Out]. The barrier stops XLA from folding a later transpose into
    the dot, which would switch it back to the slow orientation.
    """
    return jax.lax.optimization_barrier(jnp.dot(w, x))


def _attention(c: ModelConfig, p: Params, x: jax.Array, starts: jax.Array,
               visible: jax.Array, cache_k: jax.Array, cache_v: jax.Array, span: int | None
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """T tokens of attention over this shard's K' kv heads: [D, B*T] -> partial [D, B*T].

    Args:
      starts: [B] int32 position (= slot) of each sequence's first token.
      visible: [B, T, S] bool, the slots each token may attend to (S = ``span`` or S_max).
      cache_k, cache_v: this shard's [B * K', H, S_max] keys and [B * K', S_max, H] values.
      span: attend to the first ``span`` slots only (static), or all slots when None.

    Returns:
      (this shard's term of the attention output [D, B*T], updated keys, updated values).
    """
    dt = c.jnp_dtype
    b = starts.shape[0]
    t = x.shape[1] // b
    h, g = c.head_dim, c.n_heads // c.n_kv_heads
    rows = cache_k.shape[0]
    kv = rows // b
    n = kv * g
    qkv = _linear(p["qkv"], x)
    if c.qkv_bias:
        qkv = qkv + p["qkv_bias"][:, None]
    qkv = qkv.T.reshape(b, t, (n + 2 * kv) * h)
    q = qkv[..., :n * h].reshape(b, t, n, h)
    k = qkv[..., n * h:(n + kv) * h].reshape(b, t, kv, h)
    v = qkv[..., (n + kv) * h:].reshape(b, t, kv, h)
    if c.position == "rope":
        rope = dict(base=c.rope_base, pairing=c.rope_pairing, scaling=c.rope_scaling)
        positions = starts[:, None] + jnp.arange(t, dtype=starts.dtype)
        q = ops.apply_rope(q, positions, **rope)
        k = ops.apply_rope(k, positions, **rope)
    cache_k = _write(cache_k, k.transpose(0, 2, 3, 1).reshape(rows, h, t), starts, keys=True)
    cache_v = _write(cache_v, v.transpose(0, 2, 1, 3).reshape(rows, t, h), starts, keys=False)
    keys, values = cache_k, cache_v
    if span is not None:
        keys, values = cache_k[:, :, :span], cache_v[:, :span]
    # Row (b, k) holds kv head k; its G query heads k * G .. k * G + G - 1 (as in ops.attention)
    # and T tokens are its G * T query rows, so every row's cache is streamed once for all.
    q = q.reshape(b, t, kv, g, h).transpose(0, 2, 3, 1, 4).reshape(rows, g * t, h)
    # The contractions take their operands in the cache's dtype (accumulating in float32):
    # converting the cache instead would materialise a converted copy of it every step.
    cdt = cache_k.dtype
    logits = jnp.einsum("RQH,RHS->RQS", q.astype(cdt), keys,
                        preferred_element_type=jnp.float32) * h ** -0.5
    s = logits.shape[-1]
    logits = jnp.where(visible[:, None, None], logits.reshape(b, kv, g, t, s), _MASK_VALUE)
    probs = jax.nn.softmax(logits, axis=-1).reshape(rows, g * t, s)
    out = jnp.einsum("RQS,RSH->RQH", probs.astype(cdt), values,
                     preferred_element_type=jnp.float32).astype(dt)
    out = out.reshape(b, kv, g, t, h).transpose(0, 3, 1, 2, 4).reshape(b * t, n * h)
    return _linear(p["o"], out.T), cache_k, cache_v


def _ffn(c: ModelConfig, p: Params, x: jax.Array) -> jax.Array:
    """This shard's term of the FFN (``ops.FFN_FUNCTIONS[c.ffn]``) on [D, B*T]."""
    hidden = _linear(p["inner"], x)
    if c.ffn in ("swiglu", "geglu"):
        gate, up = jnp.split(hidden, 2, axis=0)
        act = jax.nn.silu(gate) if c.ffn == "swiglu" else jax.nn.gelu(gate, approximate=False)
        hidden = act * up
    elif c.ffn == "gelu":
        hidden = jax.nn.gelu(hidden, approximate=False)
    else:
        hidden = jax.nn.relu(hidden)
    return _linear(p["down"], hidden)


def forward(config: ModelConfig, params: Params, cache: DecodeCache, tokens: jax.Array,
            starts: jax.Array, *, axis_name: str | None = None, span: int | None = None,
            logits_at: jax.Array | None = None) -> tuple[jax.Array, DecodeCache]:
    """Feeds T tokens per sequence through the decode weights, reading and writing the cache.

    Computes what ``Transformer(config).apply(..., tokens, positions, cache=...)`` computes for
    the same keys/values, in the layout ``decode_params`` prepares (see the module docstring).
    The prefill is this with T = the padded prompt length; a decode step with T = 1.

    Under ``shard_map`` over a tensor axis, ``params`` and ``cache`` are this shard's blocks
    (``decode_param_specs``, ``DecodeCache``): each shard computes its heads' attention and its
    part of the FFN, the partial outputs are summed over ``axis_name`` (two all-reduces of
    [D, B*T] per layer) and the logits gathered when the head is split.

    Args:
      config: the model's config.
      params: the weights prepared by ``decode_params`` (this shard's block under shard_map).
      cache: the ``DecodeCache`` (this shard's rows); slots ``< starts[b]`` must be filled.
      tokens: [B, T] int32 tokens to feed.
      starts: [B] int32 position of each row's first token; token t goes to position (and
        slot) ``starts[b] + t``, which must be < S_max (callers check capacity, as writes past
        the end are clamped).
      axis_name: the mesh axis the weights and cache are split over, or None.
      span: static; attend to the first ``span`` slots only (a prefill from an empty cache
        needs the T it writes), or to all S_max slots when None.
      logits_at: optional [B] int32 index in [0, T) per row, the token whose next-token logits
        are wanted (a prompt's last real token); default the last of the T. The final norm and
        the LM head run for that token only.

    Returns:
      ([B, V] float32 next-token logits after token ``logits_at`` of each row, the updated
      cache).
    """
    c = config
    dt = c.jnp_dtype
    b, t = tokens.shape
    positions = starts[:, None] + jnp.arange(t, dtype=starts.dtype)  # [B, T]
    x = ops.embed(tokens, params["embed"]["embedding"]).astype(dt)
    if c.position == "sinusoidal":
        x = x + ops.sinusoidal_positions(positions, c.d_model).astype(dt)
    x = x.reshape(b * t, c.d_model).T  # [D, B*T] from here on (see _linear)
    slots = jnp.arange(span or cache.max_len, dtype=positions.dtype)
    visible = slots <= positions[:, :, None]  # [B, T, S]
    if c.sliding_window is not None:
        visible &= slots > positions[:, :, None] - c.sliding_window

    def total(y: jax.Array) -> jax.Array:
        return y if axis_name is None else jax.lax.psum(y, axis_name)

    norm = Norm(kind=c.norm, eps=c.norm_eps, param_dtype=c.jnp_param_dtype)
    new_k, new_v = [], []
    for i in range(c.n_layers):
        p = params[f"blocks_{i}"]

        def attend(y: jax.Array, i: int = i, p: Params = p) -> jax.Array:
            out, k_i, v_i = _attention(c, p, y, starts, visible, cache.k[i], cache.v[i], span)
            new_k.append(k_i)
            new_v.append(v_i)
            return total(out)

        def normed(name: str, y: jax.Array, p: Params = p) -> jax.Array:
            return norm.apply({"params": p[name]}, y.T).T

        if c.norm_position == "pre":
            x = x + attend(normed("attn_norm", x))
            x = x + total(_ffn(c, p, normed("mlp_norm", x)))
        else:
            x = normed("attn_norm", x + attend(x))
            x = normed("mlp_norm", x + total(_ffn(c, p, x)))
    x = x.reshape(c.d_model, b, t)
    x = x[:, :, -1] if logits_at is None else x[:, jnp.arange(b), logits_at]  # [D, B]
    x = norm.apply({"params": params["final_norm"]}, x.T).T
    logits = jax.lax.optimization_barrier(
        jnp.einsum("VD,DX->VX", params["head"], x, preferred_element_type=jnp.float32))
    if axis_name is not None and logits.shape[0] != c.vocab_size:
        logits = jax.lax.all_gather(logits, axis_name, axis=0, tiled=True)
    return logits.T, DecodeCache(k=tuple(new_k), v=tuple(new_v))


def decode_step(config: ModelConfig, params: Params, cache: DecodeCache, tokens: jax.Array,
                positions: jax.Array, axis_name: str | None = None
                ) -> tuple[jax.Array, DecodeCache]:
    """One decode step, ``forward`` with T = 1: [B] tokens at [B] positions -> [B, V] logits.

    Returns:
      ([B, V] float32 logits for the next token, updated cache).
    """
    return forward(config, params, cache, tokens[:, None], positions, axis_name=axis_name)


# Streaming ---------------------------------------------------------------------------------------

# Stream callbacks by id: the compiled program receives only the id (a traced int), so a new
# callback does not recompile and concurrent calls do not see each other's callbacks.
_STREAMS: dict[int, Callable[[int, np.ndarray, np.ndarray], None]] = {}
_STREAM_IDS = itertools.count(1)
_STREAM_LOCK = threading.Lock()


def _emit(stream_id: np.ndarray, step: np.ndarray, tokens: np.ndarray,
          active: np.ndarray) -> None:
    callback = _STREAMS.get(int(stream_id))
    if callback is not None:
        callback(int(step), np.asarray(tokens), np.asarray(active))


def _argmax(logits: jax.Array) -> jax.Array:
    """[B, V] -> [B] int32 first index of the maximum, as ``jnp.argmax``.

    Written as a max and a min because XLA's CPU argmax (one variadic reduce) is not vectorised:
    this is 2-3x faster, which is 10% of a step for small models.
    """
    v = logits.shape[-1]
    top = jnp.max(logits, axis=-1, keepdims=True)
    return jnp.min(jnp.where(logits == top, jnp.arange(v, dtype=jnp.int32), v), axis=-1)


# The traced generate -----------------------------------------------------------------------------

def tensor_shards(mesh: Mesh | None) -> int:
    """T, the size of ``mesh``'s tensor axis (1 without a mesh).

    Raises:
      ValueError: if the mesh has no ``TENSOR_AXIS`` or another axis larger than 1.
    """
    if mesh is None:
        return 1
    sizes = dict(mesh.shape)
    if TENSOR_AXIS not in sizes:
        raise ValueError(f"decode needs a mesh with a '{TENSOR_AXIS}' axis, got axes "
                         f"{tuple(sizes)}")
    others = {k: v for k, v in sizes.items() if k != TENSOR_AXIS and v > 1}
    if others:
        raise ValueError(f"decode splits the model over the '{TENSOR_AXIS}' axis only; the other "
                         f"mesh axes must have size 1, got {others}")
    return sizes[TENSOR_AXIS]


def generate_padded(config: ModelConfig, params: Params | DecodeWeights, tokens: jax.Array,
                    lengths: jax.Array, key_data: jax.Array, stream_id: jax.Array | None = None,
                    *, max_new_tokens: int, settings: SamplingSettings = SamplingSettings(),
                    cache_size: int | None = None, mesh: Mesh | None = None,
                    cache_dtype: str | None = None
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Prefill plus while-loop decode on padded arrays: the traced body of ``generate``.

    Shape-polymorphic in B and T (``export.py`` exports it with symbolic dims). Performs no
    validation: ``generate`` checks capacity, ids and settings on the host first.

    Args:
      config: the model's config (static).
      params: ``DecodeWeights`` from ``prepare`` (for this config and mesh), or the model's
        parameters in either layout (then prepared here, a transient copy per call).
      tokens: [B, T] int32 prompts right-padded to T (any in-vocabulary pad id).
      lengths: [B] int32 true prompt lengths, each in [1, T].
      key_data: [B, 2] uint32 raw PRNG key per sequence (``jax.random.key_data``).
      stream_id: optional [] int32 id of a callback registered in ``_STREAMS``; when given,
        every step calls it on the host with (step, tokens [B], active [B]).
      max_new_tokens: N (static), the most tokens generated per sequence.
      settings: static sampling settings.
      cache_size: static S_max; default ``T + N``. Must be >= T and >= every length + N - 1.
      mesh: static; with a tensor axis of size T > 1, prefill and decode run tensor-parallel
        over it (``forward`` under ``shard_map``).
      cache_dtype: static storage dtype name of the KV cache; the compute dtype by default.

    Returns:
      tokens [B, N] int32 (``pad_id`` after a sequence ends), logprobs [B, N] float32 (0 at
      padding), num_tokens [B] int32 generated per sequence (stop token included).
    """
    shards = tensor_shards(mesh)
    if isinstance(params, DecodeWeights):
        weights = params.params
    else:
        weights = decode_params(config, params, shards)
    run = functools.partial(_prefill_and_decode, config, stream_id=stream_id,
                            max_new_tokens=max_new_tokens, settings=settings,
                            cache_size=cache_size, cache_dtype=cache_dtype,
                            axis_name=TENSOR_AXIS if shards > 1 else None)
    if shards > 1:
        run = jax.shard_map(
            run, mesh=mesh, check_vma=False,
            in_specs=(decode_param_specs(config, weights, TENSOR_AXIS, shards), P(), P(), P()),
            out_specs=(P(), P(), P()))
    return run(weights, tokens, lengths, key_data)


def _prefill_and_decode(config: ModelConfig, weights: Params, tokens: jax.Array,
                        lengths: jax.Array, key_data: jax.Array, *,
                        stream_id: jax.Array | None, max_new_tokens: int,
                        settings: SamplingSettings, cache_size: int | None,
                        cache_dtype: str | None, axis_name: str | None
                        ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``generate_padded`` on one shard's weights (all of them without a tensor axis)."""
    b, t = tokens.shape
    n = max_new_tokens
    logits, cache = prefill(config, weights, tokens, lengths,
                            t + n if cache_size is None else cache_size, axis_name, cache_dtype)
    last = lengths.astype(jnp.int32) - 1
    state = SamplingState(
        step=jnp.zeros((), jnp.int32),
        tokens=jnp.full((b, n), settings.pad_id, jnp.int32),
        logprobs=jnp.zeros((b, n), jnp.float32),
        next_token=jnp.zeros((b,), jnp.int32),  # the first advance sets it
        positions=last,
        done=jnp.zeros((b,), bool),
        num_tokens=jnp.zeros((b,), jnp.int32),
        keys=key_data.astype(jnp.uint32),
        cache=cache,
    )
    return _decode_loop(config, weights, state, logits, stream_id=stream_id, max_new_tokens=n,
                        settings=settings, axis_name=axis_name)


def _decode_loop(config: ModelConfig, dparams: Params, state: SamplingState,
                 first_logits: jax.Array, *, stream_id: jax.Array | None, max_new_tokens: int,
                 settings: SamplingSettings, axis_name: str | None
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Samples the first token from the prefill's logits, then the ``lax.while_loop`` of
    decode steps (one shard's view under ``shard_map``).

    ``state.positions`` start at each prompt's last token and ``first_logits`` [B, V] are its
    next-token logits; the first advance picks the first token from them.
    """
    n = max_new_tokens
    stop = jnp.asarray(settings.stop_tokens, jnp.int32)
    greedy = settings.temperature == 0

    def cond(s: SamplingState) -> jax.Array:
        return (s.step < n) & ~jnp.all(s.done)

    def advance(s: SamplingState, logits: jax.Array, cache: DecodeCache) -> SamplingState:
        """Picks each sequence's token from its [B, V] logits and records it."""
        if greedy:
            tok = _argmax(logits)
            logprob = sampling.token_logprobs(logits, tok)
        else:
            keys = jax.random.wrap_key_data(s.keys)
            step_keys = jax.vmap(jax.random.fold_in, (0, None))(keys, s.step)
            tok, logprob = sampling.sample_with_logprobs(
                logits, step_keys, temperature=settings.temperature, top_k=settings.top_k,
                top_p=settings.top_p, min_p=settings.min_p)
        active = ~s.done
        tok = jnp.where(active, tok, settings.pad_id)
        logprob = jnp.where(active, logprob, 0.0)
        num_tokens = s.num_tokens + active
        done = s.done | (num_tokens >= n)
        if settings.stop_tokens:
            done |= active & jnp.isin(tok, stop)
        if stream_id is not None:
            _stream(stream_id, s.step, tok, active, axis_name)
        return SamplingState(
            step=s.step + 1,
            tokens=jax.lax.dynamic_update_slice(s.tokens, tok[:, None], (0, s.step)),
            logprobs=jax.lax.dynamic_update_slice(s.logprobs, logprob[:, None], (0, s.step)),
            next_token=tok,
            # A finished sequence keeps its position, so its (ignored) writes stay in range.
            positions=jnp.where(done, s.positions, s.positions + 1),
            done=done,
            num_tokens=num_tokens,
            keys=s.keys,
            cache=cache,
        )

    def body(s: SamplingState) -> SamplingState:
        return advance(s, *decode_step(config, dparams, s.cache, s.next_token, s.positions,
                                       axis_name))

    state = advance(state, first_logits, state.cache)
    state = jax.lax.while_loop(cond, body, state)
    return state.tokens, state.logprobs, state.num_tokens


def _stream(stream_id: jax.Array, step: jax.Array, tokens: jax.Array, active: jax.Array,
            axis_name: str | None) -> None:
    """Calls the host stream callback once per step (from shard 0 only under shard_map)."""
    if axis_name is None:
        jax.debug.callback(_emit, stream_id, step, tokens, active, ordered=True)
        return
    jax.lax.cond(jax.lax.axis_index(axis_name) == 0,
                 lambda: jax.debug.callback(_emit, stream_id, step, tokens, active),
                 lambda: None)


#: The arguments of ``generate_padded`` that are compile-time constants.
GENERATE_STATIC_ARGNAMES = ("config", "max_new_tokens", "settings", "cache_size", "mesh",
                            "cache_dtype")
_generate_jit = jax.jit(generate_padded, static_argnames=GENERATE_STATIC_ARGNAMES)


# Host side ---------------------------------------------------------------------------------------

def _float_dtype_name(dtype: Any) -> str:
    """The name of a floating dtype (a static, hashable argument), or ValueError."""
    try:
        dt = jnp.dtype(dtype)
    except TypeError as e:
        raise ValueError(f"cache_dtype {dtype!r} is not a dtype") from e
    if not jnp.issubdtype(dt, jnp.floating):
        raise ValueError(f"cache_dtype must be a floating dtype, got {dt.name}")
    return dt.name


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def validate_prompts(prompts: Sequence[Sequence[int]], vocab_size: int) -> list[np.ndarray]:
    """Checks prompts are non-empty lists of ids in [0, V) and returns them as int32 arrays.

    Raises:
      ValueError: for an empty list, an empty prompt, a non-integer or out-of-range id, naming
        the prompt index and the value.
    """
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence | np.ndarray):
        raise ValueError(f"prompts must be a list of lists of token ids, got {type(prompts)}")
    if len(prompts) == 0:
        raise ValueError("prompts is empty: give at least one prompt")
    arrays = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, (str, bytes)):
            raise ValueError(f"prompt {i} is a string; tokenize it first")
        arr = np.asarray(prompt)
        if arr.ndim != 1:
            raise ValueError(f"prompt {i} must be a flat list of token ids, got shape {arr.shape}")
        if arr.size == 0:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        if not (np.issubdtype(arr.dtype, np.integer) or
                all(_is_int(x) for x in prompt)):
            raise ValueError(f"prompt {i} has non-integer token ids: {list(prompt)[:8]}")
        bad = (arr < 0) | (arr >= vocab_size)
        if np.any(bad):
            j = int(np.argmax(bad))
            raise ValueError(f"prompt {i} has token id {int(arr[j])} at index {j}, outside the "
                             f"vocabulary [0, {vocab_size})")
        arrays.append(arr.astype(np.int32))
    return arrays


def validate_capacity(config: ModelConfig, prompt_lengths: Sequence[int], max_new_tokens: int,
                      cache_size: int | None = None) -> None:
    """Checks that every prompt plus ``max_new_tokens`` fits the model and the cache.

    Raises:
      ValueError: for a non-positive ``max_new_tokens``, or a prompt length + max_new_tokens
        above ``config.max_seq_len`` or ``cache_size``, naming the numbers.
    """
    if not _is_int(max_new_tokens) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if cache_size is not None and (not _is_int(cache_size) or cache_size <= 0):
        raise ValueError(f"cache_size must be a positive int, got {cache_size!r}")
    longest = max(prompt_lengths)
    i = list(prompt_lengths).index(longest)
    if longest + max_new_tokens > config.max_seq_len:
        raise ValueError(
            f"prompt {i} has {longest} tokens; with max_new_tokens={max_new_tokens} that is "
            f"{longest + max_new_tokens} positions, more than the model's max_seq_len "
            f"{config.max_seq_len}")
    if cache_size is not None and longest + max_new_tokens > cache_size:
        raise ValueError(
            f"prompt {i} has {longest} tokens; with max_new_tokens={max_new_tokens} that needs "
            f"{longest + max_new_tokens} cache slots, more than cache_size {cache_size}")


def sequence_keys(seed: int | Sequence[int], batch: int) -> np.ndarray:
    """Raw PRNG key data [B, 2] uint32, one key per sequence.

    Args:
      seed: an int (sequence b gets ``fold_in(key(seed), b)``) or one int per sequence (sequence
        b gets ``key(seed[b])``, so it samples the same alone as in any batch).
      batch: B.
    """
    if _is_int(seed):
        keys = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(seed),
                                                        jnp.arange(batch, dtype=jnp.uint32))
    else:
        seeds = list(seed)
        if len(seeds) != batch or not all(_is_int(s) for s in seeds):
            raise ValueError(f"seed must be an int or {batch} ints (one per prompt), got {seed!r}")
        keys = jax.vmap(jax.random.key)(jnp.asarray(seeds, jnp.uint32))
    return np.asarray(jax.random.key_data(keys))


def pad_prompts(prompts: Sequence[np.ndarray], length: int, pad_id: int = 0
                ) -> tuple[np.ndarray, np.ndarray]:
    """Right-pads prompts into ([B, length] int32 tokens, [B] int32 lengths)."""
    tokens = np.full((len(prompts), length), pad_id, np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    return tokens, np.asarray([len(p) for p in prompts], np.int32)


def generate(config: ModelConfig, params: Params | DecodeWeights,
             prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
             temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, min_p: float | None = None,
             seed: int | Sequence[int] = 0, stop_tokens: Sequence[int] = (), pad_id: int = 0,
             cache_size: int | None = None, cache_dtype: jnp.dtype | str | None = None,
             stream: Callable[[int, np.ndarray, np.ndarray], None] | None = None,
             mesh: Mesh | None = None) -> GenerateResult:
    """Generates up to ``max_new_tokens`` tokens after each prompt, in one jitted call.

    The prefill and the whole decode loop are one compiled program (``generate_padded``); raw
    parameters are first put in the decode layout by ``prepare`` (its own compiled program,
    run on every call: pass ``DecodeWeights`` to skip it). Everything is validated before any
    device work. Prompts are right-padded to a length bucket
    (``prompt_bucket``), so prompt lengths within a bucket reuse the compiled program; each
    distinct (config, batch size, bucket, max_new_tokens, sampling settings, cache_size)
    compiles once.

    Args:
      config: the model's config.
      params: the model's parameters (scanned or unrolled layout), prepared on every call; or
        ``DecodeWeights`` from ``prepare(config, params, mesh)``, prepared once (faster to the
        first token; with a mesh, each device holds only its block).
      prompts: B lists of token ids, each non-empty, ids in [0, V).
      max_new_tokens: N > 0; each prompt length + N must be <= ``config.max_seq_len``.
      temperature: >= 0; 0 is greedy (argmax).
      top_k: None, or keep the k most likely tokens.
      top_p: None, or nucleus sampling with p in (0, 1].
      min_p: None, or keep tokens with prob >= min_p * max prob.
      seed: an int, or one int per prompt (then a prompt samples the same in any batch).
      stop_tokens: ids that end a sequence; the stop token is included in the output.
      pad_id: id that finished sequences emit in ``token_array``.
      cache_size: S_max slots of the KV cache; default the padded prompt length + N, capped at
        ``config.max_seq_len``. Must be >= every prompt length + N.
      cache_dtype: the KV cache's storage dtype (e.g. ``"bfloat16"`` halves its memory and the
        bytes each step reads); the model's compute dtype by default.
      stream: optional ``fn(step, tokens [B], active [B])`` called on the host after every
        decode step with that step's tokens (``active[b]`` is False for finished sequences).
      mesh: optional mesh with a ``"tensor"`` axis (other axes of size 1, e.g. from
        ``sharding.make_mesh``): the decode runs tensor-parallel over it, each device holding
        K/T kv heads, N/T query heads, F/T FFN units and V/T head rows, so T must divide K, N
        and F. Raw parameters are prepared and split over it on every call; ``prepare``
        does that once. With ``DecodeWeights`` the mesh is theirs (None here, or the same).

    Returns:
      A ``GenerateResult`` (``.tokens``, ``.logprobs``, ``.lengths``, and padded arrays).

    Raises:
      ValueError: for bad prompts, capacity, or sampling settings (before any compute).
    """
    vocab = config.vocab_size
    settings = SamplingSettings(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        stop_tokens=tuple(int(t) if _is_int(t) else t for t in stop_tokens), pad_id=pad_id)
    settings.validate(vocab)
    if isinstance(params, DecodeWeights):
        if params.config != config:
            raise ValueError("the DecodeWeights were prepared for a different config than the "
                             "one given to generate")
        if mesh is not None and mesh != params.mesh:
            raise ValueError("the DecodeWeights were prepared for another mesh; prepare them "
                             "with this one, or pass mesh=None to use theirs")
        mesh = params.mesh
    check_tensor_parallel(config, tensor_shards(mesh))
    arrays = validate_prompts(prompts, vocab)
    lengths = [len(a) for a in arrays]
    validate_capacity(config, lengths, max_new_tokens, cache_size)
    if cache_dtype is not None:
        cache_dtype = _float_dtype_name(cache_dtype)
    batch = len(arrays)
    keys = sequence_keys(seed, batch)
    padded = prompt_bucket(max(lengths))
    if cache_size is None:
        cache_size = default_cache_size(config, padded, max_new_tokens)
    padded = min(padded, cache_size)
    tokens, lengths_arr = pad_prompts(arrays, padded, pad_id)
    logger.debug("generate: B=%d T=%d (longest prompt %d) N=%d S_max=%d, cache %.1f MB",
                 batch, padded, max(lengths), max_new_tokens, cache_size,
                 cache_bytes(config, batch, cache_size, cache_dtype) / 1e6)
    if not isinstance(params, DecodeWeights):
        params = prepare(config, params, mesh)
    stream_id = None
    if stream is not None:
        with _STREAM_LOCK:
            sid = next(_STREAM_IDS)
            _STREAMS[sid] = stream
        stream_id = np.int32(sid)
    start = time.perf_counter()
    try:
        out_tokens, out_logprobs, num = _generate_jit(
            config, params, tokens, lengths_arr, keys, stream_id,
            max_new_tokens=max_new_tokens, settings=settings, cache_size=cache_size, mesh=mesh,
            cache_dtype=cache_dtype)
        out_tokens, out_logprobs, num = jax.device_get((out_tokens, out_logprobs, num))
        if stream_id is not None:
            jax.effects_barrier()  # every stream callback has run before we return
    finally:
        if stream_id is not None:
            with _STREAM_LOCK:
                _STREAMS.pop(int(stream_id), None)
    logger.debug("generate took %.3f s", time.perf_counter() - start)
    return result_from_arrays(out_tokens, out_logprobs, num)


def result_from_arrays(tokens: np.ndarray, logprobs: np.ndarray, num_tokens: np.ndarray
                       ) -> GenerateResult:
    """A ``GenerateResult`` from ``generate_padded``'s outputs ([B, N], [B, N], [B])."""
    tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)
    num = [int(x) for x in np.asarray(num_tokens)]
    return GenerateResult(
        tokens=[tokens[i, :n].tolist() for i, n in enumerate(num)],
        logprobs=[logprobs[i, :n].tolist() for i, n in enumerate(num)],
        lengths=num,
        token_array=tokens,
        logprob_array=logprobs,
    )
