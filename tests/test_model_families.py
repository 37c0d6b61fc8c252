"""The architecture fields of the newer families, as model properties (the HF parity tests are
in ``test_hf_families.py``): (1 + w) norms, QK-norm over heads or whole projections (split
over a tensor axis too), embedding scale, final soft-cap, layer patterns that differ in one
scan, and their compile size flat in depth."""

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FAST_COMPILE, jaxpr_equations, random_params

from transformer_jax.model import ops
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.layers import LayerKind
from transformer_jax.model.transformer import (
    Transformer,
    abstract_params,
    init_params,
    stack_blocks,
)

BASE = dict(vocab_size=97, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=64,
            max_seq_len=64)
FAMILIES = {
    "qk_head": dict(qk_norm="head", head_dim=16),
    "sandwich_softcap": dict(norm_position="sandwich", norm_offset=1.0, scale_embeddings=True,
                             ffn="geglu_tanh", attn_softcap=5.0, final_softcap=3.0,
                             attn_scale=0.3, sliding_window=3,
                             layer_pattern=("local", "global"), tie_embeddings=True),
    "five_to_one": dict(norm_position="sandwich", norm_offset=1.0, scale_embeddings=True,
                        qk_norm="head", rope_base=1e6, local_rope_base=1e4, sliding_window=3,
                        layer_pattern=("local", "local", "global"), n_layers=5),
    "post_branch": dict(norm_position="post_branch", qk_norm="full"),
}


def _perturbed(config: ModelConfig, seed: int = 0, scale: float = 1.0):
    """Random params with every gain and bias moved off its initial value (so a norm that
    ignores its gain, or an offset applied twice, shows), times ``scale``: matrices and biases
    N(0, 0.3), gains 1 - norm_offset plus noise. Drawn with numpy from the shapes alone
    (``helpers.random_params``): ``init_params`` op by op compiles a program per op and shape."""
    return jax.device_put(jax.tree.map(lambda x: scale * x, random_params(config, seed, std=0.3)))


# Jitted (one program each): eagerly, the restacking and the forward compile op by op.
_stack = jax.jit(stack_blocks, static_argnums=1, compiler_options=FAST_COMPILE)


@functools.cache
def _forward(config: ModelConfig, hidden_only: bool = False):
    """The model's jitted forward ``(params, tokens) -> output``, one per config (tests of
    the same config and shapes run one compiled program)."""
    return jax.jit(lambda p, t: Transformer(config).apply({"params": p}, t,
                                                          hidden_only=hidden_only),
                   compiler_options=FAST_COMPILE)


@pytest.fixture(scope="module")
def tokens():
    # numpy: eager slices of a device array would compile a program each
    return np.random.default_rng(0).integers(0, 97, (2, 11)).astype(np.int32)


@pytest.fixture(scope="module")
def capped():
    """The soft-capped family's config and params large enough that the final cap binds."""
    config = ModelConfig(**{**BASE, **FAMILIES["sandwich_softcap"]})
    return config, _perturbed(config, scale=20.0)


def test_rms_norm_offset_and_heads_against_numpy():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 3, 4, 8)).astype(np.float32)
    w = rng.normal(size=(4, 8)).astype(np.float32)
    got = ops.rms_norm(jnp.asarray(x), jnp.asarray(w), 1e-6, offset=1.0)
    ms = np.mean(x.reshape(2, 3, 32) ** 2, axis=-1)[..., None, None]
    np.testing.assert_allclose(got, x / np.sqrt(ms + 1e-6) * (1.0 + w), rtol=1e-5, atol=1e-6)
    got = ops.rms_norm(jnp.asarray(x), jnp.asarray(w[0]), 1e-6)
    ms = np.mean(x ** 2, axis=-1, keepdims=True)
    np.testing.assert_allclose(got, x / np.sqrt(ms + 1e-6) * w[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_scanned_equals_unrolled(name, tokens):
    config = ModelConfig(**{**BASE, **FAMILIES[name]})
    params = _perturbed(config)
    def forward(cfg, p):
        return jax.jit(lambda p: Transformer(cfg).apply({"params": p}, tokens).logits)(p)

    want = forward(config, params)
    got = forward(config.replace(scan_layers=True), _stack(params, config))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_scanned_equals_unrolled_gradient(tokens):
    config = ModelConfig(**{**BASE, **FAMILIES["five_to_one"], "n_layers": 3})
    params = _perturbed(config)
    scanned = config.replace(scan_layers=True)

    def loss(cfg, p):
        return jnp.mean(Transformer(cfg).apply({"params": p}, tokens).logits ** 2)

    want, want_grad = jax.jit(jax.value_and_grad(loss, argnums=1), static_argnums=0)(
        config, params)
    got, got_grad = jax.jit(jax.value_and_grad(loss, argnums=1), static_argnums=0)(
        scanned, _stack(params, config))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(_stack(want_grad, config)),
                    jax.tree.leaves(got_grad), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6)


def test_each_layer_attends_by_its_kind(tokens):
    """A patterned model equals the same weights run layer by layer with each layer's own
    window and RoPE base: the pattern repeats, local layers slide, global layers do not."""
    config = ModelConfig(**{**BASE, **FAMILIES["five_to_one"]})
    kinds = [LayerKind.of(config, spec) for spec in config.layer_specs()]
    assert [k.window for k in kinds] == [3, 3, None, 3, 3]
    local = ops.rope_frequencies(config.head_dim, 1e4)
    global_ = ops.rope_frequencies(config.head_dim, 1e6)
    for kind, layer in zip(kinds, config.layer_kinds(), strict=True):
        np.testing.assert_array_equal(kind.freqs, local if layer == "local" else global_)


def test_final_softcap_bounds_the_logits(tokens, capped):
    config, params = capped
    inputs = tokens[:, :-1]  # the evaluation test's forward: one program
    logits = _forward(config)(params, inputs).logits
    raw = np.asarray(_forward(config.replace(final_softcap=None))(params, inputs).logits)
    assert float(np.abs(raw).max()) > 3.0  # the cap binds
    np.testing.assert_allclose(logits, 3.0 * np.tanh(raw / 3.0), rtol=1e-5, atol=1e-5)


def test_embedding_scale_is_sqrt_d_in_the_compute_dtype():
    config = ModelConfig(**{**BASE, "scale_embeddings": True, "n_layers": 1})
    params = _perturbed(config)
    tokens = jnp.asarray([[3, 5]])
    with_scale = _forward(config, hidden_only=True)(params, tokens)
    # Zero layers' worth of blocks is not a config, so compare the embedding scale through a
    # model whose block sees sqrt(D) * e: the same model with the table pre-scaled.
    scaled = dict(params, embed={"embedding": params["embed"]["embedding"] * 32 ** 0.5})
    without = _forward(config.replace(scale_embeddings=False), hidden_only=True)(scaled, tokens)
    np.testing.assert_allclose(with_scale.hidden, without.hidden, rtol=1e-5, atol=1e-6)


def test_a_patterned_scanned_model_traces_to_the_same_program_at_any_depth():
    """Compile time flat in depth: the scanned program of a 5:1 model (one layer group, its
    period of six blocks scanned) is the same size at 12 layers as at 18 and 48 (only the
    scan's length and the stacked shapes change)."""
    def program(n_layers: int) -> int:
        config = ModelConfig(**{**BASE, **FAMILIES["five_to_one"], "n_layers": n_layers,
                                "layer_pattern": ("local",) * 5 + ("global",),
                                "scan_layers": True})
        # The scanned layout as the scanned model initialises to it (test_model's
        # test_scanned_stack_equals_unrolled), traced once, not the unrolled init of every layer.
        params = abstract_params(config)
        tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
        return jaxpr_equations(jax.make_jaxpr(
            lambda p, t: Transformer(config).apply({"params": p}, t).logits)(params, tokens).jaxpr)

    at_12 = program(12)
    assert program(18) == at_12 and program(48) == at_12


@pytest.mark.parametrize("changes, match", [
    (dict(layer_pattern=("local", "global")), "sliding_window"),
    (dict(layer_pattern=("local", "sideways"), sliding_window=4), "layer_pattern"),
    (dict(qk_norm="rms"), "qk_norm"),
    (dict(attn_softcap=0.0), "attn_softcap"),
    (dict(final_softcap=-1.0), "final_softcap"),
    (dict(norm_position="middle"), "norm_position"),
    (dict(local_rope_base=1e4, position="none"), "local_rope_base"),
    (dict(attn_softcap=50.0, attention_impl="cudnn"), "attn_softcap.*cudnn"),
])
def test_bad_architecture_fields_are_refused_by_name(changes, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**{**BASE, **changes})


def _greedy_without_cache(forward, prompt: list[int], n: int, width: int) -> list[int]:
    """Greedy tokens by running the whole sequence through the forward at every step (padded
    at the end to one length: causal attention keeps the padding out of earlier positions)."""
    tokens = list(prompt)
    for _ in range(n):
        logits = np.asarray(forward(np.asarray([tokens + [0] * (width - len(tokens))])))
        # numpy: an eager index of the device array would compile a program per position
        tokens.append(int(np.argmax(logits[0, len(tokens) - 1])))
    return tokens[len(prompt):]


GENERATE_CONFIG = ModelConfig(**{**BASE, **FAMILIES["five_to_one"], "attn_softcap": 4.0,
                                 "final_softcap": 6.0})
PROMPTS = [[5, 9, 2, 7, 1, 3, 8], [4, 6]]


@pytest.fixture(scope="module")
def cacheless():
    params = _perturbed(GENERATE_CONFIG)
    forward = jax.jit(lambda t: Transformer(GENERATE_CONFIG).apply({"params": params}, t).logits)
    width = max(map(len, PROMPTS)) + 6
    return params, [_greedy_without_cache(forward, p, 6, width) for p in PROMPTS]


@pytest.mark.parametrize("scan", [False, True])
def test_generate_on_layers_that_differ_equals_the_cacheless_forward(scan, cacheless,
                                                                     fast_generate_compiles):
    """The decode loop (prefill, then one token per step through the cache) gives the tokens
    of recomputing every prefix without a cache, past the window, on ragged prompts."""
    from transformer_jax.decode.generation import generate

    params, want = cacheless
    config = GENERATE_CONFIG.replace(scan_layers=scan)
    got = generate(config, _stack(params, config) if scan else params, PROMPTS,
                   max_new_tokens=6, cache_size=24).tokens
    assert [list(map(int, g)) for g in got] == want


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantized_decode_of_layers_that_differ_equals_decode_over_dequantised_weights(
        quant, cacheless, fast_generate_compiles):
    """Weight-only quantisation of a patterned model with QK-norm: its gains stay float and
    the decode equals the float decode over the same weights dequantised explicitly."""
    from transformer_jax.decode import loop as decode
    from transformer_jax.decode.generation import generate
    from transformer_jax.model.quant import dequantize_params

    params, _ = cacheless
    config = GENERATE_CONFIG.replace(scan_layers=True)
    weights = decode.prepare(config, params, quant=quant)
    norm = weights.params["scan_0"]["attn"]["q_norm"]["scale"]  # layers 0 and 1 (local)
    assert norm.dtype == jnp.float32 and norm.shape == (2, config.head_dim)
    dequantised = decode.DecodeWeights(jax.jit(dequantize_params)(weights.params), config,
                                       None, weights.out_first)
    # The cache size of the float decode above: its program decodes the dequantised weights.
    got = generate(config, weights, PROMPTS, max_new_tokens=6, cache_size=24)
    want = generate(config, dequantised, PROMPTS, max_new_tokens=6, cache_size=24)
    assert got.tokens == want.tokens
    np.testing.assert_allclose(got.logprob_array, want.logprob_array, atol=1e-5)


def test_evaluation_scores_are_the_capped_forwards_log_probabilities(tokens, capped):
    """The harness's token scores (LM head per row, as ``hidden_only`` gives) apply the
    final soft-cap as the forward does."""
    from transformer_jax.evaluate.scoring import token_scores

    config, params = capped
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    positions = np.broadcast_to(np.arange(inputs.shape[1], dtype=np.int32), inputs.shape)
    logprob, _ = jax.jit(lambda p, i, t, pos, m: token_scores(Transformer(config), p, i, t,
                                                              pos, m),
                         compiler_options=FAST_COMPILE)(params, inputs, targets, positions,
                                                        np.ones_like(inputs))
    # The forward's log-probabilities of the targets, in numpy (float64).
    logits = np.asarray(_forward(config)(params, inputs).logits, np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    log_softmax = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    want = np.take_along_axis(log_softmax, targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(logprob, want, rtol=1e-5, atol=1e-5)


def _norm_gains(params) -> list:
    return [x for path, x in jax.tree_util.tree_leaves_with_path(params)
            if "norm" in jax.tree_util.keystr(path)]


def test_norm_gains_start_at_an_effective_one_whatever_the_offset():
    offsets = (0.0, 1.0)
    configs = [ModelConfig(**{**BASE, **FAMILIES["five_to_one"], "norm_offset": offset})
               for offset in offsets]
    # Both inits in one jitted program (op by op, the init compiles a program per op and
    # shape) that returns the gains only: XLA drops the random matrices nobody reads.
    gains = jax.jit(lambda: [_norm_gains(init_params(c, 0)) for c in configs])()
    for offset, config, config_gains in zip(offsets, configs, gains, strict=True):
        assert len(config_gains) == 4 * config.n_layers + 2 * config.n_layers + 1  # + q/k norms
        for g in config_gains:
            np.testing.assert_array_equal(g + offset, 1.0)
