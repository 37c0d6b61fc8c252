"""Pure, jittable next-token sampling from [B, V] logits (the decode loop calls :func:`sample`).

Computation is in float32; filters set removed tokens to ``-inf``, always keep the most likely
token (and any tied at the cut-off), and compose as HuggingFace's: temperature -> top-k ->
top-p -> min-p. Settings are Python scalars (range-checked eagerly; a no-op value skips its
filter) or [B] arrays, one value per row (checked by :func:`validate_sampling_args`).
"""

from __future__ import annotations

import logging
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

logger = logging.getLogger(__name__)

__all__ = ["apply_temperature", "min_p_mask", "sample", "sample_with_logprobs", "token_logprobs",
           "top_logprobs", "top_k_mask", "top_p_mask", "validate_sampling_args"]

# Scalars or per-row [B] arrays; kept loose because jax/numpy arrays and tracers are all valid.
RowParam = float | int | jax.Array | np.ndarray


def _is_python_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.ndarray))


def _check_range(name: str, value: Any, low: float, high: float, low_inclusive: bool,
                 high_inclusive: bool) -> None:
    """Raises ValueError unless every entry of a concrete ``value`` lies in the given interval."""
    arr = np.asarray(value, dtype=np.float64)
    if arr.ndim > 1:
        raise ValueError(f"{name} must be a scalar or a 1-D per-row array; got shape {arr.shape}")
    flat = arr.reshape(-1)
    above = flat >= low if low_inclusive else flat > low
    below = flat <= high if high_inclusive else flat < high
    bad = ~(above & below)  # NaN fails both comparisons, so it is reported as bad too.
    if np.any(bad):
        offending = flat[bad][0]
        interval = f"{'[' if low_inclusive else '('}{low}, {high}{']' if high_inclusive else ')'}"
        raise ValueError(f"{name} must be in {interval}; got {offending!r}")


def _check_top_k(top_k: Any, vocab_size: int) -> None:
    arr = np.asarray(top_k)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"top_k must be an integer (or integer array); got {top_k!r}")
    if arr.ndim > 1:
        raise ValueError(f"top_k must be a scalar or a 1-D per-row array; got shape {arr.shape}")
    flat = arr.reshape(-1)
    bad = (flat <= 0) | (flat > vocab_size)
    if np.any(bad):
        raise ValueError(f"top_k must be in [1, vocab_size={vocab_size}]; got {int(flat[bad][0])}")


def validate_sampling_args(temperature: RowParam, top_k: int | jax.Array | np.ndarray | None,
                           top_p: RowParam | None, min_p: RowParam | None,
                           vocab_size: int) -> None:
    """Checks sampling settings on the host: every entry of a scalar or [B] array (traced
    values, inside ``jit``, are skipped).

    Args:
        temperature: >= 0 and finite; 0 means greedy.
        top_k: None (disabled) or integer(s) in [1, vocab_size].
        top_p: None (disabled) or value(s) in (0, 1].
        min_p: None (disabled) or value(s) in [0, 1].
        vocab_size: V, a positive integer.

    Raises:
        ValueError: naming the first offending argument and value.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, numbers.Integral) \
            or vocab_size <= 0:
        raise ValueError(f"vocab_size must be a positive integer; got {vocab_size!r}")
    if temperature is None:
        raise ValueError("temperature must be given (use 0 for greedy decoding); got None")
    values = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p}
    for name, value in values.items():
        if isinstance(value, jax.core.Tracer):
            logger.debug("Skipping validation of traced %s", name)
        elif value is not None:
            _check_arg(name, value, vocab_size)


#: Each float setting's interval: (low, high, low included, high included).
_RANGES = {"temperature": (0.0, math.inf, True, False), "top_p": (0.0, 1.0, False, True),
           "min_p": (0.0, 1.0, True, True)}


def _check_arg(name: str, value: Any, vocab_size: int) -> None:
    if name == "top_k":
        return _check_top_k(value, vocab_size)
    _check_range(name, value, *_RANGES[name])


def _check_python_scalars(vocab_size: int, **values: Any) -> None:
    """Range-checks the arguments given as Python numbers; arrays are left to the caller."""
    for name, value in values.items():
        if _is_python_number(value):
            _check_arg(name, value, vocab_size)


def _as_logits(logits: jax.Array) -> jax.Array:
    logits = jnp.asarray(logits)
    if logits.ndim != 2:
        raise ValueError(f"logits must have shape [B, V]; got shape {logits.shape}")
    return logits.astype(jnp.float32)


def _row_param(value: RowParam, batch: int, name: str) -> jax.Array:
    """Returns ``value`` as float32, either 0-d or shaped [B, 1] to broadcast against [B, V]."""
    arr = jnp.asarray(value, dtype=jnp.float32)
    if arr.ndim == 0:
        return arr
    if arr.shape != (batch,):
        raise ValueError(f"{name} must be a scalar or have shape [B]=({batch},); got shape "
                         f"{arr.shape}")
    return arr[:, None]


def _sort_descending(logits: jax.Array) -> jax.Array:
    return jnp.flip(jnp.sort(logits, axis=-1), axis=-1)


def _keep_at_least(logits: jax.Array, threshold: jax.Array) -> jax.Array:
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def _temperature(logits: jax.Array, temperature: RowParam) -> jax.Array:
    if _is_python_number(temperature):
        if temperature in (0, 1):  # 0 is handled by greedy selection; 1 is the identity.
            return logits
        return logits / jnp.float32(temperature)
    t = _row_param(temperature, logits.shape[0], "temperature")
    # Rows with temperature 0 are decoded greedily by the caller; dividing by 1 keeps them finite.
    return logits / jnp.where(t > 0, t, 1.0)


def apply_temperature(logits: jax.Array, temperature: RowParam) -> jax.Array:
    """Divides logits by a (per-row) temperature; rows with temperature 0 (greedy) unchanged.

    Args:
        logits: [B, V] logits.
        temperature: scalar or [B] array of temperatures >= 0.

    Returns:
        [B, V] float32 scaled logits.
    """
    logits = _as_logits(logits)
    _check_python_scalars(logits.shape[-1], temperature=temperature)
    return _temperature(logits, temperature)


def _top_k(logits: jax.Array, k: Any) -> tuple[jax.Array, jax.Array]:
    """Returns (masked logits [B, V], descending kept values [B, k or V] padded with -inf)."""
    vocab = logits.shape[-1]
    if isinstance(k, numbers.Integral) and not isinstance(k, bool):
        _check_top_k(k, vocab)
        values = jax.lax.top_k(logits, int(k))[0]  # [B, k], descending; no full sort needed.
        return _keep_at_least(logits, values[:, -1:]), values
    # Per-row k cannot use lax.top_k (k must be static), so fall back to a full sort.
    k_arr = jnp.asarray(k)
    if not jnp.issubdtype(k_arr.dtype, jnp.integer):
        raise ValueError(f"top_k must be an integer or integer array; got dtype {k_arr.dtype}")
    if k_arr.ndim == 0:
        k_arr = jnp.broadcast_to(k_arr, logits.shape[:1])
    if k_arr.shape != logits.shape[:1]:
        raise ValueError(f"top_k must be an int or have shape [B]=({logits.shape[0]},); got "
                         f"{k_arr.shape}")
    k_arr = jnp.clip(k_arr, 1, vocab)
    values = _sort_descending(logits)
    threshold = jnp.take_along_axis(values, (k_arr - 1)[:, None], axis=-1)
    return _keep_at_least(logits, threshold), _keep_at_least(values, threshold)


def top_k_mask(logits: jax.Array, k: int | jax.Array) -> jax.Array:
    """Keeps the k most likely tokens of each row (and any tied with the k-th).

    Args:
        logits: [B, V] logits.
        k: a static int in [1, V] (``jax.lax.top_k``), or a [B] integer array (a full sort;
            clipped to [1, V]).

    Returns:
        [B, V] float32 logits with removed tokens set to -inf.
    """
    return _top_k(_as_logits(logits), k)[0]


def _top_p(logits: jax.Array, sorted_desc: jax.Array, p: RowParam) -> jax.Array:
    """Nucleus filter given ``sorted_desc``, a descending prefix [B, M] of the logits (the
    top-k values when top-k ran first: the rest are -inf or tied with its last)."""
    p_arr = _row_param(p, logits.shape[0], "top_p")
    log_norm = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    probs = jnp.exp(sorted_desc - log_norm)
    cumulative = jnp.cumsum(probs, axis=-1)
    # Mass strictly before each position; computed by shifting, not by `cumulative - probs`,
    # to avoid cancellation error on the head of the distribution.
    mass_before = jnp.concatenate([jnp.zeros_like(cumulative[:, :1]), cumulative[:, :-1]], -1)
    # Position i belongs to the smallest prefix reaching p iff the mass before it is < p.
    keep_count = jnp.sum(mass_before < p_arr, axis=-1, keepdims=True)
    keep_count = jnp.maximum(keep_count, 1)  # always keep the top token, even for p <= 0
    threshold = jnp.take_along_axis(sorted_desc, keep_count - 1, axis=-1)
    # float32 cumulative sums can round to 1 before the tail; p == 1 must still keep everything.
    threshold = jnp.where(p_arr >= 1.0, -jnp.inf, threshold)
    return _keep_at_least(logits, threshold)


def top_p_mask(logits: jax.Array, p: RowParam) -> jax.Array:
    """Nucleus (top-p) filter: keeps the smallest prefix of tokens by descending probability
    whose cumulative probability is >= p (float32 sums), and any tied with its last; p == 1
    keeps every token.

    Args:
        logits: [B, V] logits.
        p: scalar or [B] array in (0, 1].

    Returns:
        [B, V] float32 logits with removed tokens set to -inf.
    """
    logits = _as_logits(logits)
    _check_python_scalars(logits.shape[-1], top_p=p)
    return _top_p(logits, _sort_descending(logits), p)


def _min_p(logits: jax.Array, max_logit: jax.Array, min_p: RowParam) -> jax.Array:
    m = _row_param(min_p, logits.shape[0], "min_p")
    # prob_i >= min_p * prob_max  <=>  logit_i >= logit_max + log(min_p); log(0) keeps all
    return _keep_at_least(logits, max_logit + jnp.log(m))


def min_p_mask(logits: jax.Array, min_p: RowParam) -> jax.Array:
    """Min-p filter: keeps exactly the tokens with prob >= min_p * max_prob.

    Args:
        logits: [B, V] logits.
        min_p: scalar or [B] array in [0, 1].

    Returns:
        [B, V] float32 logits with removed tokens set to -inf.
    """
    logits = _as_logits(logits)
    _check_python_scalars(logits.shape[-1], min_p=min_p)
    return _min_p(logits, jnp.max(logits, axis=-1, keepdims=True), min_p)


def _filter_logits(logits: jax.Array, temperature: RowParam, top_k: int | jax.Array | None,
                   top_p: RowParam | None, min_p: RowParam | None) -> jax.Array:
    """temperature -> top-k -> top-p -> min-p, sharing one sort between the filters."""
    vocab = logits.shape[-1]
    x = _temperature(logits, temperature)
    top_k, top_p, min_p = (None if _is_python_number(v) and v == no_op else v  # filters off
                           for v, no_op in ((top_k, vocab), (top_p, 1), (min_p, 0)))
    sorted_desc = None
    if top_k is not None:
        x, sorted_desc = _top_k(x, top_k)
    if top_p is not None:
        if sorted_desc is None:
            sorted_desc = _sort_descending(x)
        x = _top_p(x, sorted_desc, top_p)
    if min_p is not None:
        # Filters never remove the top token, so the row maximum is unchanged by them.
        max_logit = sorted_desc[:, :1] if sorted_desc is not None else jnp.max(x, -1, keepdims=True)
        x = _min_p(x, max_logit, min_p)
    return x


def _is_batched_key(key: jax.Array, batch: int) -> bool:
    """True for per-row keys ([B] typed keys or [B, 2] raw keys), False for one shared key."""
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    single_ndim = 0 if typed else 1
    if key.ndim == single_ndim:
        return False
    if key.ndim == single_ndim + 1 and key.shape[0] == batch:
        return True
    raise ValueError(f"key must be a single PRNG key or one key per row (leading dim B={batch}); "
                     f"got shape {key.shape} with dtype {key.dtype}")


def token_logprobs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """Log-probabilities of ``tokens`` under the raw softmax of ``logits``.

    Args:
        logits: [B, V] logits.
        tokens: [B] integer token ids.

    Returns:
        [B] float32 ``log_softmax(logits)[b, tokens[b]]``.
    """
    log_probs = jax.nn.log_softmax(_as_logits(logits), axis=-1)
    return jnp.take_along_axis(log_probs, jnp.asarray(tokens)[:, None], axis=-1)[:, 0]


def argmax(logits: jax.Array) -> jax.Array:
    """[B, V] -> [B] int32 first index of each row's maximum, as ``jnp.argmax`` (a max and a
    min: XLA's CPU argmax, one variadic reduce, is not vectorised and 2-3x slower)."""
    v = logits.shape[-1]
    top = jnp.max(logits, axis=-1, keepdims=True)
    return jnp.min(jnp.where(logits == top, jnp.arange(v, dtype=jnp.int32), v), axis=-1)


def _sample(logits: jax.Array, key: jax.Array | None, temperature: RowParam,
            top_k: int | jax.Array | None, top_p: RowParam | None, min_p: RowParam | None
            ) -> jax.Array:
    batch, vocab = logits.shape
    _check_python_scalars(vocab, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    greedy_tokens = argmax(logits)
    if _is_python_number(temperature) and temperature == 0:
        return greedy_tokens
    if key is None:
        raise ValueError("key is required unless temperature is the Python scalar 0; got None")
    key = jnp.asarray(key)
    filtered = _filter_logits(logits, temperature, top_k, top_p, min_p)
    if _is_batched_key(key, batch):
        sampled = jax.vmap(lambda k, row: jax.random.categorical(k, row))(key, filtered)
    else:
        sampled = jax.random.categorical(key, filtered, axis=-1)
    sampled = sampled.astype(jnp.int32)
    if _is_python_number(temperature):
        return sampled
    t = jnp.broadcast_to(_row_param(temperature, batch, "temperature").reshape(-1), (batch,))
    # Filters never drop the argmax, so greedy rows ignore them exactly as the spec requires.
    return jnp.where(t == 0, greedy_tokens, sampled)


def sample(logits: jax.Array, key: jax.Array | None, *, temperature: RowParam = 1.0,
           top_k: int | jax.Array | None = None, top_p: RowParam | None = None,
           min_p: RowParam | None = None) -> jax.Array:
    """Samples one token per row.

    Filters run temperature -> top-k -> top-p -> min-p. Rows with temperature 0 take the argmax
    of the raw logits; a Python scalar temperature of 0 skips the random draw.

    Args:
        logits: [B, V] logits.
        key: one PRNG key for the batch (raw uint32 [2] or typed []), or per-row keys (raw
            [B, 2] or typed [B]); None only when ``temperature`` is the Python scalar 0.
        temperature: scalar or [B] array, >= 0; 0 means greedy.
        top_k: None, a static int in [1, V], or an integer [B] array (a full sort).
        top_p: None, or scalar / [B] array in (0, 1].
        min_p: None, or scalar / [B] array in [0, 1].

    Returns:
        [B] int32 sampled token ids.

    Raises:
        ValueError: for malformed shapes, a missing key, or out-of-range Python scalars.
    """
    return _sample(_as_logits(logits), key, temperature, top_k, top_p, min_p)


def top_logprobs(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The k most likely tokens of each row under the raw softmax, most likely first.

    Args:
        logits: [B, V] logits.
        k: how many, at most V.

    Returns:
        ids: [B, k] int32 token ids.
        logprobs: [B, k] float32 their ``log_softmax(logits)`` values.
    """
    log_probs = jax.nn.log_softmax(_as_logits(logits), axis=-1)
    values, ids = jax.lax.top_k(log_probs, k)
    return ids.astype(jnp.int32), values


def sample_with_logprobs(logits: jax.Array, key: jax.Array | None, *,
                         temperature: RowParam = 1.0, top_k: int | jax.Array | None = None,
                         top_p: RowParam | None = None, min_p: RowParam | None = None
                         ) -> tuple[jax.Array, jax.Array]:
    """Like :func:`sample`, also returning each chosen token's log-probability under the
    model's raw softmax (temperature 1, no filtering), as serving APIs report it.

    Args:
        logits: [B, V] logits.
        key, temperature, top_k, top_p, min_p: as for :func:`sample`.

    Returns:
        tokens: [B] int32 sampled token ids.
        logprobs: [B] float32 ``log_softmax(logits)[b, tokens[b]]``.
    """
    logits = _as_logits(logits)
    tokens = _sample(logits, key, temperature, top_k, top_p, min_p)
    return tokens, token_logprobs(logits, tokens)
