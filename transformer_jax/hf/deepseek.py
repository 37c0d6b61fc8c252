"""The ``deepseek_v3`` family (DeepSeek-V3/R1, Kimi K2): multi-head latent attention
(``model.fields.MLA``) in the Llama block.

Pure functions, no file I/O. ``config.json`` keys: ``kv_lora_rank``, ``q_lora_rank`` (null:
one ``q_proj``), ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim`` -> the ``mla``
table; ``rope_interleave`` -> ``rope_pairing`` (``"adjacent"``: DeepSeek's interleaved pairs,
which transformers rotates then de-interleaves, q and k alike, so every logit is the same);
YaRN's ``mscale_all_dim`` scales the whole softmax (``MLA.scale``, as transformers'
``yarn_apply_mscale``); the latents' RMSNorms have transformers' fixed epsilon 1e-6.

The mixture-of-experts layers (``first_k_dense_replace`` < ``num_hidden_layers``: grouped
sigmoid routing with a correction bias) are refused in one line until the routing lands; a
checkpoint whose every layer is dense loads and exports.

Tensors (``attention_tensors``): ``self_attn.q_proj`` [N*(nope+P), D] -> ``q_proj`` [D, N,
nope+P], or ``q_a_proj`` [Q, D] -> [D, Q], ``q_a_layernorm`` -> ``q_a_norm``, ``q_b_proj``
[N*(nope+P), Q] -> [Q, N, nope+P]; ``kv_a_proj_with_mqa`` [R+P, D] -> ``kv_a_proj`` [D, R+P],
``kv_a_layernorm`` -> ``kv_a_norm``, ``kv_b_proj`` [N*(nope+V), R] -> [R, N, nope+V];
``o_proj`` [D, N*V] -> [N, V, D].
"""

from __future__ import annotations

from collections import ChainMap
from typing import Any

from transformer_jax.hf.families import Family
from transformer_jax.hf.tensors import _heads_in, _heads_out, _linear, _same, _Tensor
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.fields import MLA

_MLA_KEYS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def _read(hf: ChainMap[str, Any], n_layers: int, max_seq_len: int) -> dict[str, Any]:
    dense = hf.get("first_k_dense_replace")
    experts = hf.get("n_routed_experts")
    if experts and (dense is None or dense < n_layers):
        raise ValueError(f"deepseek_v3 checkpoints with mixture-of-experts layers "
                         f"(first_k_dense_replace={dense} < num_hidden_layers={n_layers}, "
                         f"n_routed_experts={experts}) are not supported yet: only all-dense "
                         "ones load")
    q_rank = hf.get("q_lora_rank")
    mla = MLA(**{k: hf[k] for k in _MLA_KEYS}, q_lora_rank=q_rank)
    interleave = hf.get("rope_interleave")
    return dict(mla=mla, rope_pairing="adjacent" if interleave else "half")


def _write(c: ModelConfig) -> dict[str, Any]:
    m = c.mla
    return dict(**{k: getattr(m, k) for k in _MLA_KEYS}, q_lora_rank=m.q_lora_rank,
                rope_interleave=c.rope_pairing == "adjacent", first_k_dense_replace=c.n_layers,
                attention_bias=False)


def attention_tensors(c: ModelConfig, attn: str, ours: tuple[str, ...]) -> list[_Tensor]:
    """Layer ``ours``'s latent attention tensors, HF module ``attn`` (``...self_attn``)."""
    m, d, n = c.mla, c.d_model, c.n_heads
    qk, r = m.qk_head_dim, m.kv_lora_rank

    def path(*names: str) -> tuple[str, ...]:
        return (*ours, "attn", *names)

    if m.q_lora_rank is None:
        out = [_heads_in(f"{attn}.q_proj.weight", path("q_proj"), d, n, qk)]
    else:
        q = m.q_lora_rank
        out = [_linear(f"{attn}.q_a_proj.weight", path("q_a_proj"), d, q),
               _same(f"{attn}.q_a_layernorm.weight", path("q_a_norm", "scale"), (q,)),
               _heads_in(f"{attn}.q_b_proj.weight", path("q_b_proj"), q, n, qk)]
    return out + [
        _linear(f"{attn}.kv_a_proj_with_mqa.weight", path("kv_a_proj"), d, m.entry_dim),
        _same(f"{attn}.kv_a_layernorm.weight", path("kv_a_norm", "scale"), (r,)),
        _heads_in(f"{attn}.kv_b_proj.weight", path("kv_b_proj"), r, n,
                  m.qk_nope_head_dim + m.v_head_dim),
        _heads_out(f"{attn}.o_proj.weight", path("o_proj"), d, n, m.v_head_dim)]


DEEPSEEK_V3 = Family(
    "deepseek_v3", "DeepseekV3ForCausalLM", _read, _write,
    fixed={"mla.norm_eps": 1e-6},
    free=frozenset({"rope_pairing", *(f"mla.{k}" for k in (*_MLA_KEYS, "q_lora_rank"))}),
    activations={"silu": "swiglu"}, rope_kinds=("default", "yarn"),
    defaults=dict(kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
                  qk_nope_head_dim=128, first_k_dense_replace=3, n_routed_experts=256,
                  rope_interleave=True, rms_norm_eps=1e-6))
