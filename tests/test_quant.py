"""Weight-only quantisation (``decode.prepare(..., quant=...)``): quantise -> dequantise error
bounds per scheme, decode over quantised weights equals decode over the same weights
dequantised explicitly, the bytes they take, the serving engine and the errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FAST_COMPILE, TINY, run_until_idle
from hypothesis import given, settings
from hypothesis import strategies as st

from transformer_jax.decode import generation
from transformer_jax.decode import loop as decode
from transformer_jax.model.config import ModelConfig, load_toml
from transformer_jax.model.ops.layouts import OutFirst
from transformer_jax.model.ops.quantized import PackedInt4
from transformer_jax.model.quant import dequantize, dequantize_params, parse_quant, quantize_weight
from transformer_jax.model.transformer import init_params
from transformer_jax.serving import Engine, SamplingParams

pytestmark = pytest.mark.usefixtures("fast_generate_compiles")


# A weight quantised, and dequantised, by one jitted program each: op by op, each weight shape
# compiled every one of their operations apart.
_quantize = jax.jit(quantize_weight, static_argnums=(1, 2), static_argnames="stacked")
_dequantize = jax.jit(dequantize)


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
    w_stored = OutFirst(jnp.asarray(w)) if out_first else jnp.asarray(w)
    q = _quantize(w_stored, "down", quant, stacked=False)
    assert isinstance(q, OutFirst) == out_first  # quantised as stored
    q = q.w if out_first else q
    back = np.asarray(_dequantize(q))
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
                                       None, weights.out_first)
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
    done = run_until_idle(engine)
    want = generation.generate(TINY, weights, prompts, max_new_tokens=6, cache_dtype="int8")
    assert [done[i].tokens for i in ids] == want.tokens
    for rid, logprobs in zip(ids, want.logprobs, strict=True):
        np.testing.assert_allclose(done[rid].logprobs, logprobs, atol=1e-4)
    engine.check_no_leaks()


@pytest.mark.parametrize("quant,message", [
    ("int3", "quant must be one of 'int8', 'int4', 'int4:G', 'nf4' or 'nf4:G', got 'int3'"),
    ("int8:32", "quant int8 takes no group size"),
    ("int4:x", "quant int4:G needs G, the group size, an even integer >= 2"),
    ("int4:3", r"quant int4:G needs G, .* got 'int4:3'"),
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


# Level spacing and scale placement, per scheme (issue 34) ----------------------------------------

# QLoRA's 16 NormalFloat levels over [-1, 1] (appendix E of the paper), and int4's -8..7 over
# qwix's range of +-7.5 steps: the values a group's scale multiplies.
NF4_LEVELS = np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                       -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                       0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
                       0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                       0.7229568362236023, 1.0])
INT4_LEVELS = np.arange(-8, 8) / 7.5
# (name, shape, stacked, the grouped axis: the last input axis, in-first; o_proj's other input
# axis, its heads, shares each scale: a group is G consecutive h of every head).
GROUPED_WEIGHTS = [("down", (16, 3), False, 0, ()), ("o_proj", (2, 16, 5), False, 1, (0,)),
                   ("q_proj", (3, 16, 2, 3), True, 1, ())]


def _magnitudes(rng, shape, axis, block):
    """A scale 10**U(-3, 3) for each run of ``block`` entries along ``axis`` and each entry
    of every other axis: neighbouring groups, channels and layers far apart."""
    coarse = list(shape)
    coarse[axis] //= block
    return np.repeat(10.0 ** rng.uniform(-3, 3, coarse), block, axis=axis)


@pytest.mark.parametrize("scheme", ["int4", "nf4"])
@pytest.mark.parametrize("group", [4, 8])
@pytest.mark.parametrize("name, shape, stacked, axis, shared", GROUPED_WEIGHTS)
def test_4_bit_round_trip_is_within_half_the_widest_level_gap_times_its_groups_scale(
        scheme, group, name, shape, stacked, axis, shared):
    # Each group of G inputs (one output channel, one layer) has its own range, absmax: its
    # values are the levels times absmax, so each is within half the widest gap between
    # adjacent levels times its own group's absmax. Groups of other magnitudes (a wrong group
    # shape, a scale over the wrong axis) break the bound of the small ones.
    rng = np.random.default_rng(group)
    w = (rng.standard_normal(shape) * _magnitudes(rng, shape, axis, group)).astype(np.float32)
    quant = parse_quant(f"{scheme}:{group}")
    q = _quantize(jnp.asarray(w), name, quant, stacked=stacked)
    assert isinstance(q, PackedInt4) and q.packed.size * 2 == w.size
    back = np.moveaxis(np.asarray(_dequantize(q), np.float64), axis, -1)
    x = np.moveaxis(w.astype(np.float64), axis, -1)
    grouped = x.reshape(*x.shape[:-1], -1, group)
    absmax = np.abs(grouped).max(axis=(-1, *shared), keepdims=True)
    levels = NF4_LEVELS if scheme == "nf4" else INT4_LEVELS
    half_gap = np.diff(levels).max() / 2
    err = np.abs(back.reshape(grouped.shape) - grouped)
    # (Plus float32 rounding of x / scale: a few eps of the group's range.)
    assert np.all(err <= (half_gap + 1e-6) * absmax), (err / absmax).max()


@pytest.mark.parametrize("name, shape, stacked, channels", [
    ("q_proj", (8, 2, 4), False, (1, 2)),      # [D, N, H]: a scale per (head, dim)
    ("o_proj", (2, 4, 6), False, (2,)),        # [N, H, D]: a scale per output d
    ("q_proj", (3, 8, 2, 4), True, (0, 2, 3)),  # [L, D, N, H]: and per layer
    ("down", (3, 12, 5), True, (0, 2)),        # [L, F, D]
])
def test_int8_has_one_scale_per_output_channel_and_layer(name, shape, stacked, channels):
    # Output channels (and layers) 10**U(-4, 4) apart: each channel's values, the small ones
    # included, come back within half a step of its own absmax (absmax / 127 / 2), which a
    # scale shared with a larger channel or layer misses by orders of magnitude.
    rng = np.random.default_rng(len(shape))
    spread = np.ones(shape)
    coarse = [n if a in channels else 1 for a, n in enumerate(shape)]
    spread = spread * 10.0 ** rng.uniform(-4, 4, coarse)
    w = (rng.standard_normal(shape) * spread).astype(np.float32)
    q = _quantize(jnp.asarray(w), name, parse_quant("int8"), stacked=stacked)
    assert q.qvalue.dtype == jnp.int8 and q.scale.shape == tuple(coarse)
    inputs = tuple(a for a in range(len(shape)) if a not in channels)
    absmax = np.abs(w.astype(np.float64)).max(axis=inputs, keepdims=True)
    err = np.abs(np.asarray(_dequantize(q), np.float64) - w)
    assert np.all(err <= (0.5 / 127 + 1e-6) * absmax), (err / absmax).max()
