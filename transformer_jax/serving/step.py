"""The engine's compiled step: the model's one forward over the paged cache, then sampling.

A step runs the model's forward with a ``PagedKVCache`` on decode rows (one token for each of
the B slots, [B, 1]; an idle slot writes into the null page) or prefill chunks (up to C tokens of
each of R prompts, [R, C], the LM head at each row's last real token only), each one program; an
engine step with both runs the chunk's program first. Each row's next token is drawn with its
own settings and key ``fold_in(key, token index)``, as ``generate`` draws token i. The page-table
width W, the kind of rows, the chunk's (R, C) and the sampler's switches make a program's shape.
Rows under a grammar run the forward (``engine_forward``) and the sampling (``sample_rows``) as
two programs, so the host computes the masks while the device runs the forward. Over a mesh's
tensor axis the pages are split by kv head. Local layers keep a ring per slot (``rings``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from transformer_jax.decode import sampling
from transformer_jax.decode.constrained import mask_logits
from transformer_jax.decode.loop import (
    TENSOR_AXIS,
    decode_context,
    decode_model,
    has_out_first,
    is_split,
    on_mesh,
    weight_specs,
    whole_logits,
)
from transformer_jax.model import multi_lora
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.kv_ring import RingLayout
from transformer_jax.model.layers import MATRIX_INPUT_AXES
from transformer_jax.model.stack import is_scanned_key
from transformer_jax.serving.page_pool import NULL_PAGE
from transformer_jax.serving.paged_cache import PagedKVCache

Params = dict[str, Any]


@flax.struct.dataclass
class DecodeRows:
    """One token per slot.

    Attributes:
      tokens: [B] int32 token each slot feeds (its last token).
      positions: [B] int32 its position (the slot's cached length).
      page_table: [B, W] int32 each slot's pages (all ``NULL_PAGE`` for an idle slot).
      adapter: [B] int32 each slot's LoRA adapter (0 = the base), or None.
    """

    tokens: jax.Array
    positions: jax.Array
    page_table: jax.Array
    adapter: jax.Array | None = None


@flax.struct.dataclass
class PrefillChunk:
    """Up to C consecutive prompt tokens of each of R sequences (idle rows: null pages).

    Attributes:
      tokens: [R, C] int32, each row right-padded past its chunk's real length.
      start: [R] int32 position of each row's first token.
      page_table: [R, W] int32 each sequence's pages.
      last: [R] int32 index in [0, C) of each chunk's last real token.
      slot: [R] int32 each sequence's slot (its rings' row), or None for a model without rings.
      adapter: [R] int32 each sequence's LoRA adapter, or None.
    """

    tokens: jax.Array
    start: jax.Array
    page_table: jax.Array
    last: jax.Array
    slot: jax.Array | None = None
    adapter: jax.Array | None = None


@flax.struct.dataclass
class RowSampling:
    """Per-row sampling settings of the R rows (decode rows, then the chunk's).

    Attributes:
      key_data: [R, 2] uint32 raw PRNG key of each row's request.
      token_index: [R] int32 index of the token being drawn among the request's new tokens.
      temperature, top_k, top_p, min_p: [R] each (off: 0, V, 1, 0; temperature 0 = greedy).
      allowed: [R, ceil(V/32)] int32 bitmasks of the tokens each row may draw (structured
        outputs; all ones for a row without a grammar), or None.
    """

    key_data: jax.Array
    token_index: jax.Array
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    allowed: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class Sampler:
    """Static switches of a step's sampling: whether any row samples, which filters any uses."""

    sampled: bool = False
    top_k: bool = False
    top_p: bool = False
    min_p: bool = False
    top_logprobs: int = 0


def sample_rows(logits: jax.Array, rows: RowSampling, sampler: Sampler
                ) -> tuple[jax.Array, jax.Array]:
    """[R, V] logits -> ([R] int32 tokens, [R] float32 log-probabilities), each row with its
    own settings and key (``generate``'s draw: ``fold_in(key, token index)``).

    With ``sampler.top_logprobs`` K both are [R, 1 + K]: column 0 the drawn token, then the K
    most likely tokens of the raw softmax, most likely first (``sampling.top_logprobs``).
    """
    raw = logits
    if rows.allowed is not None:  # structured outputs: only the grammars' tokens
        logits = mask_logits(logits, rows.allowed)
    if not sampler.sampled:
        tokens, logprobs = sampling.sample_with_logprobs(logits, None, temperature=0)
    else:
        keys = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(rows.key_data),
                                            rows.token_index)
        tokens, logprobs = sampling.sample_with_logprobs(
            logits, keys, temperature=rows.temperature,
            top_k=rows.top_k if sampler.top_k else None,
            top_p=rows.top_p if sampler.top_p else None,
            min_p=rows.min_p if sampler.min_p else None)
    if rows.allowed is not None:  # the drawn token's log-probability under the raw softmax
        logprobs = sampling.token_logprobs(raw, tokens)
    if not sampler.top_logprobs:
        return tokens, logprobs
    top_ids, top = sampling.top_logprobs(raw, sampler.top_logprobs)
    return (jnp.concatenate([tokens[:, None], top_ids], 1),
            jnp.concatenate([logprobs[:, None], top], 1))


def sample_positions(logits: jax.Array, rows: RowSampling, sampler: Sampler
                     ) -> tuple[jax.Array, jax.Array]:
    """``sample_rows`` of [B, T, V] logits, position t of row b drawn with sampling row
    ``b * T + t``: [B, T] (or [B, T, 1 + K]) tokens and log-probabilities."""
    b, t = logits.shape[:2]
    tokens, logprobs = sample_rows(logits.reshape(b * t, -1), rows, sampler)
    return tokens.reshape(b, t, *tokens.shape[1:]), logprobs.reshape(b, t, *logprobs.shape[1:])


def copy_pages(k_pages: Any, v_pages: Any, src: jax.Array, dst: jax.Array
               ) -> tuple[Any, Any]:
    """Copies page ``src[i]`` to page ``dst[i]`` ([M] int32; ``dst`` distinct, or repeating a
    pair already given) in every layer's [L, K, P, page_size, H] keys and values (or tuples of
    L arrays): a fork's copy of its prompt's last, partial page. Returns the keys and values."""
    def copy(x: jax.Array) -> jax.Array:
        index = (slice(None),) * (x.ndim - 3)
        return x.at[(*index, dst)].set(jnp.take(x, src, axis=x.ndim - 3))

    return jax.tree.map(copy, k_pages), jax.tree.map(copy, v_pages)


def row_slice(rows: RowSampling, lo: int, hi: int) -> RowSampling:
    """Rows [lo, hi) of a step's sampling settings."""
    return jax.tree.map(lambda x: x[lo:hi], rows)


def padded(*arrays: np.ndarray) -> tuple[np.ndarray, ...]:
    """The [n, ...] ``arrays`` padded to the power of two >= n rows by repeating their last."""
    n = len(arrays[0])
    rows = np.minimum(np.arange(1 << (n - 1).bit_length()), n - 1)
    return tuple(np.asarray(x)[rows] for x in arrays)


def sample_from(logits: jax.Array, source: jax.Array, rows: RowSampling, sampler: Sampler
                ) -> tuple[jax.Array, jax.Array]:
    """``sample_rows`` of M rows, row m drawing from the chunks' logits row ``source[m]``
    ([R, V] logits, [M] int32 sources: a chunk's row for itself and each of its forks)."""
    return sample_rows(jnp.take(logits, source, axis=0), rows, sampler)


def page_spec(config: ModelConfig) -> P:
    """The ``PartitionSpec`` of each layer's pages over a tensor-parallel mesh: split by kv
    head ([K, ...]; [L, K, ...] stacked); latent layers' entry pages whole on every device."""
    if config.mla is not None:
        return P()
    return P(None, TENSOR_AXIS) if config.scan_layers else P(TENSOR_AXIS)


def ring_spec(config: ModelConfig) -> P:
    """The local layers' rings' ``PartitionSpec``: split by kv head ([L?, S, K, ...])."""
    return P(None, None, TENSOR_AXIS) if config.scan_layers else P(None, TENSOR_AXIS)


def engine_step(config: ModelConfig, params: Params, k_pages: Any, v_pages: Any,
                decode: DecodeRows | None, prefill: PrefillChunk | None, rows: RowSampling, *,
                sampler: Sampler, view: str = "auto", mesh: Mesh | None = None,
                quant: Any = None, rings: Any = None, adapters: Params | None = None
                ) -> tuple[Any, Any, jax.Array, jax.Array, Any]:
    """One engine program (see the module docstring): decode rows, a prefill chunk, or both.

    Args:
      config: the model's config (static).
      params: the prepared weights (``DecodeWeights.params``).
      k_pages, v_pages: the cache's key and value pages (``PagedKVCache.k`` / ``.v``).
      decode: the slots' decode rows, or None.
      prefill: the prefill chunk, or None (not both None).
      rows: sampling settings of the R rows: B decode rows, then the chunk's.
      sampler: static sampling switches.
      view: static; how attention reads the pages (``PagedKVCache.view``).
      mesh: static; with a tensor axis of T > 1 each device holds its block of every matrix
        and its K/T kv heads of the pages (``page_spec``); every device draws the same tokens.
      quant: static; the weights' quantisation (``DecodeWeights.quant``), for their specs.
      rings: the local layers' (key rings, value rings), or None.
      adapters: the engine's stacked LoRA adapters (each row adding its own), or None.

    Returns:
      (key pages, value pages, [R] int32 next tokens, [R] float32 their log-probabilities,
      the rings).
    """
    def run(*args: Any) -> tuple[Any, Any, jax.Array, jax.Array, Any]:
        k, v, logits, rings = _forward(*args[:-1], view=view)  # args[-1]: the rows' sampling
        return (k, v, *sample_rows(logits, args[-1], sampler), rings)

    return _on_mesh(run, config, params, k_pages, v_pages, decode, prefill, rings, adapters,
                    (rows,), mesh=mesh, quant=quant)


def engine_forward(config: ModelConfig, params: Params, k_pages: Any, v_pages: Any,
                   decode: DecodeRows | None, prefill: PrefillChunk | None, *,
                   view: str = "auto", mesh: Mesh | None = None, quant: Any = None,
                   rings: Any = None, adapters: Params | None = None
                   ) -> tuple[Any, Any, jax.Array, Any]:
    """``engine_step``'s forward without its sampling (for grammar rows, whose masks the host
    computes meanwhile). Arguments as ``engine_step``'s.

    Returns:
      (key pages, value pages, [R, V] float32 logits (whole on every device), the rings).
    """
    return _on_mesh(functools.partial(_forward, view=view), config, params, k_pages, v_pages,
                    decode, prefill, rings, adapters, (), mesh=mesh, quant=quant)


def _on_mesh(run: Any, config: ModelConfig, params: Params, k_pages: Any, v_pages: Any,
             decode: DecodeRows | None, prefill: PrefillChunk | None, rings: Any,
             adapters: Params | None, extra: tuple[Any, ...], *, mesh: Mesh | None,
             quant: Any) -> Any:
    """``run(config, params, pages, rows, rings, adapters, *extra)`` in the mesh's
    ``decode_context``; over a split mesh its inputs and returned pages pinned to their
    shardings."""
    with decode_context(config, mesh):
        if not is_split(mesh):
            return run(config, params, k_pages, v_pages, decode, prefill, rings, adapters,
                       *extra)
        pages = NamedSharding(mesh, page_spec(config))
        ring = NamedSharding(mesh, ring_spec(config))

        def pin(pages_k: Any, pages_v: Any, rings: Any) -> tuple[Any, Any, Any]:
            pinned = jax.lax.with_sharding_constraint((pages_k, pages_v), (pages, pages))
            return (*pinned, None if rings is None else jax.lax.with_sharding_constraint(
                rings, ring))

        k_pages, v_pages, rings = pin(k_pages, v_pages, rings)
        if adapters is not None:
            specs = adapter_specs(config, mesh, adapters, has_out_first(params))
            adapters = jax.lax.with_sharding_constraint(
                adapters, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
        out = run(config, on_mesh(config, mesh, params, quant), k_pages, v_pages, decode,
                  prefill, rings, adapters, *extra)
        k, v, ring_out = pin(out[0], out[1], out[-1])
        return (k, v, *out[2:-1], ring_out)


def _forward(config: ModelConfig, params: Params, k_pages: Any, v_pages: Any,
             decode: DecodeRows | None, prefill: PrefillChunk | None, rings: Any,
             adapters: Params | None, *, view: str, hidden: bool = False
             ) -> tuple[Any, ...]:
    """The forward of ``engine_step``: (key pages, value pages, [R, V] logits, rings); with
    ``hidden`` (static), then the chunk's [R, C, D] final-normed hidden states (``serving.mtp``)."""
    if decode is None and prefill is None:
        raise ValueError("an engine step needs decode rows, a prefill chunk or both")
    model = decode_model(config)
    ring = None if rings is None else RingLayout.of(config, config.max_seq_len)
    cache = PagedKVCache(k=k_pages, v=v_pages, page_table=jnp.zeros((1, 1), jnp.int32),
                         lengths=jnp.zeros((1,), jnp.int32), view=view, ring=ring,
                         **({} if rings is None else dict(k_ring=rings[0], v_ring=rings[1])))

    def rows_of(cache: PagedKVCache, end: jax.Array, rows: jax.Array | None) -> PagedKVCache:
        # A row writes its rings below its real end; an idle row (no page) nowhere.
        if ring is None:
            return cache
        live = cache.page_table[:, 0] != NULL_PAGE
        return cache.replace(ring_rows=rows, ring_end=jnp.where(live, end, 0).astype(jnp.int32))

    logits = []
    if decode is not None:
        cache = rows_of(cache.with_table(decode.page_table, decode.positions),
                        decode.positions + 1, None)
        out = model.apply({"params": _adapted(params, adapters, decode.adapter)},
                          decode.tokens[:, None], decode.positions[:, None], cache=cache)
        logits.append(out.logits[:, 0])
        cache = out.cache
    if prefill is not None:
        c = prefill.tokens.shape[1]
        positions = prefill.start[:, None] + jnp.arange(c, dtype=jnp.int32)
        cache = rows_of(cache.with_table(prefill.page_table, prefill.start),
                        prefill.start + prefill.last + 1, prefill.slot)
        out = model.apply({"params": _adapted(params, adapters, prefill.adapter)},
                          prefill.tokens, positions, cache=cache, logits_at=prefill.last,
                          with_hidden=hidden)
        logits.append(out.logits)
        cache = out.cache
    return (cache.k, cache.v, whole_logits(jnp.concatenate(logits)),
            None if ring is None else (cache.k_ring, cache.v_ring),
            *((out.hidden,) if hidden else ()))


def _adapted(params: Params, adapters: Params | None, ids: jax.Array | None) -> Params:
    """The params with each row's LoRA adapter beside its matrices, when the rows have them."""
    if adapters is None or ids is None:
        return params
    return multi_lora.with_row_adapters(params, adapters, ids)


def adapter_specs(config: ModelConfig, mesh: Mesh, adapters: Params,
                  out_first: bool = False) -> Params:
    """The ``PartitionSpec`` of every stacked adapter factor over a tensor-parallel mesh: A
    split as its matrix's input axes, B as its output axes. Layout (``stack_adapters``'): A
    [L?, Na, in..., R] and B [L?, Na, R, out...], or with ``out_first`` A [L?, Na, R, in...]
    and B [L?, out..., Na, R]."""
    in_first = weight_specs(config, mesh, False)

    def specs(path: tuple[Any, ...], x: jax.Array) -> P:
        keys = [str(getattr(k, "key", k)) for k in path]
        w = in_first
        for key in keys[:-1]:
            w = w[key]
        lead = int(is_scanned_key(keys[0]))
        n_in = MATRIX_INPUT_AXES[keys[-2]]
        n_out = x.ndim - lead - 2 - (n_in if keys[-1] == "a" else 0)
        spec = tuple(w) + (None,) * x.ndim  # trailing Nones the spec may leave out
        matrix, lead_spec = spec[lead:], spec[:lead]
        if keys[-1] == "a":
            return P(*lead_spec, None, *((None, *matrix[:n_in]) if out_first
                                         else (*matrix[:n_in], None)))
        out = matrix[n_in:n_in + n_out]
        return P(*lead_spec, *out, None, None) if out_first else P(*lead_spec, None, None, *out)

    return jax.tree_util.tree_map_with_path(specs, adapters)


STEP_STATIC_ARGNAMES = ("config", "sampler", "view", "mesh", "quant")


def jit_step(**jit_options: Any) -> Any:
    """``engine_step`` jitted, its pages and rings donated (updated in place), with extra
    ``jax.jit`` options (e.g. ``compiler_options``)."""
    return jax.jit(engine_step, static_argnames=STEP_STATIC_ARGNAMES,
                   donate_argnames=("k_pages", "v_pages", "rings"), **jit_options)


step_jit = jit_step()
#: A step's forward and its sampling as two programs, for the steps with grammar rows.
forward_jit = jax.jit(engine_forward,
                      static_argnames=tuple(n for n in STEP_STATIC_ARGNAMES if n != "sampler"),
                      donate_argnames=("k_pages", "v_pages", "rings"))
sample_jit = jax.jit(sample_rows, static_argnames=("sampler",))
sample_from_jit = jax.jit(sample_from, static_argnames=("sampler",))
#: The forks' page copies, the pages donated (updated in place).
copy_pages_jit = jax.jit(copy_pages, donate_argnames=("k_pages", "v_pages"))
