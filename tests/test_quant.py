"""Weight-only quantisation (``decode.prepare(..., quant=...)``): quantise -> dequantise error
bounds per scheme, decode over quantised weights equals decode over the same weights
dequantised explicitly, the bytes they take, the serving engine and the errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FAST_COMPILE, TINY
from hypothesis import given, settings
from hypothesis import strategies as st

from transformer_jax.decode import generation
from transformer_jax.decode import loop as decode
from transformer_jax.model.config import ModelConfig, load_toml
from transformer_jax.model.ops.quantized import PackedInt4
from transformer_jax.model.quant import dequantize, dequantize_params, parse_quant, quantize_weight
from transformer_jax.model.transformer import init_params
from transformer_jax.serving import Engine, SamplingParams

pytestmark = pytest.mark.usefixtures("fast_generate_compiles")


@pytest.fixture(scope="module")
def params():
    init = jax.jit(init_params, static_argnums=0, compiler_options=FAST_COMPILE)
    return init(TINY, jax.random.key(0))


@settings(max_examples=4, deadline=None)
@given(scheme=st.sampled_from(["int8", "int4:4", "int4:8"]), rows=st.sampled_from([8, 16]),
       cols=st.sampled_from([3, 5]), log_range=st.floats(-3, 3), out_first=st.booleans(),
       seed=st.integers(0, 2**16))
def test_dequantised_weight_is_within_half_a_step_of_its_group(scheme, rows, cols, log_range,
                                                               out_first, seed):
    # A down-projection [F, D] (in-first) or [D, F] (out-first): the scale is shared by an
    # output channel's inputs (int8) or by G consecutive of them (int4), so each value is
    # within half a step, absmax / (2 * qmax), of its own group's absmax.
    quant = parse_quant(scheme)
    w = np.random.default_rng(seed).standard_normal((rows, cols)) * 10.0 ** log_range
    w = (w.T if out_first else w).astype(np.float32)
    q = quantize_weight(jnp.asarray(w), "down", quant, stacked=False, out_first=out_first)
    back = np.asarray(dequantize(q))
    groups = rows if quant.group_size is None else quant.group_size
    qmax = 127 if quant.scheme == "int8" else 7
    w_in = w.T if out_first else w  # [F, D]: groups along F
    err = np.abs(back.T - w_in) if out_first else np.abs(back - w_in)
    absmax = np.abs(w_in.reshape(rows // groups, groups, cols)).max(axis=1, keepdims=True)
    bound = np.broadcast_to(absmax / (2 * qmax), (rows // groups, groups, cols))
    assert np.all(err <= bound.reshape(rows, cols) * (1 + 1e-5) + 1e-30)
    if quant.scheme == "int4":
        assert isinstance(q, PackedInt4) and q.packed.dtype == jnp.uint8
        assert q.packed.size * 2 == w.size  # two values a byte
        assert q.shape == w.shape


@pytest.mark.parametrize("quant,tied", [("int8", False), ("int4", True)])
def test_quantized_decode_equals_float_decode_over_the_dequantised_weights(params, quant,
                                                                            tied):
    # (A scanned layout, each layer its own scales, is in test_decode_tp's quantised cases.)
    config = TINY.replace(tie_embeddings=tied)
    p = {k: v for k, v in params.items() if not (tied and k == "lm_head")}
    weights = decode.prepare(config, p, quant=quant)
    # int4's groups, per matrix: the largest power of two up to 64 dividing its input width
    # (D = 32 for the projections in and the table, H = 8 for o_proj, F = 48 for down).
    want = {"q_proj": 32, "o_proj": 8, "down": 16, "embedding": 32} if quant == "int4" else {}
    assert {name: weights.quant.group_for(name) for name in want} == want
    dequantised = decode.DecodeWeights(jax.jit(dequantize_params)(weights.params), config,
                                       None, weights.weights_out_first)
    prompts = [[5, 9, 2, 7, 1], [3, 3]]
    got = generation.generate(config, weights, prompts, max_new_tokens=8)
    want = generation.generate(config, dequantised, prompts, max_new_tokens=8)
    assert got.tokens == want.tokens
    np.testing.assert_allclose(got.logprob_array, want.logprob_array, atol=1e-5)
    # Quantisation changed the weights (the comparison is not float against float).
    flat = jax.tree.leaves(decode.prepare(config, p).params)
    assert any(not np.array_equal(a, b) for a, b in
               zip(flat, jax.tree.leaves(dequantised.params), strict=True))


def test_prepared_weights_hold_quantised_values_and_scales_only():
    # decode_25m's shapes, from eval_shape alone: int8 at most 0.27x float32's bytes with the
    # scales, int4 (packed, scales per 64 inputs) at most 0.15x; norms stay float32.
    config = ModelConfig.from_dict(load_toml("decode_25m")["model"])
    float_bytes = decode.abstract_weights(config).nbytes
    for quant, most in (("int8", 0.27), ("int4", 0.15)):
        weights = decode.abstract_weights(config, quant=quant)
        dtypes = {x.dtype for x in jax.tree.leaves(weights.params)}
        assert dtypes == {jnp.dtype(jnp.int8 if quant == "int8" else jnp.uint8),
                          jnp.dtype(jnp.float32)}
        assert weights.nbytes / float_bytes <= most, (quant, weights.nbytes / float_bytes)
    # An FFN width that 64 does not divide (F = 688 = 16 x 43) makes only down's groups smaller.
    odd = config.replace(d_ff=688)
    per_matrix = decode.abstract_weights(odd, quant="int4")
    assert dict(per_matrix.quant.groups)["down"] == 16
    assert {g for n, g in per_matrix.quant.groups if n != "down"} == {64}
    ratio = per_matrix.nbytes / decode.abstract_weights(odd).nbytes
    assert ratio <= 0.15 < decode.abstract_weights(odd, quant="int4:16").nbytes / \
        decode.abstract_weights(odd).nbytes, ratio


def test_engine_serves_quantised_weights_and_int8_pages_as_generate_does(params):
    # int8 weights and an int8 cache: the engine's paged one and generate's contiguous one.
    weights = decode.prepare(TINY, params, quant="int8")
    engine = Engine(TINY, params, num_slots=2, num_pages=9, page_size=4, token_budget=10,
                    quant="int8", cache_dtype="int8")
    assert engine.weights.quant.name == "int8"
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8]]
    ids = [engine.add_request(p, SamplingParams(max_tokens=6)) for p in prompts]
    done = engine.run_until_idle()
    want = generation.generate(TINY, weights, prompts, max_new_tokens=6, cache_dtype="int8")
    assert [done[i].tokens for i in ids] == want.tokens
    for rid, logprobs in zip(ids, want.logprobs, strict=True):
        np.testing.assert_allclose(done[rid].logprobs, logprobs, atol=1e-4)
    engine.check_no_leaks()


@pytest.mark.parametrize("quant,message", [
    ("int3", "quant must be one of 'int8', 'int4', 'int4:G', 'nf4' or 'nf4:G', got 'int3'"),
    ("int8:32", "quant int8 takes no group size"),
    ("int4:x", "quant int4 group size must be an int, got 'int4:x'"),
    ("int4:3", "group_size must be an even int >= 2"),
    ("int4:16", r"group_size=16 does not divide the input width of o_proj \(8\)"),
    (8, "quant must be a string"),
])
def test_bad_schemes_and_group_sizes_are_refused_naming_them(params, quant, message):
    with pytest.raises(ValueError, match=message):
        decode.prepare(TINY, params, quant=quant)


def test_weights_prepared_otherwise_than_asked_are_refused(params):
    with pytest.raises(ValueError, match="are float, not quant='int8'"):
        generation.generate(TINY, decode.prepare(TINY, params), [[1]], max_new_tokens=2,
                            quant="int8")


def test_forced_agreement_of_float_with_its_own_greedy_continuation_is_one(params):
    # bench quant's per-token measure reads the logits one position before each token: float
    # weights agree with their own greedy tokens everywhere; a changed last token (never an
    # input) is the one position that disagrees.
    from transformer_jax.bench.quant import forced_agreement

    weights = decode.prepare(TINY, params)
    prompts = [[5, 9, 2, 7], [3, 3, 1, 4]]
    reference = generation.generate(TINY, weights, prompts, max_new_tokens=8).token_array
    assert forced_agreement(weights, prompts, reference) == 1.0
    changed = reference.copy()
    changed[:, -1] = (changed[:, -1] + 1) % TINY.vocab_size
    assert forced_agreement(weights, prompts, changed) == 1.0 - 1 / reference.shape[1]
