"""Generation on the host: ``generate(config, params, prompts, ...)`` -> ``GenerateResult``:
validation, prompts padded to a length bucket, then the jitted ``decode.generate_padded`` (or
the constrained or speculative loops)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from transformer_jax.decode import constrained, speculative_loop, speculative_mtp, streaming
from transformer_jax.decode import loop as decode
from transformer_jax.decode.constrained import TokenConstraint
from transformer_jax.decode.loop import DecodeWeights, Params, SamplingSettings
from transformer_jax.decode.prompts import (
    default_cache_size,
    is_int,
    pad_prompts,
    prompt_bucket,
    sequence_keys,
    validate_capacity,
    validate_prompts,
)
from transformer_jax.decode.speculative import parse_spec
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.kv_cache import cache_bytes

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class GenerateResult:
    """What ``generate`` returns.

    Attributes:
      tokens: per prompt, the new ids without padding (a stop token that ended it included).
      logprobs: per prompt, each id's log-probability under the model's raw softmax.
      lengths: per prompt, ``len(tokens[b])``.
      token_array: [B, N] int32, ``tokens`` right-padded with ``pad_id``.
      logprob_array: [B, N] float32, ``logprobs`` right-padded with 0.
      speculative: per prompt, its ``speculative.Acceptance`` when speculating.
    """

    tokens: list[list[int]]
    logprobs: list[list[float]]
    lengths: list[int]
    token_array: np.ndarray
    logprob_array: np.ndarray
    speculative: list[Any] | None = None


def _float_dtype_name(dtype: Any) -> str:
    """The name of a floating dtype (a static, hashable argument), or ValueError."""
    try:
        dt = jnp.dtype(dtype)
    except TypeError as e:
        raise ValueError(f"cache_dtype {dtype!r} is not a dtype") from e
    if not (jnp.issubdtype(dt, jnp.floating) or dt == jnp.int8):
        raise ValueError(f"cache_dtype must be a floating dtype or int8, got {dt.name}")
    return dt.name


def generate(config: ModelConfig, params: Params | DecodeWeights,
             prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
             temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, min_p: float | None = None,
             seed: int | Sequence[int] = 0, stop_tokens: Sequence[int] = (), pad_id: int = 0,
             cache_size: int | None = None, cache_dtype: jnp.dtype | str | None = None,
             stream: streaming.StreamFn | None = None,
             mesh: Mesh | None = None, quant: str | None = None,
             constraints: Sequence[TokenConstraint | None] | None = None,
             speculative: Any = None, draft: Any = None) -> GenerateResult:
    """Generates up to ``max_new_tokens`` tokens after each prompt, in one jitted call.

    The prefill and the decode loop are one compiled program (``generate_padded``), compiled
    once per (config, batch size, prompt bucket, max_new_tokens, sampling settings,
    cache_size). Raw parameters are prepared (``prepare``) on every call. Everything is
    validated before any device work.

    Args:
      config: the model's config.
      params: the model's parameters (either layout), or ``DecodeWeights`` from ``prepare``.
      prompts: B lists of token ids, each non-empty, ids in [0, V).
      max_new_tokens: N > 0; each prompt length + N must be <= ``config.max_seq_len``.
      temperature, top_k, top_p, min_p: sampling (``decode.sampling``); temperature 0 is
        greedy.
      seed: an int, or one int per prompt (then a prompt samples the same in any batch).
      stop_tokens: ids that end a sequence; the stop token is included in the output.
      pad_id: id that finished sequences emit in ``token_array``.
      cache_size: S_max slots of the KV cache, >= every prompt length + N; default the padded
        prompt length + N, capped at ``config.max_seq_len``.
      cache_dtype: the KV cache's storage dtype (``"bfloat16"``, ``"int8"``); default the
        model's compute dtype.
      stream: optional ``fn(step, tokens [B], active [B])`` called on the host every step.
      mesh: optional mesh with a ``"tensor"`` axis (other axes of size 1) to decode
        tensor-parallel over; with ``DecodeWeights``, theirs (None here, or the same).
      quant: weight quantisation of raw parameters (``"int8"``, ``"int4"``, ``"int4:G"``);
        ``DecodeWeights`` must have been prepared with it.
      constraints: structured outputs: one ``TokenConstraint`` (or None) per prompt, each
        advanced in place (``decode.constrained``; one device).
      speculative: a spec string (``"ngram:k=4"``, ``"draft:PATH:k=4"``, ``"mtp"``) or a
        ``SpeculativeConfig``: the same tokens (one device, no constraints, no ring layers).
      draft: a ``speculative_loop.DraftModel`` for a ``"draft"`` spec.

    Returns:
      A ``GenerateResult`` (``.tokens``, ``.logprobs``, ``.lengths``, and padded arrays).

    Raises:
      ValueError: for bad prompts, capacity, or sampling settings (before any compute).
    """
    vocab = config.vocab_size
    settings = SamplingSettings(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        stop_tokens=tuple(int(t) if is_int(t) else t for t in stop_tokens), pad_id=pad_id)
    settings.validate(vocab)
    if isinstance(params, DecodeWeights):
        mesh = params.check_for(config, mesh, "generate", quant)
    decode.check_tensor_parallel(config, decode.tensor_shards(mesh))
    arrays = validate_prompts(prompts, vocab)
    if constraints is not None:
        constraints = constrained.check_constraints(constraints, len(arrays))
        if decode.is_split(mesh):
            raise ValueError("constraints: a tensor-parallel mesh is not supported with "
                             "constraints; decode on one device")
    spec = parse_spec(speculative)
    if spec is not None:
        if constraints is not None:
            raise ValueError("speculative: not supported together with constraints")
        if decode.is_split(mesh):
            raise ValueError("speculative: a tensor-parallel mesh is not supported; decode on "
                             "one device")
        speculative_loop.check_no_rings(config, "the model")
        if spec.method == "mtp":
            speculative_mtp.check_mtp(config, spec.k)
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
        params = decode.prepare(config, params, mesh, quant=quant)
    start = time.perf_counter()
    if spec is not None:
        if spec.method == "draft":
            if draft is None:
                raise ValueError(f"speculative draft:{spec.draft}: pass the draft model as draft= "
                                 "(checkpoint.loading.load_draft(PATH) opens a checkpoint)")
            draft.check_against(config)
        *out, stats = speculative_loop.generate_speculative(
            config, params, tokens, lengths_arr, keys, max_new_tokens=max_new_tokens,
            settings=settings, cache_size=cache_size + spec.k + 1, cache_dtype=cache_dtype,
            spec=spec, draft=draft, stream=stream)
        logger.log(logging.INFO if spec.method == "mtp" else logging.DEBUG,
                   "speculative generate (%s) took %.3f s, acceptance %s", spec,
                   time.perf_counter() - start, [round(s.acceptance_rate, 3) for s in stats])
        return dataclasses.replace(result_from_arrays(*out), speculative=stats)
    if constraints is not None:
        out = constrained.generate_constrained(
            config, params.params, tokens, lengths_arr, keys, constraints,
            max_new_tokens=max_new_tokens, settings=settings, cache_size=cache_size,
            cache_dtype=cache_dtype, stream=stream)
        logger.debug("constrained generate took %.3f s", time.perf_counter() - start)
        return result_from_arrays(*out)
    with streaming.registered(stream) as stream_id:
        out_tokens, out_logprobs, num = decode._generate_jit(
            config, params, tokens, lengths_arr, keys, stream_id,
            max_new_tokens=max_new_tokens, settings=settings, cache_size=cache_size, mesh=mesh,
            cache_dtype=cache_dtype)
        out_tokens, out_logprobs, num = jax.device_get((out_tokens, out_logprobs, num))
    logger.debug("generate took %.3f s", time.perf_counter() - start)
    return result_from_arrays(out_tokens, out_logprobs, num)


def result_from_arrays(tokens: np.ndarray, logprobs: np.ndarray, num_tokens: np.ndarray
                       ) -> GenerateResult:
    """A ``GenerateResult`` from ``generate_padded``'s outputs ([B, N], [B, N], [B])."""
    tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)
    num = [int(x) for x in np.asarray(num_tokens)]
    return GenerateResult(tokens=[tokens[i, :n].tolist() for i, n in enumerate(num)],
                          logprobs=[logprobs[i, :n].tolist() for i, n in enumerate(num)],
                          lengths=num, token_array=tokens, logprob_array=logprobs)
