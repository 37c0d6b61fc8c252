"""transformer_jax: a functional JAX/Flax implementation of the LLaMA-family Transformer.

The packages follow the data flow, each importing only those before it:

    storage -> model -> tokenizer -> data -> parallel -> decode -> hf -> checkpoint -> train
            -> serving -> serve -> evaluate -> bench -> cli

text -> tokens (``tokenizer``, ``data``) -> model (``model``: ``config`` -> ``ops`` -> ``layers``
-> ``transformer``) -> loss/update (``train``); prompt -> prefill -> decode (``decode``) -> text;
requests -> continuous batching over a paged cache (``serving``) -> HTTP (``serve``).
"""

from transformer_jax import _moved
from transformer_jax.decode.generation import GenerateResult, generate
from transformer_jax.model.config import ModelConfig, RopeScaling
from transformer_jax.model.kv_cache import KVCache
from transformer_jax.model.transformer import Transformer, abstract_params, init_params, param_count

_moved.install()

__all__ = ["GenerateResult", "KVCache", "ModelConfig", "RopeScaling", "Transformer",
           "abstract_params", "generate", "init_params", "param_count"]
