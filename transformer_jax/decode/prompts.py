"""Prompts on the host, before any device work: validation, length buckets, padding and
per-sequence PRNG keys."""

from __future__ import annotations

import functools
import numbers
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.model.config import ModelConfig

#: Prompt lengths up to this are padded to the next power of two (at least ``MIN_BUCKET``);
#: longer ones to the next multiple of it (few programs, a tight cache).
BUCKET_MULTIPLE = 64
MIN_BUCKET = 8


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
    """S_max for a padded prompt length T: ``T + max_new_tokens``, capped at ``max_seq_len``
    (but at least T)."""
    return max(padded_len, min(padded_len + max_new_tokens, config.max_seq_len))


def is_int(x: Any) -> bool:
    # A plain int first: the ABC check costs about a microsecond, and a request checks ~8.
    return type(x) is int or (isinstance(x, numbers.Integral) and not isinstance(x, bool))


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
                all(is_int(x) for x in prompt)):
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
    if not is_int(max_new_tokens) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if cache_size is not None and (not is_int(cache_size) or cache_size <= 0):
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
    if is_int(seed):
        if 0 <= seed < 2 ** 32:  # one cached program
            return np.asarray(_folded_keys(np.uint32(seed), batch))
        keys = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(seed),
                                                        jnp.arange(batch, dtype=jnp.uint32))
    else:
        seeds = list(seed)
        if len(seeds) != batch or not all(is_int(s) for s in seeds):
            raise ValueError(f"seed must be an int or {batch} ints (one per prompt), got {seed!r}")
        if jax.config.jax_default_prng_impl == "threefry2x32" and all(
                0 <= s < 2 ** 32 for s in seeds):
            # threefry's key(s) of a uint32 seed is [s >> 32, s] = [0, s]: no device program
            return np.asarray([(0, s) for s in seeds], np.uint32).reshape(batch, 2)
        keys = jax.vmap(jax.random.key)(jnp.asarray(seeds, jnp.uint32))
    return np.asarray(jax.random.key_data(keys))


@functools.partial(jax.jit, static_argnums=1)
def _folded_keys(seed: jax.Array, batch: int) -> jax.Array:
    """[B, 2] uint32 ``fold_in(key(seed), b)`` for a uint32 ``seed`` (``key`` of a uint32
    is ``key`` of the same Python int)."""
    keys = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(seed),
                                                    jnp.arange(batch, dtype=jnp.uint32))
    return jax.random.key_data(keys)


def pad_prompts(prompts: Sequence[np.ndarray], length: int, pad_id: int = 0
                ) -> tuple[np.ndarray, np.ndarray]:
    """Right-pads prompts into ([B, length] int32 tokens, [B] int32 lengths)."""
    tokens = np.full((len(prompts), length), pad_id, np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    return tokens, np.asarray([len(p) for p in prompts], np.int32)
