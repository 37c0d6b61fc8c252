"""Multi-head latent attention's module (``LatentAttention``): the ``"latent"`` attention kind."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from transformer_jax.model import ops, remat
from transformer_jax.model.fields import MLA
from transformer_jax.model.kv_cache import Cache
from transformer_jax.model.layers import LayerKind, Norm, typed_matrix
from transformer_jax.model.ops import latent_attention
from transformer_jax.model.ops.dense import dense
from transformer_jax.model.stack import LayerRef


class LatentAttention(nn.Module):
    """Multi-head latent attention (``fields.MLA``) with an optional latent cache.

    Parameters (in-first): ``q_proj`` [D, N, nope + P], or with ``q_lora_rank`` Q
    ``q_a_proj`` [D, Q], ``q_a_norm`` and ``q_b_proj`` [Q, N, nope + P]; ``kv_a_proj``
    [D, R + P] (the latent, then the shared rope key), ``kv_a_norm`` [R], ``kv_b_proj``
    [R, N, nope + V] (each head's key columns, then its value columns), ``o_proj`` [N, V, D].
    """

    n_heads: int
    mla: MLA
    scale: float
    rope_pairing: str = "half"
    impl: str = "auto"
    init_std: float = 0.02
    out_init_std: float = 0.02
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    def _norm(self, name: str, x: jax.Array) -> jax.Array:
        return Norm(eps=self.mla.norm_eps, param_dtype=self.param_dtype, name=name)(x)

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array, kind: LayerKind,
                 cache: Cache | None = None, layer: int | LayerRef = 0,
                 segment_ids: jax.Array | None = None) -> tuple[jax.Array, Cache | None]:
        """As ``layers.Attention``: [B, T, D] -> ([B, T, D], the updated cache or None)."""
        m, n, d, std = self.mla, self.n_heads, x.shape[-1], self.init_std
        nope, p, r = m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank
        heads = ("heads", "head_dim")
        if m.q_lora_rank is None:
            q = dense(x, typed_matrix(self, "q_proj", (d, n, nope + p), ("embed", *heads), std),
                      "BTD,DNH->BTNH")
        else:
            qa = typed_matrix(self, "q_a_proj", (d, m.q_lora_rank), ("embed", None), std)
            qb = typed_matrix(self, "q_b_proj", (m.q_lora_rank, n, nope + p),
                              ("latent_rank", *heads), std)
            q = dense(self._norm("q_a_norm", dense(x, qa, "BTD,DQ->BTQ")), qb, "BTQ,QNH->BTNH")
        q = checkpoint_name(q, remat.QUERY)
        kv_a = typed_matrix(self, "kv_a_proj", (d, r + p), ("embed", None), std)
        kv_b = typed_matrix(self, "kv_b_proj", (r, n, nope + m.v_head_dim),
                            ("latent_rank", *heads), std)
        wo = typed_matrix(self, "o_proj", (n, m.v_head_dim, d), (*heads, "embed"),
                          self.out_init_std)
        latent = checkpoint_name(dense(x, kv_a, "BTD,DE->BTE"), remat.KV_LATENT)
        c, k_rope = self._norm("kv_a_norm", latent[..., :r]), latent[..., r:]
        rope = dict(pairing=self.rope_pairing, freqs=kind.freqs, attention_factor=kind.rope_factor)
        q_nope, q_rope = q[..., :nope], ops.apply_rope(q[..., nope:], positions, **rope)
        k_rope = ops.apply_rope(k_rope[:, :, None], positions, **rope)[:, :, 0]
        entries = jnp.concatenate([c.astype(k_rope.dtype), k_rope], -1)  # [B, T, R + P]
        kw = dict(scale=self.scale, impl=self.impl)
        if cache is None:
            out = latent_attention.expanded(q_nope, q_rope, entries, kv_b, q_positions=positions,
                                            k_positions=positions, q_segments=segment_ids,
                                            k_segments=segment_ids, **kw)
        else:
            if segment_ids is not None:
                raise ValueError("segment_ids cannot be combined with a KV cache")
            entries, cache = cache.attend_latent(layer, entries, positions)
            one = isinstance(x.shape[1], int) and x.shape[1] == 1
            attend = latent_attention.absorbed if one else latent_attention.expanded
            out = attend(q_nope, q_rope, entries, kv_b, q_positions=positions, **kw)
        out = checkpoint_name(out.astype(self.dtype), remat.CONTEXT)
        return checkpoint_name(dense(out, wo, "BTNH,NHD->BTD"), remat.OUT), cache
