"""Decode: cached logits equal a full forward, generate equals a no-cache greedy loop, ragged
batches, buckets without recompiles, stop tokens, seeds, streaming, and every input error."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FAST_COMPILE, TINY, keys_in_order, random_params

from transformer_jax.decode import generation
from transformer_jax.decode import loop as decode
from transformer_jax.decode import prompts as prompt_lib
from transformer_jax.model import kv_cache
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.kv_cache import KVCache
from transformer_jax.model.transformer import Transformer

pytestmark = pytest.mark.usefixtures("fast_generate_compiles")

N_NEW = 8


def _config(**overrides) -> ModelConfig:
    return TINY.replace(**overrides)


_PARAMS: dict = {}


def _model(**overrides):
    """(config, params) of a tiny random model, cached per config: every leaf drawn with numpy
    (``helpers.random_params``), so that no init program compiles (one per config, ~1 s)."""
    config = _config(**overrides)
    if config not in _PARAMS:
        _PARAMS[config] = jax.device_put(random_params(config))
    return config, _PARAMS[config]


def _prompts(lengths, vocab=64, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


@functools.partial(jax.jit, static_argnums=0, compiler_options=FAST_COMPILE)
def _forward(config, params, tokens):
    return Transformer(config).apply({"params": params}, tokens).logits


def _full_logits(config, params, tokens):
    return np.asarray(_forward(config, params, jnp.asarray(tokens, jnp.int32)))


def _greedy_reference(config, params, prompt, n):
    """Greedy decoding with no cache: a full forward over the whole prefix for every token.

    The prefix sits in a fixed-size buffer (one compile); causality makes the logits at its
    last real position those of the prefix alone.
    """
    buf = np.zeros((1, config.max_seq_len), np.int32)
    buf[0, :len(prompt)] = prompt
    length = len(prompt)
    out, logprobs = [], []
    for _ in range(n):
        logits = _full_logits(config, params, buf)[0, length - 1]
        tok = int(np.argmax(logits))
        logprobs.append(float(jax.nn.log_softmax(logits)[tok]))
        out.append(tok)
        buf[0, length] = tok
        length += 1
    return out, logprobs


# Cached decode == full forward -------------------------------------------------------------------

VARIANTS = {
    "mha": dict(n_kv_heads=4),
    "gqa": dict(n_kv_heads=2),
    "mqa": dict(n_kv_heads=1),
    "mha-scan": dict(n_kv_heads=4, scan_layers=True),
    # Scanned layers with 4 and 2 kv heads (the stacked cache's code does not depend on K;
    # one kv head runs unrolled above and in "sinusoidal-geglu-tied").
    "gqa-scan-remat": dict(n_kv_heads=2, scan_layers=True, remat="full"),
    # Every other code path of the decode step at once.
    "post-layernorm-bias-untied-window": dict(
        n_kv_heads=2, norm="layer", norm_position="post", qkv_bias=True, ffn="gelu",
        position="rope", rope_pairing="adjacent", sliding_window=5, tie_embeddings=False),
    "sinusoidal-geglu-tied": dict(n_kv_heads=1, position="sinusoidal", ffn="geglu",
                                  tie_embeddings=True),
}


@functools.partial(jax.jit, static_argnums=(0, 4), compiler_options=FAST_COMPILE)
def _cached_and_full_logits(config, params, seqs, lengths, bucket):
    """Prefill of each row's prompt ``seqs[b, :lengths[b]]`` (right-padded to ``bucket``), then
    decode steps feeding ``seqs`` from each prompt's last token on (re-feeding it rewrites the
    same slot); plus a full forward over ``seqs``."""
    b, total = seqs.shape
    padded = jnp.where(jnp.arange(bucket) < lengths[:, None], seqs[:, :bucket], 0)
    dparams = decode.decode_params(config, params)
    first, cache = decode.prefill(config, dparams, padded, lengths, total)

    def step(cache, i):
        positions = jnp.minimum(lengths - 1 + i, total - 1)
        tokens = seqs[jnp.arange(b), positions]
        logits, cache = decode.decode_step(config, dparams, cache, tokens, positions)
        return cache, logits

    _, logits = jax.lax.scan(step, cache, jnp.arange(total))
    full = Transformer(config).apply({"params": params}, seqs).logits
    return first, jnp.swapaxes(logits, 0, 1), full, cache


@pytest.mark.parametrize("name", list(VARIANTS))
def test_decode_logits_equal_full_forward_at_every_step(name):
    config, params = _model(**VARIANTS[name])
    if config.qkv_bias:  # large enough to matter
        params = jax.tree_util.tree_map_with_path(
            lambda p, x: x + 0.3 if "bias" in jax.tree_util.keystr(p) else x, params)
    total = 14
    seqs = np.asarray(_prompts([total, total], seed=1), np.int32)
    lengths = np.asarray([3, 6], np.int32)  # ragged prompts
    first, got, want, cache = _cached_and_full_logits(config, params, seqs, lengths,
                                                      prompt_lib.prompt_bucket(6))
    rows = (2, config.n_kv_heads)
    keys = (config.head_dim, total) if cache.slots_last else (total, config.head_dim)
    for i in range(config.n_layers):  # stacked [L, ...] when scanned, one array per layer else
        if cache.ring is not None and cache.ring.local[i]:  # a ring of the window's W slots
            w = cache.ring.size
            keys_w = (config.head_dim, w) if cache.slots_last else (w, config.head_dim)
            chex.assert_shape(list(jax.tree.leaves(cache.layer(i))),
                              [(*rows, *keys_w), (*rows, w, config.head_dim)])
            continue
        chex.assert_shape(list(jax.tree.leaves(cache.layer(i))),
                          [(*rows, *keys), (*rows, total, config.head_dim)])
    for b in range(2):
        np.testing.assert_allclose(first[b], want[b, lengths[b] - 1], atol=1e-5,
                                   err_msg=f"prefill logits, row {b}")
        for i in range(total - lengths[b] + 1):  # step i fed position lengths[b] - 1 + i
            pos = lengths[b] - 1 + i
            np.testing.assert_allclose(got[b, i], want[b, pos], atol=1e-5,
                                       err_msg=f"row {b} position {pos}")


@pytest.mark.parametrize("platform", ["gpu", "cpu"])
def test_decode_cache_layout_and_bytes(platform):
    config, params = _model(n_kv_heads=2)
    prefill = functools.partial(decode.prefill, config, max_len=20, platform=platform)
    logits, cache = jax.eval_shape(prefill, decode.decode_params(config, params),
                                   jnp.zeros((3, 8), jnp.int32), jnp.ones((3,), jnp.int32))
    chex.assert_shape(logits, (3, config.vocab_size))
    # One row per (sequence, kv head) in every layer, [B, K, ...]; keys stored [H, S] for a CPU
    # target; one array per layer for this unrolled model.
    assert not cache.stacked and len(jax.tree.leaves(cache.k)) == len(cache.v) == config.n_layers
    assert cache.slots_last == (platform == "cpu")
    chex.assert_shape(list(jax.tree.leaves(cache.k)),
                      [(3, 2, 8, 20) if platform == "cpu" else (3, 2, 20, 8)] * config.n_layers)
    chex.assert_shape(list(cache.v), [(3, 2, 20, 8)] * config.n_layers)
    assert cache.nbytes == 2 * config.n_layers * 3 * 20 * 2 * 8 * 4
    assert cache.nbytes == kv_cache.cache_bytes(config, 3, 20)


@functools.partial(jax.jit, static_argnums=(0, 3), compiler_options=FAST_COMPILE)
def _prefill_both_ways(config, params, tokens, max_len):
    """(decode.prefill on the prepared weights, the model's own forward with a cache of
    ``max_len`` slots on the raw parameters, and layer 0's keys/values computed by hand)."""
    b, t = tokens.shape
    lengths = jnp.full((b,), t, jnp.int32)
    logits, ours = decode.prefill(config, decode.decode_params(config, params), tokens, lengths,
                                  max_len)
    cache = KVCache.init(config, b, max_len)
    out = Transformer(config).apply({"params": params}, tokens, cache=cache)
    return (logits, ours), (out.logits[:, -1], out.cache), _layer0_kv(config, params, tokens)


def _layer0_kv(config, params, tokens):
    """Layer 0's [B, T, K, H] keys (rotated) and values, from the ops alone."""
    from transformer_jax.model import ops

    p = params["blocks"] if config.scan_layers else params["blocks_0"]
    if config.scan_layers:
        p = jax.tree.map(lambda x: x[0], p)
    x = ops.embed(tokens, params["embed"]["embedding"])
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    if config.position == "sinusoidal":
        x = x + ops.sinusoidal_positions(positions, config.d_model)
    if config.norm_position == "pre":
        n = p["attn_norm"]
        x = (ops.rms_norm(x, n["scale"], config.norm_eps) if config.norm == "rms"
             else ops.layer_norm(x, n["scale"], n["bias"], config.norm_eps))
    a = p["attn"]
    k = jnp.einsum("BTD,DKH->BTKH", x, a["k_proj"]) + a.get("k_bias", 0)
    v = jnp.einsum("BTD,DKH->BTKH", x, a["v_proj"]) + a.get("v_bias", 0)
    if config.position == "rope":
        k = ops.apply_rope(k, positions, base=config.rope_base, pairing=config.rope_pairing,
                           scaling=config.rope_scaling)
    return k, v


@pytest.mark.parametrize("name", ["gqa", "mha-scan", "gqa-scan-remat",
                                  "post-layernorm-bias-untied-window", "sinusoidal-geglu-tied"])
def test_prefill_cache_equals_the_models_cached_forward(name):
    """The prefill (decode weights, one pass over the prompts) writes the keys/values that the
    model's own forward with a KVCache writes, in the decode layout; later slots stay zero."""
    config, params = _model(**VARIANTS[name])
    if config.qkv_bias:
        params = jax.tree_util.tree_map_with_path(
            lambda p, x: x + 0.3 if "bias" in jax.tree_util.keystr(p) else x, params)
    tokens = jnp.asarray(_prompts([8, 8, 8], seed=2), jnp.int32)
    (logits, ours), (want_logits, model), (k0, v0) = _prefill_both_ways(config, params, tokens,
                                                                       12)
    chex.assert_trees_all_close(ours.k, model.k, atol=1e-5)
    chex.assert_trees_all_close(ours.v, model.v, atol=1e-5)
    np.testing.assert_allclose(logits, want_logits, atol=1e-5)
    keys, values = ours.layer(0)  # [B, K, S, H] each (keys maybe stored [B, K, H, S])
    keys, values = np.asarray(keys_in_order(keys)), np.asarray(values)
    n, k0, v0 = 8, np.asarray(k0), np.asarray(v0)
    if ours.ring is not None:  # a window's ring of W slots: positions 8 - W .. 7, p in slot p % W
        n, held = ours.ring.size, np.arange(8 - ours.ring.size, 8)
        keys, values = keys[:, :, held % n], values[:, :, held % n]
        k0, v0 = k0[:, held], v0[:, held]
    np.testing.assert_allclose(keys[:, :, :n], k0.transpose(0, 2, 1, 3), atol=1e-5)
    np.testing.assert_allclose(values[:, :, :n], v0.transpose(0, 2, 1, 3), atol=1e-5)
    assert not np.any(values[:, :, n:]) and not np.any(keys[:, :, n:])
    assert np.abs(keys).max() > 0.1  # something was written


def test_prepared_weights_generate_the_greedy_reference_and_check_their_config():
    """Weights prepared once from scanned params give each prompt's no-cache greedy tokens."""
    config, params = _model(n_kv_heads=2, scan_layers=True)
    prompts = _prompts(BATCH_LENGTHS)
    weights = decode.prepare(config, params)
    got = generation.generate(config, weights, prompts, max_new_tokens=N_NEW)
    for i, prompt in enumerate(prompts):
        tokens, logprobs = _greedy_reference(config, params, prompt, N_NEW)
        assert got.tokens[i] == tokens, f"prompt {i}"
        np.testing.assert_allclose(got.logprobs[i], logprobs, atol=1e-5)
    # A parameter transform: the same leaves and sizes (for this CPU target every matrix an
    # OutFirst leaf, stored output axes first), in the compute dtype.
    assert weights.out_first
    assert [x.size for x in jax.tree.leaves(weights.params)] == [
        x.size for x in jax.tree.leaves(params)]
    assert weights.nbytes == sum(x.nbytes for x in jax.tree.leaves(params))
    with pytest.raises(ValueError, match="different config"):
        generation.generate(config.replace(n_kv_heads=4), weights, prompts, max_new_tokens=2)


def test_bfloat16_cache_halves_the_bytes_and_stays_close_to_float32():
    config, params = _model(n_kv_heads=2)
    prefill = functools.partial(decode.prefill, config, max_len=20, dtype="bfloat16")
    _, cache = jax.eval_shape(prefill, decode.decode_params(config, params),
                              jnp.zeros((3, 8), jnp.int32), jnp.ones((3,), jnp.int32))
    assert {x.dtype for x in jax.tree.leaves((cache.k, cache.v))} == {jnp.dtype(jnp.bfloat16)}
    assert cache.nbytes == kv_cache.cache_bytes(config, 3, 20, "bfloat16")
    assert cache.nbytes * 2 == kv_cache.cache_bytes(config, 3, 20)
    prompts = _prompts(BATCH_LENGTHS)
    f32 = generation.generate(config, params, prompts, max_new_tokens=N_NEW)
    bf16 = generation.generate(config, params, prompts, max_new_tokens=N_NEW,
                               cache_dtype="bfloat16")
    # The first token's attention reads the prefill's keys/values back rounded: same token,
    # a close (not equal) logprob.
    np.testing.assert_array_equal(bf16.token_array[:, 0], f32.token_array[:, 0])
    np.testing.assert_allclose(bf16.logprob_array[:, 0], f32.logprob_array[:, 0], atol=5e-2)
    assert not np.array_equal(bf16.logprob_array[:, 0], f32.logprob_array[:, 0])


# generate ----------------------------------------------------------------------------------------

# Most tests below share one compiled program: B=3, a prompt bucket of 16, N_NEW new tokens.
BATCH_LENGTHS = [9, 16, 12]


def test_greedy_generate_equals_no_cache_loop_and_each_prompt_alone():
    config, params = _model(n_kv_heads=2)
    prompts = _prompts(BATCH_LENGTHS)
    batch = generation.generate(config, params, prompts, max_new_tokens=N_NEW)
    for i, prompt in enumerate(prompts):
        tokens, logprobs = _greedy_reference(config, params, prompt, N_NEW)
        assert batch.tokens[i] == tokens, f"prompt {i}"
        np.testing.assert_allclose(batch.logprobs[i], logprobs, atol=1e-5)
        alone = generation.generate(config, params, [prompt], max_new_tokens=N_NEW)
        assert alone.tokens[0] == tokens
    assert batch.lengths == [N_NEW] * 3
    chex.assert_shape(batch.token_array, (3, N_NEW))


def test_prompt_lengths_within_a_bucket_compile_once():
    config, params = _model(n_kv_heads=2)
    assert prompt_lib.prompt_bucket(1) == prompt_lib.prompt_bucket(8) == 8
    assert prompt_lib.prompt_bucket(9) == prompt_lib.prompt_bucket(16) == 16
    assert prompt_lib.prompt_bucket(17) == 32
    assert prompt_lib.prompt_bucket(65) == prompt_lib.prompt_bucket(128) == 128
    assert prompt_lib.prompt_bucket(129) == 192
    generation.generate(config, params, _prompts(BATCH_LENGTHS), max_new_tokens=N_NEW)
    before = decode._generate_jit._cache_size()
    for lengths in ([10, 16, 9], [16, 1, 2], [11, 12, 13]):
        generation.generate(config, params, _prompts(lengths), max_new_tokens=N_NEW)
    assert decode._generate_jit._cache_size() == before
    prompts = _prompts([17, 1, 5])
    out = generation.generate(config, params, prompts, max_new_tokens=N_NEW)
    assert decode._generate_jit._cache_size() == before + 1
    assert out.tokens[1] == _greedy_reference(config, params, prompts[1], N_NEW)[0]


def test_stop_tokens_end_sequences_and_are_included():
    config, params = _model(n_kv_heads=2)
    prompts = _prompts(BATCH_LENGTHS, seed=5)
    free = generation.generate(config, params, prompts, max_new_tokens=N_NEW)
    stop = free.tokens[0][3]  # the 4th token of sequence 0
    out = generation.generate(config, params, prompts, max_new_tokens=N_NEW, stop_tokens=(stop,),
                          pad_id=63)
    for i, seq in enumerate(free.tokens):
        n = seq.index(stop) + 1 if stop in seq else N_NEW
        assert out.tokens[i] == seq[:n]
        assert out.lengths[i] == n
        assert out.token_array[i, n:].tolist() == [63] * (N_NEW - n)
        np.testing.assert_array_equal(out.logprob_array[i, n:], 0.0)
    assert out.lengths[0] <= 4


def test_prompt_filling_the_model_to_max_seq_len():
    config, params = _model(n_kv_heads=2)
    prompt = _prompts([60])[0]
    out = generation.generate(config, params, [prompt], max_new_tokens=4)  # 60 + 4 == max_seq_len
    assert out.tokens == [_greedy_reference(config, params, prompt, 4)[0]]
    assert out.lengths == [4]


def test_sampling_is_reproducible_per_seed_and_per_sequence():
    config, params = _model(n_kv_heads=2)
    prompts = _prompts(BATCH_LENGTHS, seed=7)
    kw = dict(max_new_tokens=N_NEW, temperature=1.0, top_k=40, top_p=0.95, min_p=0.01)
    a = generation.generate(config, params, prompts, seed=1, **kw)
    b = generation.generate(config, params, prompts, seed=1, **kw)
    c = generation.generate(config, params, prompts, seed=2, **kw)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens
    # Per-prompt seeds: a sequence samples the same alone as in a batch.
    batch = generation.generate(config, params, prompts, seed=[11, 12, 13], **kw)
    alone = generation.generate(config, params, [prompts[1]], seed=[12], **kw)
    assert batch.tokens[1] == alone.tokens[0]
    # Each logprob is the model's log-softmax at the chosen token.
    seq = prompts[0] + a.tokens[0]
    # (the greedy reference's program: padded to max_seq_len after the sequence, unseen by
    # its causal logits)
    buf = np.zeros((1, config.max_seq_len), np.int32)
    buf[0, :len(seq)] = seq
    lp = jax.nn.log_softmax(_full_logits(config, params, buf)[0, :len(seq)], -1)
    want = [float(lp[len(prompts[0]) - 1 + i, t]) for i, t in enumerate(a.tokens[0])]
    np.testing.assert_allclose(a.logprobs[0], want, atol=1e-5)


def test_stream_callback_sees_every_step_in_order():
    config, params = _model(n_kv_heads=2)
    prompts = _prompts(BATCH_LENGTHS, seed=9)
    seen = []
    out = generation.generate(config, params, prompts, max_new_tokens=N_NEW,
                          stream=lambda step, tok, active: seen.append((step, tok, active)))
    assert [s for s, _, _ in seen] == list(range(N_NEW))
    streamed = np.stack([tok for _, tok, _ in seen], axis=1)
    np.testing.assert_array_equal(streamed, out.token_array)
    assert all(active.all() for _, _, active in seen)
    # A new callback reuses the compiled program.
    size = decode._generate_jit._cache_size()
    generation.generate(config, params, prompts, max_new_tokens=N_NEW, stream=lambda *a: None)
    assert decode._generate_jit._cache_size() == size


# Errors ------------------------------------------------------------------------------------------

@pytest.fixture
def no_compute(monkeypatch):
    """Fails the test if generate reaches the compiled function."""
    def boom(*args, **kwargs):
        raise AssertionError("validation should have failed before any compute")
    monkeypatch.setattr(decode, "_generate_jit", boom)
    monkeypatch.setattr(decode, "prepare", boom)


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompts=[]), "prompts is empty"),
    (dict(prompts=[[1, 2], []]), "prompt 1 is empty"),
    (dict(prompts=[[1, 64]]), "token id 64 at index 1"),
    (dict(prompts=[[1], [-1]]), "token id -1"),
    (dict(prompts=[[1.5]]), "non-integer"),
    (dict(prompts="hello"), "list of lists"),
    (dict(max_new_tokens=0), "max_new_tokens must be a positive int, got 0"),
    (dict(max_new_tokens=-3), "max_new_tokens"),
    (dict(max_new_tokens=2.0), "max_new_tokens"),
    (dict(prompts=[[1] * 60], max_new_tokens=5), "max_seq_len 64"),
    (dict(prompts=[[1] * 10], max_new_tokens=6, cache_size=15), "cache_size 15"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=0), "top_k"),
    (dict(top_k=65), "top_k"),
    (dict(min_p=-0.1), "min_p"),
    (dict(temperature=-1.0), "temperature"),
    (dict(stop_tokens=(64,)), "stop token 64"),
    (dict(pad_id=-1), "pad_id"),
    (dict(seed=[1, 2, 3]), "seed"),
    (dict(cache_dtype="int16"), "floating dtype or int8, got int16"),
    (dict(cache_dtype="float33"), "not a dtype"),
])
def test_bad_input_raises_before_compute(no_compute, kwargs, match):
    config, params = _model(n_kv_heads=2)
    args = dict(prompts=[[1, 2, 3]], max_new_tokens=4)
    args.update(kwargs)
    prompts = args.pop("prompts")
    with pytest.raises(ValueError, match=match):
        generation.generate(config, params, prompts, **args)


# HuggingFace parity ------------------------------------------------------------------------------

def test_greedy_tokens_equal_huggingface_generate(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = pytest.importorskip("transformer_jax.hf")
    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
        initializer_range=0.2)
    model = transformers.LlamaForCausalLM(hf_config).eval()
    model.save_pretrained(tmp_path)
    config, params = hf.load(tmp_path)
    prompts = _prompts([5, 9], vocab=96, seed=4)
    ours = generation.generate(config, params, prompts, max_new_tokens=12)
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                 pad_token_id=0, eos_token_id=None)
        assert ours.tokens[i] == out[0, len(prompt):].tolist(), f"prompt {i}"


# Program size ------------------------------------------------------------------------------------

def _generate_ops(config) -> int:
    """Operations in the lowered generate program (prefill + decode loop), from abstract inputs."""
    weights = decode.abstract_weights(config)
    args = (weights, jax.ShapeDtypeStruct((2, 8), jnp.int32), jax.ShapeDtypeStruct((2,), jnp.int32),
            jax.ShapeDtypeStruct((2, 2), jnp.uint32))
    fn = jax.jit(decode.generate_padded, static_argnames=decode.GENERATE_STATIC_ARGNAMES)
    text = fn.lower(config, *args, max_new_tokens=4).as_text()
    return sum(" = " in line for line in text.splitlines())


def test_scanned_decode_program_size_is_the_same_at_4_and_32_layers():
    """With scan_layers the prefill and every decode step scan the one block: the program (and
    so its compile time) does not grow with depth. Unrolled, it does (the measure can fail)."""
    scanned = {n: _generate_ops(_config(n_kv_heads=2, scan_layers=True, n_layers=n))
               for n in (4, 32)}
    assert scanned[4] == scanned[32], scanned
    unrolled = {n: _generate_ops(_config(n_kv_heads=2, n_layers=n)) for n in (2, 4)}
    assert unrolled[4] > unrolled[2] * 1.5, unrolled
