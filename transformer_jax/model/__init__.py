"""The model: its configuration, the pure math, the linen modules and the Transformer.

Data flows ``config`` (what the function is) -> ``ops/`` (pure functions) -> ``layers``
(modules owning parameters) -> ``transformer`` (embed -> L blocks -> norm -> LM head), with the
KV cache pytree in ``kv_cache``. ``lora`` and ``quant`` transform the parameters (adapters,
quantised weights); nothing here knows about data, training or serving.
"""

from transformer_jax.model.config import ModelConfig, RopeScaling
from transformer_jax.model.kv_cache import KVCache
from transformer_jax.model.transformer import (
    EMBED,
    Output,
    Params,
    Transformer,
    abstract_params,
    init_params,
    logical_axes,
    param_count,
    stack_blocks,
    unstack_blocks,
)

__all__ = ["EMBED", "KVCache", "ModelConfig", "Output", "Params", "RopeScaling", "Transformer",
           "abstract_params", "init_params", "logical_axes", "param_count", "stack_blocks",
           "unstack_blocks"]
