"""Inference: one jitted call from a batch of prompts to completions.

``generate`` validates everything on the host, right-pads the prompts to a length bucket (so
prompt lengths within a bucket share one compiled program) and runs ``generate_padded``, a
single traced function:

1. **Prefill.** One forward of the model (``Transformer`` with a ``KVCache``, so scanned layers
   and remat configs run unchanged) over the padded [B, T] prompts. Slot s holds position s, so
   the junk written at pad slots is hidden by causality and later overwritten. The cache is then
   moved into the decode layout (below) and padded to S_max slots.
2. **Decode.** A ``lax.while_loop`` that stops as soon as every sequence is done. Step i feeds one
   token per sequence at its own position: step 0 feeds each prompt's last real token, whose
   logits give the first new token (so the prefill's [B, T, V] logits are never needed and XLA
   drops them). Finished sequences emit padding and their positions stop advancing.

Decode layout and why. Every step reads all weights and the whole cache, so a step should cost
about (weight bytes + cache bytes) / memory bandwidth. Measured on CPU, the model's own cached
forward run in such a loop was several times slower than that, for reasons the decode step here
avoids:

* the model stacks the per-layer caches into one [L, B, S, K, H] array each step, a full copy of
  the cache; here the loop carries one array per layer, which XLA updates in place;
* attention over a [B, S, K, H] cache makes XLA transpose the cache (batch dims B, K must be
  leading for its dot), i.e. another full copy per layer per step; here each layer's cache is
  stored [B, K, S, H], so both attention contractions run on it directly;
* stacked (scanned) weights are sliced per layer inside the loop, a copy of every weight per
  step; here the blocks are split once per call, outside the loop;
* XLA transposed ``o_proj`` every step to match the attention output's layout; here every
  matrix is prepared once per call as [out, in] (the faster layout for B-row products on CPU),
  with q/k/v and gate/up fused into one matrix each (``decode_params``). This costs one
  transient copy of the weights per ``generate`` call.

The decode step reuses the model's ``Norm`` module and the ``ops`` functions; tests check its
logits against a full forward of ``Transformer`` at every step.
"""

from __future__ import annotations

import dataclasses
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

from transformer_jax import ops, sampling
from transformer_jax.config import ModelConfig
from transformer_jax.kv_cache import KVCache, cache_bytes
from transformer_jax.layers import Norm
from transformer_jax.model import Transformer, unstack_blocks

logger = logging.getLogger(__name__)

Params = dict[str, Any]

#: Prompt lengths up to this are padded to the next power of two (at least ``MIN_BUCKET``);
#: longer ones to the next multiple of it. Powers of two keep the number of programs small for
#: short prompts, multiples of 64 keep the cache (which every step reads) tight for long ones.
BUCKET_MULTIPLE = 64
MIN_BUCKET = 8

# Up to this many queries per kv head, decode attention computes their logits separately.
_MAX_SPLIT_GROUPS = 4

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
    """The decode-time KV cache: one array per layer, in the [B, K, S_max, H] layout.

    Slot s of sequence b holds the key/value at position s (as in ``KVCache``); which slots are
    valid is tracked by the caller (``SamplingState.positions``).

    Attributes:
      k: L arrays [B, K, S_max, H] of keys (already rotated by RoPE).
      v: L arrays [B, K, S_max, H] of values.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    @property
    def nbytes(self) -> int:
        """``2 * L * B * S_max * K * H * bytes_per_element``."""
        return sum(x.size * x.dtype.itemsize for x in (*self.k, *self.v))

    @classmethod
    def from_kv_cache(cls, cache: KVCache, max_len: int | None = None) -> DecodeCache:
        """Converts the model's [L, B, S, K, H] cache, padding it to ``max_len`` slots.

        Args:
          cache: a ``KVCache`` with S slots.
          max_len: S_max >= S; default S.

        Returns:
          The same keys/values per layer as [B, K, S_max, H] (new slots are zero).
        """
        s = cache.k.shape[2]
        pad = 0 if max_len is None else max_len - s

        def convert(x: jax.Array) -> tuple[jax.Array, ...]:
            x = jnp.swapaxes(x, 2, 3)  # [L, B, K, S, H]
            if pad:
                x = jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, pad), (0, 0)))
            return tuple(x[i] for i in range(x.shape[0]))

        return cls(k=convert(cache.k), v=convert(cache.v))


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
      keys: [B] typed PRNG keys, one per sequence; step i draws with ``fold_in(key, i)``.
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

def decode_params(config: ModelConfig, params: Params) -> Params:
    """The weights in the layout the decode step reads: prepared once per call, outside the loop.

    Per layer: ``qkv`` [(N + 2K) * H, D] (the q, k and v projections fused and transposed),
    ``o`` [D, N * H], and for the FFN ``inner`` [F or 2F, D] (``gate`` and ``up`` fused) and
    ``down`` [D, F]; norms and biases as they are. Matrices are stored [out, in] because every
    decode matmul has only B rows, and on CPU such a product streams an [out, in] matrix about
    twice as fast as an [in, out] one at B = 8 (and no slower at B = 1); fusing also halves the
    number of matmuls per step. Scanned blocks are split per layer here too.

    Args:
      config: the model's config.
      params: parameters in either layout.

    Returns:
      A tree with ``embed``, ``final_norm``, optional ``lm_head`` [V, D] and ``blocks_{i}``.
    """
    c = config
    if "blocks" in params:
        params = unstack_blocks(params)
    if f"blocks_{c.n_layers - 1}" not in params:
        raise ValueError("params have neither 'blocks' nor 'blocks_{i}' entries for "
                         f"{c.n_layers} layers")
    d, dt = c.d_model, c.jnp_dtype
    out: Params = {"embed": params["embed"], "final_norm": params["final_norm"]}
    if not c.tie_embeddings:
        out["lm_head"] = params["lm_head"].astype(dt).T
    for i in range(c.n_layers):
        p = params[f"blocks_{i}"]
        a, m = p["attn"], p["mlp"]
        qkv = jnp.concatenate([a[name].astype(dt).reshape(d, -1)
                               for name in ("q_proj", "k_proj", "v_proj")], axis=1)
        layer = {
            "qkv": qkv.T,
            "o": a["o_proj"].astype(dt).reshape(-1, d).T,
            "inner": (jnp.concatenate([m["gate"], m["up"]], axis=1) if "gate" in m
                      else m["up"]).astype(dt).T,
            "down": m["down"].astype(dt).T,
            "attn_norm": p["attn_norm"],
            "mlp_norm": p["mlp_norm"],
        }
        if c.qkv_bias:
            layer["qkv_bias"] = jnp.concatenate(
                [a[name].astype(dt).reshape(-1) for name in ("q_bias", "k_bias", "v_bias")])
        out[f"blocks_{i}"] = layer
    # Materialise the transposed copies: otherwise XLA folds the transposes back into the dots.
    return jax.lax.optimization_barrier(out)


def prefill(config: ModelConfig, params: Params, tokens: jax.Array,
            max_len: int | None = None) -> DecodeCache:
    """Runs the model over right-padded prompts and returns their keys/values.

    Args:
      config: the model's config (scanned layers and remat are honoured; remat is dropped
        since there is no backward pass).
      params: the model's parameters.
      tokens: [B, T] int32 prompts, right-padded; position t of row b goes to slot t.
      max_len: S_max >= T slots of the returned cache; default T.

    Returns:
      A ``DecodeCache`` with slots 0..T-1 written (pad slots hold junk that causality hides).
    """
    b, t = tokens.shape
    config = config.replace(remat="none")
    cache = KVCache.init(config, b, t)
    _, cache = Transformer(config).apply({"params": params}, tokens, cache=cache)
    return DecodeCache.from_kv_cache(cache, max_len)


def _write_slot(cache: jax.Array, new: jax.Array, positions: jax.Array) -> jax.Array:
    """cache [B, K, S, H] with new [B, K, H] written at slot positions[b] of each sequence.

    Both forms update the loop-carried cache in place. At B = 1, XLA would turn the batched
    form (a scatter) into a bounds-checked select that copies the whole cache every step, so a
    plain dynamic-update-slice is used there.
    """
    new = new.astype(cache.dtype)
    if isinstance(cache.shape[0], int) and cache.shape[0] == 1:
        return jax.lax.dynamic_update_slice(cache, new[:, :, None], (0, 0, positions[0], 0))

    def one(c, n, p):
        return jax.lax.dynamic_update_slice(c, n[:, None], (0, p, 0))
    return jax.vmap(one)(cache, new, positions)


def _linear(w: jax.Array, x: jax.Array) -> jax.Array:
    """[Out, In] x [In, B] -> [Out, B], materialised in that orientation.

    Activations are kept feature-major ([D, B]) through the step: XLA's CPU matmul streams an
    [Out, In] matrix 1.4-2.3x faster at B = 8 (no slower at B = 1) when the output is [Out, B]
    rather than [B, Out]. The barrier stops XLA from folding a later transpose into the dot,
    which would switch it back to the slow orientation.
    """
    return jax.lax.optimization_barrier(jnp.dot(w, x))


def _attention_step(c: ModelConfig, p: Params, x: jax.Array, positions: jax.Array,
                    visible: jax.Array, cache_k: jax.Array, cache_v: jax.Array
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One token of attention: [D, B] -> ([D, B], updated [B, K, S, H] keys, values)."""
    dt = c.jnp_dtype
    b = x.shape[1]
    n, kv, h = c.n_heads, c.n_kv_heads, c.head_dim
    qkv = _linear(p["qkv"], x)
    if c.qkv_bias:
        qkv = qkv + p["qkv_bias"][:, None]
    qkv = qkv.T  # [B, (N + 2K) * H], small
    q = qkv[:, :n * h].reshape(b, 1, n, h)
    k = qkv[:, n * h:(n + kv) * h].reshape(b, 1, kv, h)
    v = qkv[:, (n + kv) * h:].reshape(b, kv, h)
    if c.position == "rope":
        rope = dict(base=c.rope_base, pairing=c.rope_pairing, scaling=c.rope_scaling)
        q = ops.apply_rope(q, positions[:, None], **rope)
        k = ops.apply_rope(k, positions[:, None], **rope)
    cache_k = _write_slot(cache_k, k[:, 0], positions)
    cache_v = _write_slot(cache_v, v, positions)
    # Query head r reads kv head r // G, as in ops.attention.
    g = n // kv
    qg = q.reshape(b, kv, g, h)
    keys = cache_k.astype(dt)
    if g <= _MAX_SPLIT_GROUPS:
        # One batched matrix-vector product per query of a group: XLA's CPU batched dot with G
        # rows per (b, k) streamed the cache 2-3x slower than G separate products read it.
        logits = jnp.stack([jnp.einsum("BKH,BKSH->BKS", qg[:, :, i], keys,
                                       preferred_element_type=jnp.float32)
                            for i in range(g)], axis=2)
    else:  # many queries per kv head (MQA): read the cache once, cache as the left operand
        logits = jnp.swapaxes(jnp.einsum("BKSH,BKGH->BKSG", keys, qg,
                                         preferred_element_type=jnp.float32), 2, 3)
    logits = jnp.where(visible[:, None, None, :], logits * h ** -0.5, _MASK_VALUE)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("BKGS,BKSH->BKGH", probs.astype(dt), cache_v.astype(dt),
                     preferred_element_type=jnp.float32).astype(dt)
    return _linear(p["o"], out.reshape(b, n * h).T), cache_k, cache_v


def _ffn(c: ModelConfig, p: Params, x: jax.Array) -> jax.Array:
    """The FFN of ``ops.FFN_FUNCTIONS[c.ffn]`` on [D, B] with the fused ``inner`` matrix."""
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


def decode_step(config: ModelConfig, params: Params, cache: DecodeCache, tokens: jax.Array,
                positions: jax.Array) -> tuple[jax.Array, DecodeCache]:
    """One decode step: feeds one token per sequence and returns the next-token logits.

    Computes what ``Transformer(config).apply(..., tokens[:, None], positions[:, None],
    cache=...)`` computes on the same keys/values, without the copies that make that slow in a
    loop (see the module docstring).

    Args:
      config: the model's config.
      params: the weights prepared by ``decode_params``.
      cache: the ``DecodeCache``; slots ``< positions[b]`` of sequence b must be filled.
      tokens: [B] int32 tokens to feed.
      positions: [B] int32 their positions; each is also the slot its key/value is written to
        (must be < S_max: callers check capacity, as writes past the end are clamped).

    Returns:
      ([B, V] float32 logits for the next token, updated cache).
    """
    c = config
    dt = c.jnp_dtype
    table = params["embed"]["embedding"]
    x = ops.embed(tokens[:, None], table).astype(dt)[:, 0]
    if c.position == "sinusoidal":
        x = x + ops.sinusoidal_positions(positions[:, None], c.d_model)[:, 0].astype(dt)
    x = x.T  # [D, B] from here on (see _linear)
    slots = jnp.arange(cache.max_len, dtype=positions.dtype)[None, :]
    visible = slots <= positions[:, None]
    if c.sliding_window is not None:
        visible &= slots > positions[:, None] - c.sliding_window
    norm = Norm(kind=c.norm, eps=c.norm_eps, param_dtype=c.jnp_param_dtype)
    new_k, new_v = [], []
    for i in range(c.n_layers):
        p = params[f"blocks_{i}"]

        def attend(y: jax.Array, i: int = i, p: Params = p) -> jax.Array:
            out, k_i, v_i = _attention_step(c, p, y, positions, visible, cache.k[i], cache.v[i])
            new_k.append(k_i)
            new_v.append(v_i)
            return out

        def normed(name: str, y: jax.Array, p: Params = p) -> jax.Array:
            return norm.apply({"params": p[name]}, y.T).T

        if c.norm_position == "pre":
            x = x + attend(normed("attn_norm", x))
            x = x + _ffn(c, p, normed("mlp_norm", x))
        else:
            x = normed("attn_norm", x + attend(x))
            x = normed("mlp_norm", x + _ffn(c, p, x))
    x = norm.apply({"params": params["final_norm"]}, x.T).T
    head = table.astype(dt) if c.tie_embeddings else params["lm_head"]
    logits = jax.lax.optimization_barrier(
        jnp.einsum("VD,DB->VB", head, x, preferred_element_type=jnp.float32))
    return logits.T, DecodeCache(k=tuple(new_k), v=tuple(new_v))


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

def generate_padded(config: ModelConfig, params: Params, tokens: jax.Array, lengths: jax.Array,
                    key_data: jax.Array, stream_id: jax.Array | None = None, *,
                    max_new_tokens: int, settings: SamplingSettings = SamplingSettings(),
                    cache_size: int | None = None
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Prefill plus while-loop decode on padded arrays: the traced body of ``generate``.

    Shape-polymorphic in B and T (``export.py`` exports it with symbolic dims). Performs no
    validation: ``generate`` checks capacity, ids and settings on the host first.

    Args:
      config: the model's config (static).
      params: the model's parameters, either layout.
      tokens: [B, T] int32 prompts right-padded to T (any in-vocabulary pad id).
      lengths: [B] int32 true prompt lengths, each in [1, T].
      key_data: [B, 2] uint32 raw PRNG key per sequence (``jax.random.key_data``).
      stream_id: optional [] int32 id of a callback registered in ``_STREAMS``; when given,
        every step calls it on the host with (step, tokens [B], active [B]).
      max_new_tokens: N (static), the most tokens generated per sequence.
      settings: static sampling settings.
      cache_size: static S_max; default ``T + N``. Must be >= T and >= every length + N - 1.

    Returns:
      tokens [B, N] int32 (``pad_id`` after a sequence ends), logprobs [B, N] float32 (0 at
      padding), num_tokens [B] int32 generated per sequence (stop token included).
    """
    b, t = tokens.shape
    n = max_new_tokens
    s_max = t + n if cache_size is None else cache_size
    cache = prefill(config, params, tokens, s_max)
    dparams = decode_params(config, params)
    last = lengths.astype(jnp.int32) - 1
    state = SamplingState(
        step=jnp.zeros((), jnp.int32),
        tokens=jnp.full((b, n), settings.pad_id, jnp.int32),
        logprobs=jnp.zeros((b, n), jnp.float32),
        next_token=jnp.take_along_axis(tokens, last[:, None], axis=1)[:, 0].astype(jnp.int32),
        positions=last,
        done=jnp.zeros((b,), bool),
        num_tokens=jnp.zeros((b,), jnp.int32),
        keys=jax.random.wrap_key_data(key_data),
        cache=cache,
    )
    stop = jnp.asarray(settings.stop_tokens, jnp.int32)
    greedy = settings.temperature == 0

    def cond(s: SamplingState) -> jax.Array:
        return (s.step < n) & ~jnp.all(s.done)

    def body(s: SamplingState) -> SamplingState:
        logits, cache = decode_step(config, dparams, s.cache, s.next_token, s.positions)
        if greedy:
            tok = _argmax(logits)
            logprob = sampling.token_logprobs(logits, tok)
        else:
            step_keys = jax.vmap(jax.random.fold_in, (0, None))(s.keys, s.step)
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
            jax.debug.callback(_emit, stream_id, s.step, tok, active, ordered=True)
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

    state = jax.lax.while_loop(cond, body, state)
    return state.tokens, state.logprobs, state.num_tokens


_generate_jit = jax.jit(generate_padded, static_argnames=(
    "config", "max_new_tokens", "settings", "cache_size"))


# Host side ---------------------------------------------------------------------------------------

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


def generate(config: ModelConfig, params: Params, prompts: Sequence[Sequence[int]], *,
             max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, min_p: float | None = None,
             seed: int | Sequence[int] = 0, stop_tokens: Sequence[int] = (), pad_id: int = 0,
             cache_size: int | None = None,
             stream: Callable[[int, np.ndarray, np.ndarray], None] | None = None
             ) -> GenerateResult:
    """Generates up to ``max_new_tokens`` tokens after each prompt, in one jitted call.

    Everything is validated before any device work. Prompts are right-padded to a length bucket
    (``prompt_bucket``), so prompt lengths within a bucket reuse the compiled program; each
    distinct (config, batch size, bucket, max_new_tokens, sampling settings, cache_size)
    compiles once.

    Args:
      config: the model's config.
      params: the model's parameters (scanned or unrolled layout).
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
      stream: optional ``fn(step, tokens [B], active [B])`` called on the host after every
        decode step with that step's tokens (``active[b]`` is False for finished sequences).

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
    arrays = validate_prompts(prompts, vocab)
    lengths = [len(a) for a in arrays]
    validate_capacity(config, lengths, max_new_tokens, cache_size)
    batch = len(arrays)
    keys = sequence_keys(seed, batch)
    padded = prompt_bucket(max(lengths))
    if cache_size is None:
        cache_size = default_cache_size(config, padded, max_new_tokens)
    padded = min(padded, cache_size)
    tokens, lengths_arr = pad_prompts(arrays, padded, pad_id)
    logger.debug("generate: B=%d T=%d (longest prompt %d) N=%d S_max=%d, cache %.1f MB",
                 batch, padded, max(lengths), max_new_tokens, cache_size,
                 cache_bytes(config, batch, cache_size) / 1e6)
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
            max_new_tokens=max_new_tokens, settings=settings, cache_size=cache_size)
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
