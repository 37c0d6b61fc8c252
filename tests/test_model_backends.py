"""The model with each attention backend and loss path equals the reference one.

``attention_impl="chunked"`` (blockwise, online softmax, memory linear in the context) gives
the einsum reference's logits and parameter gradients on every model variant, with packed
segments and with a KV cache; ``train.loss_chunk`` gives the full loss and its gradients.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FAST_COMPILE, random_params

from transformer_jax.decode import loop as decode
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.kv_cache import KVCache
from transformer_jax.model.ops.layouts import OutFirst
from transformer_jax.model.ops.lm_loss import lm_head_cross_entropy_sums
from transformer_jax.model.transformer import Transformer
from transformer_jax.train.config import TrainConfig
from transformer_jax.train.loss import cross_entropy_sums
from transformer_jax.train.step import make_loss_fn

BASE = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, head_dim=8, d_ff=48,
            max_seq_len=64, init_std=0.2)
# MHA, GQA and MQA themselves are covered op by op in test_attention.py.
VARIANTS = {
    "gqa-scan-remat": dict(n_kv_heads=2, scan_layers=True, remat="full"),
    "window-post-layernorm-bias": dict(n_kv_heads=2, sliding_window=5, norm="layer",
                                       norm_position="post", qkv_bias=True, ffn="gelu"),
    "sinusoidal-geglu-tied": dict(n_kv_heads=1, position="sinusoidal", ffn="geglu",
                                  tie_embeddings=True),
}


def _params(config: ModelConfig) -> dict:
    """Random parameters, every leaf drawn with numpy from the shapes (``helpers.random_params``):
    ``init_params`` op by op would compile a program per op and shape."""
    return jax.device_put(random_params(config))


def _batch(b=2, t=24, vocab=64, seed=0):
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, vocab, (b, t + 1)), jnp.int32)
    # Two packed sequences per row, then padding (segment 0).
    segments = np.zeros((b, t), np.int32)
    segments[:, :10], segments[:, 10:20] = 1, 2
    positions = np.concatenate([np.arange(10), np.arange(10), np.zeros(t - 20)])
    return tokens, jnp.asarray(segments), jnp.broadcast_to(jnp.asarray(positions, jnp.int32),
                                                           (b, t))


@functools.partial(jax.jit, static_argnums=0, compiler_options=FAST_COMPILE)
def _logits_and_grads(config, params, tokens, segments, positions):
    model = Transformer(config)

    def loss(p):
        logits = model.apply({"params": p}, tokens[:, :-1], positions,
                             segment_ids=segments).logits
        weights = (segments != 0).astype(jnp.float32)
        lp = jax.nn.log_softmax(logits)
        nll = -jnp.take_along_axis(lp, tokens[:, 1:, None], axis=-1)[..., 0]
        return jnp.sum(nll * weights) / jnp.sum(weights), logits

    return jax.grad(loss, has_aux=True)(params)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_chunked_attention_model_equals_the_reference(name):
    config = ModelConfig(**BASE, **VARIANTS[name], attention_impl="xla")
    params = _params(config)
    if config.qkv_bias:
        params = jax.tree_util.tree_map_with_path(
            lambda p, x: x + 0.3 if "bias" in jax.tree_util.keystr(p) else x, params)
    tokens, segments, positions = _batch()
    want_grads, want_logits = _logits_and_grads(config, params, tokens, segments, positions)
    got_grads, got_logits = _logits_and_grads(config.replace(attention_impl="chunked"), params,
                                              tokens, segments, positions)
    real = np.asarray(segments) != 0
    np.testing.assert_allclose(np.asarray(got_logits)[real], np.asarray(want_logits)[real],
                               atol=1e-5)
    chex.assert_trees_all_close(got_grads, want_grads, atol=1e-5)


@pytest.mark.parametrize("platform", ["gpu", "cpu"])  # keys [S, H], or [H, S] (SlotsLast)
def test_chunked_attention_over_a_cache_equals_the_reference(platform):
    """Prefill into a partly empty cache, then a chunk of 3 tokens attending over it: the
    logits of the reference's (xla) cacheless forward over all 12 tokens (causal: its first 9
    positions are the prefill's). One reference program for both cache layouts."""
    config = ModelConfig(**BASE, n_kv_heads=2, attention_impl="xla")
    params = _params(config)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 12)), jnp.int32)
    want = _cacheless_logits(config, params, tokens)
    apply = jax.jit(Transformer(config.replace(attention_impl="chunked")).apply)
    cache = KVCache.init(config, 2, 20, platform=platform)
    first = apply({"params": params}, tokens[:, :9], cache=cache)
    second = apply({"params": params}, tokens[:, 9:], cache=first.cache)
    chex.assert_trees_all_close((first.logits, second.logits), (want[:, :9], want[:, 9:]),
                                atol=1e-5)


@functools.partial(jax.jit, static_argnums=0)
def _cacheless_logits(config: ModelConfig, params: dict, tokens: jax.Array) -> jax.Array:
    """[B, T] tokens -> [B, T, V] logits of the whole forward, no cache."""
    return Transformer(config).apply({"params": params}, tokens).logits


@pytest.mark.parametrize("tied", [False, True])
def test_chunked_loss_equals_the_full_loss_and_its_gradients(tied):
    config = ModelConfig(**BASE, n_kv_heads=2, tie_embeddings=tied)
    params = _params(config)
    tokens, _, _ = _batch(t=20, seed=3)
    mask = jnp.asarray(np.random.default_rng(4).random((2, 20)) > 0.3, jnp.float32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask}
    results = {}
    for chunk in (0, 7):  # T = 20: chunks of 7 positions leave a ragged last chunk
        fn = make_loss_fn(config, TrainConfig(loss_chunk=chunk, z_loss=1e-3))
        results[chunk] = jax.jit(jax.value_and_grad(fn, has_aux=True))(params, batch)
    (full, full_aux), full_grads = results[0]
    (chunked, chunked_aux), chunked_grads = results[7]
    np.testing.assert_allclose(chunked, full, rtol=1e-6)
    chex.assert_trees_all_close(chunked_aux, full_aux, rtol=1e-6)
    chex.assert_trees_all_close(chunked_grads, full_grads, atol=1e-5)
    assert float(full_aux[2]) == float(mask.sum())  # masked targets are not counted


@pytest.mark.parametrize("tied", [False, True])
def test_lm_head_of_out_first_weights_gives_the_forwards_logits(tied):
    """``Transformer.lm_head`` gives the head of weights prepared for a CPU target (matrices
    ``OutFirst``): the [V, D] table as an out-first head; the chunked loss over it equals the
    loss of the forward's logits."""
    config = ModelConfig(**BASE, n_kv_heads=2, tie_embeddings=tied)
    params = decode.decode_params(config, _params(config), out_first=True)
    model = Transformer(config)
    tokens, _, _ = _batch(t=20, seed=3)
    head = model.lm_head(params)
    assert isinstance(head, OutFirst) and head.shape == (config.vocab_size, config.d_model)

    @jax.jit
    def losses(params):
        hidden = model.apply({"params": params}, tokens[:, :-1], hidden_only=True).hidden
        chunked = lm_head_cross_entropy_sums(hidden, model.lm_head(params), tokens[:, 1:],
                                             chunk_size=7)
        logits = model.apply({"params": params}, tokens[:, :-1]).logits
        return chunked, cross_entropy_sums(logits, tokens[:, 1:])

    chunked, full = losses(params)
    chex.assert_trees_all_close(chunked, full, rtol=1e-6)
