"""Serving: continuous batching over a paged KV cache, with prefix reuse and chunked prefill.

``Engine`` (``engine.py``) runs one compiled step at a time (``step.py``) over the model's one
forward with a ``PagedKVCache`` (``paged_cache.py``), scheduled on the host (``scheduler.py``)
with shared prefix pages (``prefix_cache.py``); with a tokenizer, each event's text delta and
the requests' stop strings come from ``text.py``.
"""

from transformer_jax.serving.engine import Engine
from transformer_jax.serving.page_pool import PagePool
from transformer_jax.serving.paged_cache import PagedKVCache
from transformer_jax.serving.prefix_cache import PrefixCache
from transformer_jax.serving.requests import Completion, SamplingParams, TokenEvent

__all__ = ["Completion", "Engine", "PagePool", "PagedKVCache", "PrefixCache", "SamplingParams",
           "TokenEvent"]
