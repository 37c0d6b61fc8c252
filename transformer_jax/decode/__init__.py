"""Generation: prepared weights -> prefill -> a ``lax.while_loop`` of decode steps -> tokens.

``weights`` (``prepare``), ``loop`` (prefill and the decode loop), ``sampling``, ``streaming``,
``prompts`` (host-side validation and padding), ``generation`` (``generate()``), ``constrained``
(structured outputs), ``speculative*`` and ``export`` (``jax.export`` of the loop).
"""

from transformer_jax.decode.constrained import TokenConstraint
from transformer_jax.decode.generation import GenerateResult, generate
from transformer_jax.decode.loop import (
    SamplingSettings,
    SamplingState,
    decode_context,
    decode_model,
    decode_step,
    generate_padded,
    prefill,
)
from transformer_jax.decode.weights import (
    DecodeWeights,
    abstract_weights,
    check_tensor_parallel,
    decode_config,
    decode_params,
    decode_rules,
    prepare,
    tensor_shards,
    weight_specs,
)

__all__ = ["DecodeWeights", "GenerateResult", "SamplingSettings", "SamplingState",
           "TokenConstraint", "abstract_weights", "check_tensor_parallel", "decode_config",
           "decode_context", "decode_model", "decode_params", "decode_rules", "decode_step",
           "generate", "generate_padded", "prefill", "prepare", "tensor_shards", "weight_specs"]
