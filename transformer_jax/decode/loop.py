"""Decoding on the device: prefill, then a ``lax.while_loop`` of decode steps over the cache.

Prefill writes the right-padded [B, T] prompts at slots 0..T-1 of an empty cache (pad slots'
junk is hidden by causality and overwritten) and takes the logits at each prompt's last token;
the loop feeds each sequence's last token at its own position until every sequence is done.
``generate_padded`` is the whole of it, one traced function; over a mesh it is traced under
``decode_context`` and XLA partitions it from the weights' shardings (``weight_specs``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from transformer_jax.decode import sampling, streaming
from transformer_jax.decode.prompts import is_int
from transformer_jax.decode.weights import (  # noqa: F401 (decode.prepare etc. are the API)
    TENSOR_AXIS,
    DecodeWeights,
    abstract_weights,
    check_tensor_parallel,
    decode_config,
    decode_params,
    decode_rules,
    expert_shards,
    has_expert_lists,
    has_out_first,
    is_split,
    out_first_for,
    prepare,
    target_platform,
    tensor_shards,
    weight_shardings,
    weight_specs,
)
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.kv_cache import KVCache
from transformer_jax.model.ops import target
from transformer_jax.model.transformer import Transformer

Params = dict[str, Any]

@contextlib.contextmanager
def decode_context(config: ModelConfig, mesh: Mesh | None) -> Iterator[None]:
    """What a decode over ``mesh`` is traced under: the mesh's platform as the target, and with
    a mesh its abstract mesh and ``decode_rules`` (as ``sharding.jit_sharded`` for training)."""
    with target.targeting(target.of_mesh(mesh)):
        if mesh is None:
            yield
            return
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), \
                nn.logical_axis_rules(decode_rules(config, mesh)):
            yield


def on_mesh(config: ModelConfig, mesh: Mesh | None, weights: Params, quant: Any = None
            ) -> Params:
    """``weights`` (prepared: ``DecodeWeights.params``, traced) pinned to ``weight_specs`` over
    ``mesh``; as they are without a mesh."""
    if mesh is None:
        return weights
    shardings = weight_shardings(config, mesh, has_out_first(weights), quant,
                                 has_expert_lists(weights))
    return jax.lax.with_sharding_constraint(weights, shardings)


# Loop state --------------------------------------------------------------------------------------

@flax.struct.dataclass
class SamplingState:
    """The carry of the decode loop.

    Attributes:
      step: [] int32 decode steps taken so far.
      tokens: [B, N] int32 generated ids (N = max_new_tokens; ``pad_id`` after a stop).
      logprobs: [B, N] float32 log-probabilities of ``tokens`` under the model (0 at padding).
      next_token: [B] int32 token each sequence feeds at the next step.
      positions: [B] int32 position (= cache slot) of ``next_token``.
      done: [B] bool sequences that emitted a stop token or N tokens.
      num_tokens: [B] int32 tokens generated so far (stop token included).
      keys: [B, 2] uint32 raw PRNG key per sequence; step i draws with ``fold_in(key, i)``.
      cache: the ``KVCache``.
    """

    step: jax.Array
    tokens: jax.Array
    logprobs: jax.Array
    next_token: jax.Array
    positions: jax.Array
    done: jax.Array
    num_tokens: jax.Array
    keys: jax.Array
    cache: KVCache


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
    """Static (compile-time) sampling settings; see ``transformer_jax.decode.sampling``.

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
            if not is_int(tok) or not 0 <= tok < vocab_size:
                raise ValueError(f"stop token {tok!r} is not a token id in [0, {vocab_size})")
        if not is_int(self.pad_id) or not 0 <= self.pad_id < vocab_size:
            raise ValueError(f"pad_id {self.pad_id!r} is not a token id in [0, {vocab_size})")


# Prefill and decode steps ------------------------------------------------------------------------

def decode_model(config: ModelConfig) -> Transformer:
    """The model as generation runs it (``decode_config``)."""
    return Transformer(decode_config(config))


def prefill(config: ModelConfig, params: Params, tokens: jax.Array, lengths: jax.Array,
            max_len: int | None = None, dtype: jnp.dtype | str | None = None,
            platform: str | None = None, *, with_hidden: bool = False
            ) -> tuple[jax.Array, KVCache] | tuple[jax.Array, KVCache, jax.Array]:
    """Runs right-padded prompts through the model into an empty cache.

    Args:
      config, params: the model's config and parameters (or ``DecodeWeights.params``).
      tokens: [B, T] int32 prompts, right-padded; position t of row b goes to slot t.
      lengths: [B] int32 true prompt lengths, each in [1, T].
      max_len: S_max >= T slots of the returned cache; default T.
      dtype: the cache's storage dtype; the model's compute dtype by default.
      platform: the platform the cache's layout is chosen for (``KVCache.init``).
      with_hidden: also return every position's final-normed hidden state.

    Returns:
      ([B, V] float32 logits after each prompt's last token, the ``KVCache`` with slots 0..T-1
      written and ``lengths`` as given; local layers' rings hold each prompt's last positions),
      and with ``with_hidden`` the [B, T, D] hidden states.
    """
    b, t = tokens.shape
    lengths = lengths.astype(jnp.int32)
    cache = KVCache.init(config, b, max_len or t, dtype, platform=platform).constrain()
    if cache.ring is not None:  # the local layers' rings keep each prompt's own last window
        cache = cache.replace(ring_end=lengths)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    out = decode_model(config).apply({"params": params}, tokens, positions, cache=cache,
                                     logits_at=lengths - 1, with_hidden=with_hidden)
    cache = out.cache.replace(lengths=lengths, ring_end=None)
    return (whole_logits(out.logits), cache) + ((out.hidden,) if with_hidden else ())


def decode_step(config: ModelConfig, params: Params, cache: KVCache, tokens: jax.Array,
                positions: jax.Array) -> tuple[jax.Array, KVCache]:
    """One decode step: [B] tokens at [B] positions -> ([B, V] float32 logits, updated cache)."""
    out = decode_model(config).apply(
        {"params": params}, tokens[:, None], positions[:, None], cache=cache)
    return whole_logits(out.logits[:, 0]), out.cache.constrain()


def whole_logits(logits: jax.Array) -> jax.Array:
    """[B, V] logits to sample from, gathered whole on every device for a CPU target over a
    split vocabulary (one all-gather costs less there than the per-row all-reduces XLA
    partitions sampling into); as they are on an accelerator or without a mesh."""
    if target.platform() != "cpu" or jax.sharding.get_abstract_mesh().empty:
        return logits
    return nn.with_logical_constraint(logits, (None, None))


def draw(logits: jax.Array, key_data: jax.Array, index: jax.Array,
         settings: SamplingSettings, allowed: jax.Array | None = None
         ) -> tuple[jax.Array, jax.Array]:
    """The plain decode's draw at T positions per row (the decode loop's, verification's and
    constrained generation's).

    Args:
      logits: [B, T, V] float32.
      key_data: [B, 2] uint32 each row's raw key.
      index: [B] int32 the new-token index of position 0 (position t draws with
        ``fold_in(key, index + t)``).
      settings: static sampling settings.
      allowed: optional [B, T, V] bool the tokens that may be drawn (others' logits -inf).

    Returns:
      ([B, T] int32 tokens, [B, T] float32 their raw-softmax log-probabilities).
    """
    b, t, v = logits.shape
    flat = logits.reshape(b * t, v)
    masked = flat if allowed is None else jnp.where(allowed.reshape(b * t, v), flat, -jnp.inf)
    if settings.temperature == 0:
        tokens = sampling.argmax(masked)
    else:
        keys = jax.random.wrap_key_data(jnp.repeat(key_data, t, axis=0))
        steps = (index[:, None] + jnp.arange(t, dtype=jnp.int32)).reshape(-1)
        keys = jax.vmap(jax.random.fold_in)(keys, steps)
        tokens = sampling.sample(masked, keys, temperature=settings.temperature,
                                 top_k=settings.top_k, top_p=settings.top_p,
                                 min_p=settings.min_p)
    return (tokens.reshape(b, t).astype(jnp.int32),
            sampling.token_logprobs(flat, tokens).reshape(b, t))


def _decode_loop(config: ModelConfig, params: Params, state: SamplingState,
                 first_logits: jax.Array, *, stream_id: jax.Array | None, max_new_tokens: int,
                 settings: SamplingSettings, ordered: bool = True
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Draws the first token from the prefill's [B, V] ``first_logits`` (``state.positions``
    at each prompt's last token), then runs the ``lax.while_loop`` of decode steps. The stream
    is ``ordered`` only on one device (a program over several cannot order effects)."""
    n = max_new_tokens
    stop = jnp.asarray(settings.stop_tokens, jnp.int32)

    def cond(s: SamplingState) -> jax.Array:
        return (s.step < n) & ~jnp.all(s.done)

    def advance(s: SamplingState, logits: jax.Array, cache: KVCache) -> SamplingState:
        """Picks each sequence's token from its [B, V] logits and records it."""
        index = jnp.broadcast_to(s.step, s.done.shape)
        tok, logprob = (x[:, 0] for x in draw(logits[:, None], s.keys, index, settings))
        active = ~s.done
        tok = jnp.where(active, tok, settings.pad_id)
        logprob = jnp.where(active, logprob, 0.0)
        num_tokens = s.num_tokens + active
        done = s.done | (num_tokens >= n)
        if settings.stop_tokens:
            done |= active & jnp.isin(tok, stop)
        if stream_id is not None:
            streaming.emit(stream_id, s.step, tok, active, ordered=ordered)
        return s.replace(
            step=s.step + 1, next_token=tok, done=done, num_tokens=num_tokens, cache=cache,
            tokens=jax.lax.dynamic_update_slice(s.tokens, tok[:, None], (0, s.step)),
            logprobs=jax.lax.dynamic_update_slice(s.logprobs, logprob[:, None], (0, s.step)),
            # A finished sequence keeps its position, so its (ignored) writes stay in range.
            positions=jnp.where(done, s.positions, s.positions + 1))

    def body(s: SamplingState) -> SamplingState:
        return advance(s, *decode_step(config, params, s.cache, s.next_token, s.positions))

    state = advance(state, first_logits, state.cache)
    state = jax.lax.while_loop(cond, body, state)
    return state.tokens, state.logprobs, state.num_tokens


# The traced generate -----------------------------------------------------------------------------

def generate_padded(config: ModelConfig, params: Params | DecodeWeights, tokens: jax.Array,
                    lengths: jax.Array, key_data: jax.Array, stream_id: jax.Array | None = None,
                    *, max_new_tokens: int, settings: SamplingSettings = SamplingSettings(),
                    cache_size: int | None = None, mesh: Mesh | None = None,
                    cache_dtype: str | None = None
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Prefill plus while-loop decode on padded arrays: the traced body of ``generate``.

    Shape-polymorphic in B and T (``decode/export.py``). Performs no validation
    (``generation.generate`` checks on the host first).

    Args:
      config, params: the model's config (static); ``DecodeWeights`` from ``prepare``, or raw
        parameters (prepared here per call).
      tokens: [B, T] int32 prompts right-padded to T (any in-vocabulary pad id).
      lengths: [B] int32 true prompt lengths, each in [1, T].
      key_data: [B, 2] uint32 raw PRNG key per sequence (``jax.random.key_data``).
      stream_id: optional [] int32 id of a ``streaming.registered`` callback, called on the
        host every step.
      max_new_tokens: N (static), the most tokens generated per sequence.
      settings: static sampling settings.
      cache_size: static S_max; default ``T + N``. Must be >= T and >= every length + N - 1.
      mesh: static; the program is partitioned over its tensor (and expert) axis.
      cache_dtype: static storage dtype name of the KV cache; the compute dtype by default.

    Returns:
      tokens [B, N] int32 (``pad_id`` after a sequence ends), logprobs [B, N] float32 (0 at
      padding), num_tokens [B] int32 generated per sequence (stop token included).
    """
    quant, platform = None, target_platform(mesh)
    if isinstance(params, DecodeWeights):
        weights, quant = params.params, params.quant
    else:  # prepared here, a transient copy per call
        weights = decode_params(config, params, out_first_for(platform))
    b, t = tokens.shape
    n = max_new_tokens
    with decode_context(config, mesh):
        weights = on_mesh(config, mesh, weights, quant)
        logits, cache = prefill(config, weights, tokens, lengths,
                                t + n if cache_size is None else cache_size, cache_dtype,
                                platform=platform)
        zeros = jnp.zeros((b,), jnp.int32)  # next_token: the first advance sets it
        state = SamplingState(
            step=jnp.zeros((), jnp.int32), tokens=jnp.full((b, n), settings.pad_id, jnp.int32),
            logprobs=jnp.zeros((b, n), jnp.float32), next_token=zeros,
            positions=lengths.astype(jnp.int32) - 1, done=jnp.zeros((b,), bool),
            num_tokens=zeros, keys=key_data.astype(jnp.uint32), cache=cache)
        return _decode_loop(config, weights, state, logits, stream_id=stream_id,
                            max_new_tokens=n, settings=settings, ordered=not is_split(mesh))


#: The arguments of ``generate_padded`` that are compile-time constants.
GENERATE_STATIC_ARGNAMES = ("config", "max_new_tokens", "settings", "cache_size", "mesh",
                            "cache_dtype")
_generate_jit = jax.jit(generate_padded, static_argnames=GENERATE_STATIC_ARGNAMES)
