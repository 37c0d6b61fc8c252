"""Local (sliding-window) layers keep only their window: rings of W slots in both caches.

Every query's attention through a ring equals textbook attention over its row's last W
positions (numpy) and the full cache's (``window_rings=False``), across several wraps of the
ring, prefill chunks longer than it, decode steps, rows at different positions, a right-padded
prefill, int8 storage and traced layer references (``LayerRef``, as a scanned layer group
gives them); a tiny
patterned model decodes the full forward's logits with rings; a Gemma-3-shaped cache at 32K
takes under a quarter of the bytes; the serving engine on a patterned model gives generate's
tokens.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FAST_COMPILE, numpy_attention, run_until_idle

from transformer_jax.decode import generation
from transformer_jax.decode import loop as decode
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.kv_cache import KVCache, cache_bytes
from transformer_jax.model.stack import LayerRef
from transformer_jax.model.transformer import Transformer, abstract_params, stack_blocks
from transformer_jax.serving import Engine, SamplingParams
from transformer_jax.serving.paged_cache import PagedKVCache, page_bytes, ring_bytes

W = 5  # the window (and ring) of the cache-level tests
B, N, K, H, S_MAX = 2, 4, 2, 8, 44
LAYERS = ModelConfig(vocab_size=16, d_model=16, n_layers=2, n_heads=N, n_kv_heads=K, head_dim=H,
                     d_ff=16, max_seq_len=S_MAX, sliding_window=W,
                     layer_pattern=("local", "global"))
# (each row's first position, chunk length T, each row's real length: ``ring_end`` is set, or
# None): a prefill of 12 (> W) with row 1 right-padded after 7, decode steps, a chunk of 12,
# decode steps: rows at different positions throughout, up to position 41 (the ring wraps 8
# times).
SCHEDULE = [((0, 0), 12, (12, 7)),
            *[((12 + i, 7 + i), 1, None) for i in range(10)],
            ((22, 17), 12, (12, 12)),
            *[((34 + i, 29 + i), 1, None) for i in range(8)]]


@functools.partial(jax.jit, static_argnames="traced", compiler_options=FAST_COMPILE)
def _attend(ring, full, q, k, v, positions, *, traced):
    """Both layers' attention of a chunk with each cache: [2 caches, 2 layers, B, T, N, H] and
    the caches. ``traced``: each layer read by a ``LayerRef`` of traced indices, as a block
    of a scanned layer group reads its cache."""
    outs = []
    for cache in (ring, full):
        per_layer = []
        for layer in range(2):
            i, window = layer, (W if layer == 0 else None)
            if traced:
                zero = 0 * positions[0, 0]  # traced indices
                i = LayerRef(layer + zero, layer == 0, zero)
            out, cache = cache.attend(i, q[layer], k[layer], v[layer], positions, window=window,
                                      impl="xla")
            per_layer.append(out)
        outs.append((jnp.stack(per_layer), cache))
    (ring_out, ring), (full_out, full) = outs
    return jnp.stack([ring_out, full_out]), ring, full


def _caches(paged, scanned, dtype, platform):
    """(the cache with rings, the cache without) for B rows of up to S_MAX positions."""
    config = LAYERS.replace(scan_layers=scanned)
    if not paged:
        return tuple(KVCache.init(config, B, S_MAX, dtype, platform=platform,
                                  window_rings=rings) for rings in (True, False))
    per_row = S_MAX // 4
    table = 1 + np.arange(B * per_row, dtype=np.int32).reshape(B, per_row)
    # The gather view: the global layer's reads are not what this tests (the engine's are).
    caches = tuple(PagedKVCache.init(config, 1 + B * per_row, 4, B, per_row, dtype,
                                     "gather", slots=B, window_rings=rings)
                   .with_table(table, np.zeros(B, np.int32)) for rings in (True, False))
    # Batch row b uses ring row 1 - b.
    return caches[0].replace(ring_rows=jnp.asarray([1, 0], jnp.int32)), caches[1]


# (paged, scanned: stacked layers and a traced index, dtype, the contiguous cache's target
# platform: keys slots last for CPU). The unrolled contiguous cache (for this CPU) decodes the
# patterned model below.
VARIANTS = {
    "contiguous-scanned-int8": (False, True, "int8", "cpu"),
    "paged": (True, False, "float32", None),
    "paged-scanned-int8": (True, True, "int8", None),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_ring_attention_equals_full_cache_and_numpy_at_every_position(name):
    paged, scanned, dtype, platform = VARIANTS[name]
    ring, full = _caches(paged, scanned, dtype, platform)
    assert ring.ring is not None and full.ring is None
    rng = np.random.default_rng(0)
    history = {(layer, b): ({}, {}) for layer in range(2) for b in range(B)}  # position -> k, v
    checked = 0
    for starts, t, real in SCHEDULE:
        positions = np.asarray(starts, np.int32)[:, None] + np.arange(t, dtype=np.int32)
        if real is not None:  # the rings stop at each row's end (a right-padded prefill)
            ring = ring.replace(ring_end=jax.device_put(
                (positions[:, 0] + np.asarray(real)).astype(np.int32)))
        real = np.asarray(real if real is not None else [t] * B)
        q, k, v = (rng.normal(size=(2, B, t, n, H)).astype(np.float32) for n in (N, K, K))
        outs, ring, full = _attend(ring, full, q, k, v, positions, traced=scanned)
        ring = ring.replace(ring_end=None)
        outs = np.asarray(outs)
        for layer in range(2):
            for b in range(B):
                keys, values = history[layer, b]
                for ti in range(real[b]):
                    p = int(positions[b, ti])
                    keys[p], values[p] = k[layer, b, ti], v[layer, b, ti]
                for ti in range(real[b]):
                    p = int(positions[b, ti])
                    seen = range(max(0, p - W + 1) if layer == 0 else 0, p + 1)
                    kk = np.stack([keys[s] for s in seen], 1)[None]  # [1, K, S, H]
                    vv = np.stack([values[s] for s in seen], 1)[None]
                    want = numpy_attention(q[layer, b:b + 1, ti:ti + 1], kk, vv,
                                           np.ones((1, 1, len(seen)), bool))[0, 0]
                    where = f"{name} layer {layer} row {b} position {p}"
                    got_ring, got_full = outs[0, layer, b, ti], outs[1, layer, b, ti]
                    np.testing.assert_allclose(got_ring, got_full, atol=2e-5, err_msg=where)
                    np.testing.assert_allclose(got_ring, want, err_msg=where,
                                               atol=5e-2 if dtype == "int8" else 2e-5)
                    checked += 1
    assert checked == 2 * sum(sum(real or (t, t)) for _, t, real in SCHEDULE)
    # The local layer's rings hold W slots a row, the global layer every position.
    assert ring.nbytes < full.nbytes


PATTERNED = ModelConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2,
                        head_dim=8, d_ff=48, max_seq_len=64, sliding_window=8,
                        layer_pattern=("local", "global"), init_std=0.2)


@functools.partial(jax.jit, static_argnums=(0, 4), compiler_options=FAST_COMPILE)
def _decode_three_ways(config, params, padded, lengths, steps):
    """Greedy decode from right-padded prompts with the rings (``decode.prefill`` /
    ``decode_step``) and with a cache where every layer keeps every position, both fed the
    rings' tokens, and the forward of each whole sequence without a cache: [steps + 1, B, V]
    logits each way (the last at each row's prompt end and after), the rings' cache."""
    weights = decode.decode_params(config, params)
    first, ring = decode.prefill(config, weights, padded, lengths, config.max_seq_len)
    model = decode.decode_model(config)
    full = KVCache.init(config, padded.shape[0], config.max_seq_len, window_rings=False)
    out = model.apply({"params": weights}, padded, cache=full, logits_at=lengths - 1)
    full_first, full = out.logits, out.cache.replace(lengths=lengths)

    def step(carry, _):
        ring, full, logits, positions = carry
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        ring_logits, ring = decode.decode_step(config, weights, ring, tok, positions)
        out = model.apply({"params": weights}, tok[:, None], positions[:, None], cache=full)
        return (ring, out.cache, ring_logits, positions + 1), (ring_logits, out.logits[:, 0],
                                                               tok)

    (ring, *_), (ring_logits, full_logits, tokens) = jax.lax.scan(
        step, (ring, full, first, lengths), None, length=steps)
    # Row b's sequence: its prompt, then its tokens (right-padded).
    j = jnp.arange(padded.shape[1] + steps)
    fed = jnp.take_along_axis(tokens.T, jnp.clip(j - lengths[:, None], 0, steps - 1), axis=1)
    seqs = jnp.where(j < lengths[:, None], jnp.pad(padded, ((0, 0), (0, steps))), fed)
    logits = Transformer(config).apply({"params": params}, seqs).logits
    at = lengths[:, None] - 1 + jnp.arange(steps + 1)
    forward = jnp.take_along_axis(logits, at[:, :, None], axis=1).swapaxes(0, 1)
    return (jnp.concatenate([first[None], ring_logits]),
            jnp.concatenate([full_first[None], full_logits]), forward, ring)


@pytest.fixture(scope="module")
def patterned_params():
    """{scan_layers: parameters} of ``PATTERNED``: the same weights in both layouts."""
    rng = np.random.default_rng(3)  # random weights without compiling the init
    # (numpy casts and one device_put: jnp.asarray's cast compiles a program per shape)
    params = jax.device_put(jax.tree.map(
        lambda x: rng.normal(1.0 if x.ndim == 1 else 0.0, 0.2, x.shape).astype(x.dtype),
        abstract_params(PATTERNED)))
    stack = jax.jit(stack_blocks, static_argnums=1, compiler_options=FAST_COMPILE)  # one program
    return {False: params, True: stack(params, PATTERNED)}


@pytest.mark.parametrize("scanned", [False, True])
def test_patterned_model_decodes_the_full_forward_with_rings(scanned, patterned_params):
    """A 3-layer local/global/local model, ragged prompts (13 and 5 tokens padded to 16), 24 greedy
    steps (the window of 8 wraps several times): the rings' logits equal those of a cache
    holding every position and of the whole sequence's forward without a cache."""
    config, params = PATTERNED.replace(scan_layers=scanned), patterned_params[scanned]
    rng = np.random.default_rng(1)
    lengths = np.asarray([13, 5], np.int32)
    padded = np.zeros((2, 16), np.int32)
    for b, n in enumerate(lengths):
        padded[b, :n] = rng.integers(0, 64, n)
    ring_logits, full_logits, forward, cache = _decode_three_ways(config, params, padded,
                                                                  lengths, 24)
    assert cache.ring is not None and cache.ring.n_local == 2
    np.testing.assert_allclose(ring_logits, full_logits, atol=1e-5)
    np.testing.assert_allclose(ring_logits, forward, atol=1e-4)


def test_gemma3_shaped_cache_bytes_at_32k():
    """5 local (window 1024) : 1 global over 34 layers at 32K positions: the rings take the
    cache to under a quarter of the all-global bytes, as the shapes say; ``cache_bytes`` is what
    ``KVCache.init`` allocates, and the paged cache's pages and rings are what
    ``page_bytes`` and ``ring_bytes`` count."""
    config = ModelConfig(vocab_size=256, d_model=2560, n_layers=34, n_heads=8, n_kv_heads=4,
                         head_dim=256, d_ff=64, max_seq_len=32768, sliding_window=1024,
                         layer_pattern=("local",) * 5 + ("global",), dtype="bfloat16")
    n_global = config.layer_kinds().count("global")
    assert (n_global, config.local_layers) == (5, 29)
    row = 2 * config.n_kv_heads * config.head_dim * 2  # K and V bytes of one position
    want = row * (n_global * 32768 + 29 * 1024)
    assert cache_bytes(config, 1, 32768) == want
    assert cache_bytes(config, 1, 32768, window_rings=False) == row * 34 * 32768
    ratio = want / (row * 34 * 32768)
    assert ratio <= 0.25, ratio
    assert jax.eval_shape(lambda: KVCache.init(config, 1, 32768)).nbytes == want
    paged = jax.eval_shape(lambda: PagedKVCache.init(config, 65, 512, slots=3))
    assert paged.nbytes == 65 * page_bytes(config, 512) + ring_bytes(config, 3)
    assert page_bytes(config, 512) == row * n_global * 512
    assert ring_bytes(config, 3) == row * 29 * 1024 * 3
    # A window that holds every position keeps the full layout.
    assert cache_bytes(config, 1, 1024) == row * 34 * 1024


@pytest.mark.usefixtures("fast_generate_compiles", "fast_engine_compiles")
def test_engine_on_a_patterned_model_equals_generate(patterned_params):
    """A scanned local/global model (window 6) served with a small pool (preemption), chunked
    prompts longer than the window, rows at different positions and a shared prefix: every
    request decodes generate's tokens alone; prefix caching is off and the rings are
    counted."""
    config = PATTERNED.replace(scan_layers=True, sliding_window=6)
    weights = decode.prepare(config, patterned_params[True])
    # Pages of 8, 6 usable (48 positions: the load preempts), one table width, chunks of 16.
    engine = Engine(config, weights, num_slots=3, num_pages=7, page_size=8, token_budget=19,
                    min_context=64)
    assert engine.scheduler.widths == (8,) and engine.scheduler.buckets == (16,)
    assert not engine.scheduler.prefix.enabled
    pages = jax.eval_shape(lambda: PagedKVCache.init(config, 7, 8, window_rings=False)).nbytes
    assert engine.cache_bytes == 7 * page_bytes(config, 8) + ring_bytes(config, 3) < pages
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 64, n).tolist() for n in (37, 4, 11, 23, 2)]
    prompts[3][:24] = prompts[0][:24]  # a shared prefix of 3 pages (no hit: caching is off)
    ids = [engine.add_request(p, SamplingParams(max_tokens=12)) for p in prompts]
    done = run_until_idle(engine)
    assert engine.scheduler.preemptions > 0
    want = generation.generate(config, weights, prompts, max_new_tokens=12).tokens
    assert [done[i].tokens for i in ids] == want
    engine.check_no_leaks()
