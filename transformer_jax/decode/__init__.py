"""Generation: prepared weights -> prefill -> a ``lax.while_loop`` of decode steps -> tokens.

``weights`` (``prepare``: cast, lay out and place the weights once), ``loop`` (prefill and the
decode loop over the KV cache, one traced function), ``sampling`` (greedy, temperature, top-k,
top-p, min-p), ``streaming`` (tokens to a host callback from inside the loop), ``prompts``
(validation, length buckets, padding on the host), ``generation`` (``generate()``, the host
API), ``constrained`` (structured outputs: a host loop over the jitted one-step decode, each row
held to its grammar's token mask) and ``export`` (``jax.export`` of the loop with a symbolic
batch and prompt length).
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
           "decode_context", "decode_model",
           "decode_params", "decode_rules", "decode_step", "generate", "generate_padded",
           "prefill", "prepare", "tensor_shards", "weight_specs"]
