"""Attention sinks: a learned logit per query head in every softmax's denominator, no value.

Checked against a numpy computation written here (the sink as one more column of the logits,
dropped after the softmax, as the GPT-OSS reference does), in the reference and the chunked
paths (forward and gradients), with windows, packed segments and through the KV cache's full
layers and window rings."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import numpy_attention

from transformer_jax.model.config import ModelConfig
from transformer_jax.model.kv_cache import KVCache
from transformer_jax.model.ops import attention as attn
from transformer_jax.model.ops.chunked_attention import chunked_attention

B, T, N, K, H = 2, 11, 4, 2, 8


def dense_sink_attention(q, k, v, mask, sinks):
    """The same in jnp (for gradients): the sink as a concatenated column."""
    b, t, n, h = q.shape
    g = n // k.shape[1]
    kr, vr = jnp.repeat(k, g, axis=1), jnp.repeat(v, g, axis=1)
    logits = jnp.einsum("btnh,bnsh->bnts", q, kr) / math.sqrt(h)
    logits = jnp.where(mask[:, None], logits, -1e30)
    sink = jnp.broadcast_to(sinks[None, :, None, None], (*logits.shape[:3], 1))
    probs = jax.nn.softmax(jnp.concatenate([logits, sink], -1), -1)[..., :-1]
    probs = jnp.where(mask[:, None], probs, 0.0)
    return jnp.einsum("bnts,bnsh->btnh", probs, vr)


@pytest.fixture(scope="module")
def inputs():
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (B, T, N, H))
    k = jax.random.normal(keys[1], (B, K, T, H))
    v = jax.random.normal(keys[2], (B, K, T, H))
    sinks = jnp.array([-1.0, 0.5, 2.0, 0.0])
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    # Row 1: three padding tokens (segment 0, which sees nothing), then two packed sequences.
    segments = jnp.array([[1] * T, [0, 0, 0] + [1] * 4 + [2] * 4])
    return q, k, v, sinks, positions, segments


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("impl", ["xla", "chunked"])
def test_sinks_match_numpy(inputs, impl, window):
    q, k, v, sinks, positions, segments = inputs
    mask = attn.attention_mask(positions, positions, q_segments=segments, k_segments=segments,
                               window=window)
    kw = dict(q_positions=positions, k_positions=positions, q_segments=segments,
              k_segments=segments, window=window, sinks=sinks)
    if impl == "chunked":  # blocks smaller than T: several blocks, skips, the online sink fold
        got = chunked_attention(q, k, v, block_q=4, block_k=4, **kw)
    else:
        got = attn.attention(q, k, v, impl=impl, **kw)
    q_, k_, v_, mask_, sinks_ = map(np.asarray, (q, k, v, mask, sinks))
    want = numpy_attention(q_, k_, v_, mask_, sinks=sinks_)
    np.testing.assert_allclose(got, want, atol=2e-5)
    # The sink changes the result (it takes mass), and padding stays exactly zero.
    plain = attn.attention(q, k, v, impl="xla", **{**kw, "sinks": None})
    assert float(jnp.abs(got - plain).max()) > 1e-2
    assert float(jnp.abs(got[1, :3]).max()) == 0.0


def test_chunked_sink_gradients(inputs):
    q, k, v, sinks, positions, segments = inputs
    mask = attn.attention_mask(positions, positions, q_segments=segments, k_segments=segments,
                               window=5)
    w = jax.random.normal(jax.random.key(1), (B, T, N, H))

    def loss(fn):
        return lambda q, k, v, s: jnp.sum(w * fn(q, k, v, s))

    chunked = loss(lambda q, k, v, s: chunked_attention(
        q, k, v, q_positions=positions, k_positions=positions, q_segments=segments,
        k_segments=segments, window=5, sinks=s, block_q=4, block_k=4))
    reference = loss(lambda q, k, v, s: attn.attention(
        q, k, v, q_positions=positions, k_positions=positions, q_segments=segments,
        k_segments=segments, window=5, sinks=s, impl="xla"))
    dense = loss(lambda q, k, v, s: dense_sink_attention(q, k, v, mask, s))
    want = jax.grad(dense, argnums=(0, 1, 2, 3))(q, k, v, sinks)
    for fn in (chunked, reference):
        got = jax.grad(fn, argnums=(0, 1, 2, 3))(q, k, v, sinks)
        for g, e in zip(got, want, strict=True):
            np.testing.assert_allclose(g, e, atol=2e-5)
    assert float(jnp.abs(want[3]).min()) > 1e-3  # every sink gets a gradient


@pytest.mark.parametrize("impl", ["cudnn", "pallas", "mosaic"])
def test_kernels_refuse_sinks(inputs, impl):
    q, k, v, sinks, positions, _ = inputs
    with pytest.raises(ValueError, match="no attention sinks"):
        attn.attention(q, k, v, q_positions=positions, impl=impl, sinks=sinks)


@pytest.mark.parametrize("impl", ["xla", "chunked"])
def test_cache_paths_take_sinks(inputs, impl):
    """Prefill then one-token decode through the KV cache (a full layer and a window ring)
    equals the cacheless attention with the same sinks."""
    q, k, v, sinks, positions, _ = inputs
    config = ModelConfig(n_layers=2, n_heads=N, n_kv_heads=K, head_dim=H, d_model=32,
                         sliding_window=4, layer_pattern=("global", "local"))
    qt, kt, vt = q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # k, v as [B, T, K, H]

    @functools.partial(jax.jit, static_argnums=(0, 1))  # one program each, not op by op
    def prefill_then_decode(layer, window, qt, kt, vt, positions, sinks):
        cache = KVCache.init(config, B, 16)
        logits = dict(window=window, impl=impl, sinks=sinks)
        out, cache = cache.attend(layer, qt[:, :-1], kt[:, :-1], vt[:, :-1], positions[:, :-1],
                                  **logits)
        last, _ = cache.attend(layer, qt[:, -1:], kt[:, -1:], vt[:, -1:], positions[:, -1:],
                               **logits)
        return jnp.concatenate([out, last], 1)

    for layer, window in ((0, None), (1, 4)):
        want = attn.attention(q, k, v, q_positions=positions, k_positions=positions,
                              window=window, impl="xla", sinks=sinks)
        got = prefill_then_decode(layer, window, qt, kt, vt, positions, sinks)
        np.testing.assert_allclose(got, want, atol=2e-5)


def test_config_refuses_sinks_with_a_kernel():
    with pytest.raises(ValueError, match="attn_sinks: attention_impl='cudnn' has no"):
        ModelConfig(attn_sinks=True, attention_impl="cudnn")
