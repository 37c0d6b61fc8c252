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
      head_dim: H, the (even) size of each head.
      base: the RoPE base.
      scaling: ``linear`` divides every frequency by the factor; ``llama3`` divides only the
        low frequencies and interpolates smoothly in between (as in Llama 3.1).

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
    # llama3: wavelengths longer than original_len / low_freq_factor are fully interpolated,
    # those shorter than original_len / high_freq_factor are kept, with a linear ramp in
    # 1/wavelength between the two so that no frequency jumps.
    wavelen = 2 * math.pi / freqs
    low_wavelen = scaling.original_max_len / scaling.low_freq_factor
    high_wavelen = scaling.original_max_len / scaling.high_freq_factor
    smooth = (scaling.original_max_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    ramped = (1 - smooth) * freqs / scaling.factor + smooth * freqs
    scaled = jnp.where(wavelen > low_wavelen, freqs / scaling.factor, freqs)
    return jnp.where((wavelen >= high_wavelen) & (wavelen <= low_wavelen), ramped, scaled)


def apply_rope(x: jax.Array, positions: jax.Array, *, base: float = 10000.0,
               pairing: str = "half", scaling: RopeScaling | None = None) -> jax.Array:
    """Rotates each head's vector by position-dependent angles (RoPE).

    Each pair ``(a, b)`` of coordinates at frequency ``theta_i`` is rotated by ``m * theta_i``
    where m is the token's position, so that ``<R_m q, R_n k>`` depends only on ``n - m``.

    Args:
      x: [B, T, N, H] queries or keys (N may be the number of kv heads).
      positions: [B, T] integer positions of each token (explicit, so padded/ragged batches and
        decode steps rotate correctly).
      base: the RoPE base.
      pairing: ``"half"`` pairs ``x_i`` with ``x_{i+H/2}`` (HF LLaMA layout); ``"adjacent"``
        pairs ``x_2i`` with ``x_2i+1`` (RoFormer paper).
      scaling: optional frequency rescaling.

    Returns:
      [B, T, N, H] rotated, in x's dtype (angles are computed in float32).
    """
    chex.assert_rank(x, 4)
    chex.assert_rank(positions, 2)
    chex.assert_equal(x.shape[:2], positions.shape)
    head_dim = x.shape[-1]
    freqs = rope_frequencies(head_dim, base, scaling)
    angles = positions.astype(jnp.float32)[:, :, None, None] * freqs  # [B, T, 1, H/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
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
    """Sinusoidal absolute encodings of the original Transformer.

    ``PE[pos, 2i] = sin(pos / base^(2i/D))`` and ``PE[pos, 2i+1] = cos(pos / base^(2i/D))``.

    Args:
      positions: [B, T] integer positions.
      dim: D, the (even) model width.
      base: the wavelength base (10000 in the paper).

    Returns:
      [B, T, D] float32 encodings, to be added to the token embeddings.
    """
    chex.assert_rank(positions, 2)
    if dim % 2:
        raise ValueError(f"sinusoidal encodings need an even width, got {dim}")
    freqs = 1.0 / (base ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))  # [D/2]
    angles = positions.astype(jnp.float32)[..., None] * freqs  # [B, T, D/2]
    return jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1).reshape(*positions.shape, dim)
