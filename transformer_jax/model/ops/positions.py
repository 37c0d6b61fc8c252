"""Position information: rotary embeddings (RoPE) and sinusoidal absolute encodings."""

import math

import chex
import jax
import jax.numpy as jnp

from transformer_jax.model.config import RopeScaling


def rope_frequencies(head_dim: int, base: float = 10000.0,
                     scaling: RopeScaling | None = None) -> jax.Array:
    """Rotation frequencies ``theta_i = base^(-2i/H)`` for i in [0, H/2), optionally rescaled.

    Args:
      head_dim, base: H (even) and the RoPE base.
      scaling: optional rescaling (``RopeScaling``).

    Returns:
      [H/2] float32 angular frequencies (radians per position).
    """
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
    freqs = 1.0 / (base ** exponents)
    if scaling is None:
        return freqs
    if scaling.kind == "linear":
        return freqs / scaling.factor
    if scaling.kind == "yarn":
        return _yarn_frequencies(freqs, head_dim, base, scaling)
    # llama3: long wavelengths interpolated, short ones kept, a ramp in 1/wavelength between.
    wavelen = 2 * math.pi / freqs
    low_wavelen = scaling.original_max_len / scaling.low_freq_factor
    high_wavelen = scaling.original_max_len / scaling.high_freq_factor
    # Equal factors (Llama 4) leave no ramp: every frequency is kept or divided.
    smooth = (scaling.original_max_len / wavelen - scaling.low_freq_factor) / (
        (scaling.high_freq_factor - scaling.low_freq_factor) or 1.0)
    ramped = (1 - smooth) * freqs / scaling.factor + smooth * freqs
    scaled = jnp.where(wavelen > low_wavelen, freqs / scaling.factor, freqs)
    return jnp.where((wavelen >= high_wavelen) & (wavelen <= low_wavelen), ramped, scaled)


def _yarn_frequencies(freqs: jax.Array, head_dim: int, base: float,
                      scaling: RopeScaling) -> jax.Array:
    """YaRN's [H/2] frequencies from the plain ones ``freqs`` [H/2].

    Pair i turns r times over the original context L at the (fractional) pair index
    ``H ln(L / (2 pi r)) / (2 ln base)``: pairs below the index for ``beta_fast`` keep their
    frequency, pairs above the one for ``beta_slow`` are divided by ``factor``, with a linear
    ramp between (ends rounded outwards with ``truncate``, clipped to [0, H - 1]).
    """
    def pair_index(rotations: float) -> float:
        return head_dim * math.log(scaling.original_max_len / (rotations * 2 * math.pi)) / (
            2 * math.log(base))

    low, high = pair_index(scaling.beta_fast), pair_index(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    ramp = jnp.clip((jnp.arange(head_dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    # ramp 0: keep the frequency (extrapolate); ramp 1: divide it by the factor (interpolate).
    return freqs / scaling.factor * ramp + freqs * (1 - ramp)


def rope_attention_factor(scaling: RopeScaling | None) -> float:
    """The multiplier of RoPE's cos and sin: 1 except for YaRN, which scales them by
    ``attention_factor`` when given, else by ``m(factor, mscale) / m(factor, mscale_all_dim)`` when
    both are set, else by ``m(factor, 1)``; ``m(f, s) = 0.1 s ln(f) + 1`` for f > 1, else 1.

    Args:
      scaling: the model's RoPE scaling, or None.

    Returns:
      The factor, a Python float.
    """
    if scaling is None or scaling.kind != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return float(scaling.attention_factor)

    def m(factor: float, mscale: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return float(m(scaling.factor, scaling.mscale) / m(scaling.factor, scaling.mscale_all_dim))
    return float(m(scaling.factor))


def apply_rope(x: jax.Array, positions: jax.Array, *, base: float = 10000.0,
               pairing: str = "half", scaling: RopeScaling | None = None,
               freqs: jax.Array | None = None,
               attention_factor: float | jax.Array | None = None) -> jax.Array:
    """Rotates each head's vector by position-dependent angles (RoPE): pair ``(a, b)`` at frequency
    ``theta_i`` by ``m * theta_i``, m the token's position; cos and sin times the attention factor.

    Args:
      x: [B, T, N, H] queries or keys.
      positions: [B, T] integer positions of each token.
      base, scaling: the RoPE base and optional frequency rescaling.
      pairing: ``"half"`` pairs ``x_i`` with ``x_{i+H/2}`` (HF LLaMA), ``"adjacent"`` ``x_2i``
        with ``x_2i+1`` (RoFormer).
      freqs: optional [H/2] float32 frequencies (may be traced) in place of ``base``/``scaling``'s.
      attention_factor: the cos/sin multiplier; default ``rope_attention_factor(scaling)``.

    Returns:
      [B, T, N, H] rotated, in x's dtype (angles computed in float32).
    """
    chex.assert_rank(x, 4)
    chex.assert_rank(positions, 2)
    chex.assert_equal(x.shape[:2], positions.shape)
    head_dim = x.shape[-1]
    if freqs is None:
        freqs = rope_frequencies(head_dim, base, scaling)
    else:
        chex.assert_shape(freqs, (head_dim // 2,))
    factor = rope_attention_factor(scaling) if attention_factor is None else attention_factor
    angles = positions.astype(jnp.float32)[:, :, None, None] * freqs  # [B, T, 1, H/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if not (isinstance(factor, (int, float)) and factor == 1.0):
        factor = jnp.asarray(factor, jnp.float32)
        cos, sin = cos * factor, sin * factor
    x32 = x.astype(jnp.float32)
    if pairing == "half":
        a, b = x32[..., : head_dim // 2], x32[..., head_dim // 2:]
        out = jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
    elif pairing == "adjacent":
        a, b = x32[..., 0::2], x32[..., 1::2]
        out = jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(x.shape)
    else:
        raise ValueError(f"pairing must be 'half' or 'adjacent', got {pairing!r}")
    return out.astype(x.dtype)


def sinusoidal_positions(positions: jax.Array, dim: int, base: float = 10000.0) -> jax.Array:
    """Sinusoidal absolute encodings of the original Transformer, ``PE[pos, 2i] = sin(pos /
    base^(2i/D))``, ``PE[pos, 2i+1] = cos(...)``.

    Args:
      positions, dim, base: [B, T] integer positions, D (even), the wavelength base.

    Returns:
      [B, T, D] float32 encodings, to be added to the token embeddings.
    """
    chex.assert_rank(positions, 2)
    if dim % 2:
        raise ValueError(f"sinusoidal encodings need an even width, got {dim}")
    freqs = 1.0 / (base ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))  # [D/2]
    angles = positions.astype(jnp.float32)[..., None] * freqs  # [B, T, D/2]
    return jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1).reshape(*positions.shape, dim)


def chunk_segments(q_positions: jax.Array, k_positions: jax.Array, chunk: int,
                   q_segments: jax.Array | None = None, k_segments: jax.Array | None = None
                   ) -> tuple[jax.Array, jax.Array]:
    """Segment ids under which a query at m sees only keys at n with ``m // C == n // C``.

    Args:
      q_positions, k_positions, chunk: [B, T], [B, S] int positions of queries and keys; C.
      q_segments, k_segments: optional [B, T], [B, S] packed-sequence ids (0 = padding).

    Returns:
      ([B, T], [B, S]) int32 segment ids, non-zero except where the packed ones are 0.
    """
    q_ids, k_ids = q_positions // chunk + 1, k_positions // chunk + 1
    if q_segments is None:
        return q_ids.astype(jnp.int32), k_ids.astype(jnp.int32)
    stride = jnp.maximum(jnp.max(q_ids), jnp.max(k_ids)) + 1  # chunk ids per packed segment
    return (jnp.where(q_segments == 0, 0, q_segments * stride + q_ids).astype(jnp.int32),
            jnp.where(k_segments == 0, 0, k_segments * stride + k_ids).astype(jnp.int32))
