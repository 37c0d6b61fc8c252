"""Pure functions with the math of the Transformer: no parameters, no flax, all jittable.

Shape letters: B batch, T query length, S key length, D model width, N query heads, K kv heads,
G query heads per kv head, H head dim, F FFN width, V vocab, L layers.
"""

from transformer_jax.model.ops.attention import (
    attention_mask,
    attention_weights,
    reference_attention,
    softcap,
)
from transformer_jax.model.ops.embedding import embed, tied_logits
from transformer_jax.model.ops.ffn import FFN_FUNCTIONS, geglu, gelu_ffn, relu_ffn, swiglu
from transformer_jax.model.ops.norms import layer_norm, rms_norm
from transformer_jax.model.ops.positions import (
    apply_rope,
    rope_attention_factor,
    rope_frequencies,
    sinusoidal_positions,
)

__all__ = ["FFN_FUNCTIONS", "apply_rope", "attention_mask", "attention_weights", "embed", "geglu",
           "gelu_ffn", "layer_norm", "reference_attention", "relu_ffn", "rms_norm",
           "rope_attention_factor", "rope_frequencies", "sinusoidal_positions", "softcap", "swiglu",
           "tied_logits"]
