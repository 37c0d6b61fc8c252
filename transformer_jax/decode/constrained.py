"""Constrained generation: ``generate(..., constraints=...)``, each row's tokens drawn only from
those its constraint (a grammar's matcher, ``TokenConstraint``) allows next.

A host loop over three jitted programs: the prefill, the one-step decode and ``pick``, which
sets every logit a [B, ceil(V/32)] int32 bitmask does not allow to -inf before the
unconstrained draw. The masks (``fill_masks``, ``mask_logits``) serve the serving engine too.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.decode.loop import Params, SamplingSettings, decode_step, draw, prefill
from transformer_jax.decode.streaming import StreamFn
from transformer_jax.model.config import ModelConfig

logger = logging.getLogger(__name__)


@runtime_checkable
class TokenConstraint(Protocol):
    """One row's constraint on its next token, kept on the host (an ``llguidance.LLMatcher``)."""

    def compute_bitmask(self) -> bytes:
        """The tokens allowed next: at least ceil(V/32) little-endian int32 words, bit v % 32 of
        word v // 32 set when token v is."""

    def consume_token(self, token: int) -> bool:
        """Advances past the drawn ``token``; False when it was not allowed."""

    def is_stopped(self) -> bool:
        """Whether nothing more may follow (the grammar is complete)."""


def check_constraints(constraints: Sequence[Any], batch: int) -> list[TokenConstraint | None]:
    """``constraints`` as a list of B constraints or None, or ValueError naming the bad entry."""
    if isinstance(constraints, str | bytes) or not isinstance(constraints, Sequence):
        raise ValueError(f"constraints must be a list of one constraint (or None) per prompt, "
                         f"got {type(constraints).__name__}")
    if len(constraints) != batch:
        raise ValueError(f"constraints must hold one constraint (or None) per prompt: "
                         f"{len(constraints)} for {batch} prompts")
    for i, c in enumerate(constraints):
        if c is not None and not isinstance(c, TokenConstraint):
            raise ValueError(f"constraints[{i}] must have compute_bitmask, consume_token and "
                             f"is_stopped (an llguidance.LLMatcher), got {type(c).__name__}")
        if c is not None and c.is_stopped():
            raise ValueError(f"constraints[{i}] is already stopped (used before? make a fresh "
                             "matcher per prompt)")
    return list(constraints)


def fill_masks(constraints: Sequence[TokenConstraint | None], vocab_size: int) -> np.ndarray:
    """[R, ceil(V/32)] int32 bitmasks of the tokens each of R rows may draw next (bit v % 32 of
    word v // 32: token v): its constraint's, every token for a row without one (None)."""
    words = -(-vocab_size // 32)
    masks = np.full((len(constraints), words), -1, np.int32)
    for row, c in enumerate(constraints):
        if c is not None:
            masks[row] = np.frombuffer(c.compute_bitmask(), np.int32, words)
    return masks


def allowed(masks: jax.Array, vocab_size: int) -> jax.Array:
    """[R, ceil(V/32)] int32 bitmasks -> [R, V] bool (bit v % 32 of word v // 32)."""
    v = jnp.arange(vocab_size)
    words = jnp.take(masks, v // 32, axis=1)
    return ((words >> (v % 32).astype(jnp.int32)) & 1).astype(bool)


def mask_logits(logits: jax.Array, masks: jax.Array) -> jax.Array:
    """[R, V] logits with every token its row's [R, ceil(V/32)] bitmask does not allow at
    -inf (a draw from them follows the grammar; log-probabilities stay the raw logits')."""
    return jnp.where(allowed(masks, logits.shape[-1]), logits, -jnp.inf)


def pick(logits: jax.Array, masks: jax.Array, key_data: jax.Array, index: jax.Array, *,
         settings: SamplingSettings) -> tuple[jax.Array, jax.Array]:
    """Each row's token among those its mask allows, drawn as ``loop.draw`` draws.

    Args:
      logits: [B, V] float32 next-token logits.
      masks: [B, ceil(V/32)] int32 bitmasks (all ones: every token).
      key_data: [B, 2] uint32 raw PRNG key per row.
      index: [] int32, which new token this is (the draw uses ``fold_in(key, index)``).
      settings: static sampling settings.

    Returns:
      ([B] int32 tokens, [B] float32 their log-probabilities under the raw softmax).
    """
    b, v = logits.shape
    tokens, logprobs = draw(logits[:, None], key_data, jnp.full((b,), index, jnp.int32),
                            settings, allowed(masks, v)[:, None])
    return tokens[:, 0], logprobs[:, 0]


def jit_programs(**jit_options: Any) -> tuple[Any, Any, Any]:
    """The jitted (prefill, decode step, pick) of the loop (``jit_options``: to ``jax.jit``);
    the decode step donates the cache."""
    return (jax.jit(prefill, static_argnames=("config", "max_len", "dtype"), **jit_options),
            jax.jit(decode_step, static_argnames=("config",), donate_argnames=("cache",),
                    **jit_options),
            jax.jit(pick, static_argnames=("settings",), **jit_options))


prefill_jit, decode_jit, pick_jit = jit_programs()


def generate_constrained(config: ModelConfig, params: Params, tokens: np.ndarray,
                         lengths: np.ndarray, key_data: np.ndarray,
                         constraints: Sequence[TokenConstraint | None], *, max_new_tokens: int,
                         settings: SamplingSettings, cache_size: int,
                         cache_dtype: str | None, stream: StreamFn | None = None
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The host loop: ``generate_padded``'s outputs with each row held to its constraint.

    Args:
      config, params: the model's config and prepared weights (one device).
      tokens: [B, T] int32 right-padded prompts; lengths: [B] int32 their true lengths.
      key_data: [B, 2] uint32 raw PRNG key per row.
      constraints: B constraints or None (that row is free); each is advanced in place.
      max_new_tokens: N; settings: sampling settings, validated.
      cache_size: S_max slots, >= every length + N - 1; cache_dtype: its storage dtype name.
      stream: optional ``fn(step, tokens [B], active [B])`` called after every step.

    Returns:
      tokens [B, N] int32 (``pad_id`` after a row ends), logprobs [B, N] float32 (0 there),
      num_tokens [B] int32 generated per row (a stop token included).

    Raises:
      RuntimeError: a constraint refused the token drawn from its own mask.
    """
    b, n = tokens.shape[0], max_new_tokens
    out_tokens = np.full((b, n), settings.pad_id, np.int32)
    out_logprobs = np.zeros((b, n), np.float32)
    num, done = np.zeros(b, np.int32), np.zeros(b, bool)
    stop = set(settings.stop_tokens)
    keys = jnp.asarray(key_data, jnp.uint32)
    positions = jnp.asarray(lengths, jnp.int32) - 1
    logits, cache = prefill_jit(config, params, jnp.asarray(tokens), jnp.asarray(lengths),
                                max_len=cache_size, dtype=cache_dtype)
    for step in range(n):
        masks = fill_masks([None if done[row] else c for row, c in enumerate(constraints)],
                           config.vocab_size)  # asked while the device runs the step
        picked, logprob = pick_jit(logits, masks, keys, jnp.int32(step), settings=settings)
        if step + 1 < n:  # the next forward goes before the host reads this step's tokens
            # every row advances (finished ones' outputs dropped), at most to length + N - 2
            positions = positions + 1
            logits, cache = decode_jit(config, params, cache, picked, positions)
        picked, logprob = np.asarray(picked), np.asarray(logprob)
        active = ~done
        for row in np.flatnonzero(active):
            tok = int(picked[row])
            out_tokens[row, step], out_logprobs[row, step] = tok, logprob[row]
            num[row] += 1
            c = constraints[row]
            if c is not None and not c.consume_token(tok):
                raise RuntimeError(f"constraint of row {row} refused token {tok}, drawn from "
                                   "its own mask")
            done[row] = tok in stop or num[row] >= n or (c is not None and c.is_stopped())
        if stream is not None:
            stream(step, np.where(active, picked, settings.pad_id).astype(np.int32), active)
        if done.all():
            break
    logger.debug("constrained generate: B=%d, %d steps", b, int(num.max()))
    return out_tokens, out_logprobs, num
