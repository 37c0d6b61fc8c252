"""The ``deepseek_v3`` family (DeepSeek-V3/R1, Kimi K2): multi-head latent attention
(``model.fields.MLA``) and a sigmoid-scored mixture of experts in the Llama block.

Pure functions, no file I/O. The MLA keys make the ``mla`` table; ``rope_interleave`` is
``rope_pairing="adjacent"`` (transformers de-interleaves q and k alike after rotating, so every
logit is the same); the ``MoE`` table covers the layers from ``first_k_dense_replace`` on
(docs/models.md lists every key), its experts in Qwen2-MoE's layout (``hf.moe.ffn_tensors``).

Attention tensors: ``q_proj`` [N*(nope+P), D] -> [D, N, nope+P], or ``q_a_proj`` [Q, D] ->
[D, Q], ``q_a_layernorm``, ``q_b_proj`` [N*(nope+P), Q] -> [Q, N, nope+P];
``kv_a_proj_with_mqa`` [R+P, D] -> [D, R+P], ``kv_a_layernorm``, ``kv_b_proj`` [N*(nope+V), R]
-> [R, N, nope+V]; ``o_proj`` [D, N*V] -> [N, V, D].

Multi-token prediction module k (``num_nextn_predict_layers`` -> ``mtp_depth``) is HF layer
``L + k - 1`` (its tensors: docs/models.md).
"""

from __future__ import annotations

from collections import ChainMap
from typing import Any

from transformer_jax.hf.families import Family, int_at_least
from transformer_jax.hf.tensors import _heads_in, _heads_out, _linear, _same, _Tensor
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.fields import MLA, MoE

_MLA_KEYS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def _int(hf: ChainMap[str, Any], key: str, low: int) -> int:
    return int_at_least(hf.get(key), key, low)


def _read(hf: ChainMap[str, Any], n_layers: int, max_seq_len: int) -> dict[str, Any]:
    mla = MLA(**{k: hf[k] for k in _MLA_KEYS}, q_lora_rank=hf.get("q_lora_rank"))
    depth = int_at_least(hf.maps[0].get("num_nextn_predict_layers") or 0,
                         "num_nextn_predict_layers", 0)
    return dict(mla=mla, rope_pairing="adjacent" if hf.get("rope_interleave") else "half",
                moe=_moe(hf, n_layers), mtp_depth=depth)


def _moe(hf: ChainMap[str, Any], n_layers: int) -> MoE | None:
    """The ``MoE`` table of layers ``first_k_dense_replace`` on, None when none is sparse."""
    dense = _int(hf, "first_k_dense_replace", 0)
    if not hf.get("n_routed_experts") or dense >= n_layers:
        return None
    e, f = _int(hf, "n_routed_experts", 1), _int(hf, "moe_intermediate_size", 1)
    groups = 1 if hf.get("n_group") is None else _int(hf, "n_group", 1)
    top_groups = groups if hf.get("topk_group") is None else _int(hf, "topk_group", 1)
    renormalize = hf.get("norm_topk_prob")
    if not isinstance(renormalize, bool):
        raise ValueError(f"norm_topk_prob must be a bool, got {renormalize!r}")
    return MoE(n_experts=e, top_k=_int(hf, "num_experts_per_tok", 1), d_ff=f,
               renormalize=renormalize, shared_d_ff=f * _int(hf, "n_shared_experts", 0),
               score="sigmoid", correction_bias=True, n_groups=groups, top_groups=top_groups,
               routed_scale=float(hf["routed_scaling_factor"]),
               dense_layers=tuple(range(dense)))


def _write(c: ModelConfig) -> dict[str, Any]:
    m = c.mla
    out = dict(**{k: getattr(m, k) for k in _MLA_KEYS}, q_lora_rank=m.q_lora_rank,
               rope_interleave=c.rope_pairing == "adjacent", first_k_dense_replace=c.n_layers,
               attention_bias=False, num_nextn_predict_layers=c.mtp_depth)
    e = c.moe
    if e is None:
        return out
    first = len(e.dense_layers)
    if e.dense_layers != tuple(range(first)) or first >= c.n_layers:
        raise ValueError(f"HF deepseek_v3 checkpoints have their dense layers first "
                         f"(first_k_dense_replace) and a sparse one after: moe.dense_layers must "
                         f"be 0..k-1 for some k < {c.n_layers}, got {list(e.dense_layers)}")
    if e.shared_d_ff % e.d_ff:
        raise ValueError(f"HF deepseek_v3 checkpoints' shared expert is n_shared_experts times "
                         f"moe.d_ff ({e.d_ff}) wide: moe.shared_d_ff={e.shared_d_ff} is not a "
                         "multiple")
    return {**out, "first_k_dense_replace": first, "n_routed_experts": e.n_experts,
            "num_experts_per_tok": e.top_k, "moe_intermediate_size": e.d_ff,
            "n_shared_experts": e.shared_d_ff // e.d_ff, "n_group": e.n_groups,
            "topk_group": e.top_groups, "routed_scaling_factor": e.routed_scale,
            "norm_topk_prob": e.renormalize}


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


def mtp_tensors(c: ModelConfig, i: int, ours: tuple[str, ...], block: list[_Tensor]
                ) -> list[_Tensor]:
    """A multi-token prediction module's tensors (HF layer ``i``, params under ``ours``) around
    ``block``, its decoder layer's (``embed_tokens`` is ``load``'s and ``save``'s)."""
    hf, d = f"model.layers.{i}", c.d_model
    return [_same(f"{hf}.enorm.weight", (*ours, "emb_norm", "scale"), (d,)),
            _same(f"{hf}.hnorm.weight", (*ours, "hidden_norm", "scale"), (d,)),
            _linear(f"{hf}.eh_proj.weight", (*ours, "eh_proj"), 2 * d, d), *block,
            _same(f"{hf}.shared_head.norm.weight", (*ours, "head_norm", "scale"), (d,)),
            _linear(f"{hf}.shared_head.head.weight", (*ours, "lm_head"), d, c.vocab_size)]


def mtp_embeddings(c: ModelConfig) -> list[str]:
    """The HF names of the modules' copies of the token table (``embed_tokens``)."""
    return [f"model.layers.{c.n_layers + k}.embed_tokens.weight" for k in range(c.mtp_depth)]


def stored_mtp_depth(config: ModelConfig, names: Any) -> int:
    """The modules a checkpoint holds: ``config.mtp_depth`` when the tensor ``names`` include
    layer L's, else 0 (``save_pretrained`` writes the count but no tensors)."""
    if config.mtp_depth and any(n.startswith(f"model.layers.{config.n_layers}.") for n in names):
        return config.mtp_depth
    return 0


def mtp_modules(config: ModelConfig, names: Any, depth: int | None, path: Any
                ) -> tuple[ModelConfig, set[str]]:
    """The config with the modules ``hf.load`` reads (``depth``: None all it holds, 0 none),
    and the checkpoint's tensor names of those it drops; ValueError for another depth."""
    have = stored_mtp_depth(config, names)
    if depth is not None and depth not in (0, have):
        raise ValueError(f"mtp_depth={depth}: the checkpoint in {path} has {have} multi-token "
                         "prediction modules; load them all (None) or none (0)")
    keep = have if depth is None else depth
    prefixes = tuple(f"model.layers.{config.n_layers + k}." for k in range(keep, have))
    return (config.replace(mtp_depth=keep),
            {n for n in names if n.startswith(prefixes)} if prefixes else set())


DEEPSEEK_V3 = Family(
    "deepseek_v3", "DeepseekV3ForCausalLM", _read, _write,
    fixed={"mla.norm_eps": 1e-6, "moe.score": "sigmoid", "moe.correction_bias": True},
    free=frozenset({"rope_pairing", "mtp_depth", *(f"mla.{k}" for k in (*_MLA_KEYS, "q_lora_rank")),
                    *(f"moe.{k}" for k in ("renormalize", "shared_d_ff", "dense_layers",
                                           "n_groups", "top_groups", "routed_scale"))}),
    activations={"silu": "swiglu"}, rope_kinds=("default", "yarn"),
    defaults=dict(kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
                  qk_nope_head_dim=128, first_k_dense_replace=3, n_routed_experts=256,
                  num_experts_per_tok=8, moe_intermediate_size=2048, n_shared_experts=1,
                  n_group=8, topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True,
                  rope_interleave=True, rms_norm_eps=1e-6),
    optional=frozenset({"moe"}), shared_expert="shared_experts")
