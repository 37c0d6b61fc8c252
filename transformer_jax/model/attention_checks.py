"""The checks of an ``Architecture``'s chunked, NoPE and latent (``mla``) attention fields."""

from __future__ import annotations

from typing import Any

from transformer_jax.model.fields import MLA, check_positive_int, check_positive_number


def check_chunks_and_nope(config: Any) -> None:
    """Validates ``attention_chunk``, ``nope_layers`` and the NoPE temperature."""
    if config.attention_chunk is not None:
        check_positive_int("attention_chunk", config.attention_chunk)
        if config.sliding_window is not None:
            raise ValueError("attention_chunk and sliding_window cannot both be set (the "
                             "caches keep one ring size)")
    if "chunked" in config.layer_pattern and config.attention_chunk is None:
        raise ValueError("layer_pattern has chunked layers but attention_chunk is not set")
    if not isinstance(config.nope_layers, tuple) or any(
            isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < config.n_layers
            for i in config.nope_layers):
        raise ValueError(f"nope_layers must list layer indices in 0..{config.n_layers - 1}, "
                         f"got {config.nope_layers!r}")
    if config.nope_layers and config.position != "rope":
        raise ValueError("nope_layers needs position='rope'")
    if config.nope_temperature_floor is not None:
        check_positive_int("nope_temperature_floor", config.nope_temperature_floor)
        if not config.nope_layers:
            raise ValueError("nope_temperature_floor needs nope_layers (it scales their "
                             "queries)")
    check_positive_number("nope_temperature_scale", config.nope_temperature_scale)


def check_mla(config: Any) -> None:
    """Validates ``mla``; sets an unset ``head_dim`` / ``n_kv_heads`` to the rope width / N."""
    m = config.mla
    if not isinstance(m, MLA):
        raise ValueError(f"mla must be a table of MLA fields, got {m!r}")
    if config.position != "rope":
        raise ValueError(f"mla needs position='rope', got {config.position!r}")
    for name, value in (("head_dim", m.qk_rope_head_dim), ("n_kv_heads", config.n_heads)):
        if getattr(config, name) is None:
            object.__setattr__(config, name, value)
        elif getattr(config, name) != value:
            raise ValueError(f"mla: {name} must be {value} (the rope width / n_heads) or "
                             f"unset, got {name}={getattr(config, name)}")
    unsupported = [name for name in ("sliding_window", "qkv_bias", "qk_norm", "attn_softcap",
                                     "local_rope_base", "attention_chunk")
                   if getattr(config, name) is not None and getattr(config, name) is not False]
    unsupported += [name for name in ("nope_layers", "attn_sinks", "o_bias")
                    if getattr(config, name)]
    if unsupported:
        raise ValueError(f"mla (latent attention) cannot be combined with "
                         f"{', '.join(unsupported)}")
