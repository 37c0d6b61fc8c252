"""transformer_jax: a functional JAX/Flax implementation of the LLaMA-family Transformer.

Data flows text -> tokens (``tokenizer``, ``data``) -> model (``ops`` -> ``layers`` -> ``model``)
-> loss/update (``training``); and prompt -> prefill -> decode (``decode``) -> text.
"""

from transformer_jax.config import ModelConfig, RopeScaling
from transformer_jax.generation import GenerateResult, generate
from transformer_jax.kv_cache import KVCache
from transformer_jax.model import Transformer, abstract_params, init_params, param_count

__all__ = [
    "GenerateResult",
    "KVCache",
    "ModelConfig",
    "RopeScaling",
    "Transformer",
    "abstract_params",
    "generate",
    "init_params",
    "param_count",
]
