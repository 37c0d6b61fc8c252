"""Mixture-of-experts decode and serving: generate (greedy, sampled, ragged) equals a no-cache
greedy loop, ``prepare``'s layout of the ``moe/`` subtree, a decode step that reads only the
chosen experts (float and quantised), quantised experts within their bound, the engine equal
to generate, and LoRA on the experts. (Tensor and expert parallelism: test_decode_tp.py, in its
4-device subprocess.)"""

from __future__ import annotations

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import FAST_COMPILE, TINY, random_params

from transformer_jax.decode import generation
from transformer_jax.decode import loop as decode
from transformer_jax.model import lora
from transformer_jax.model.fields import MoE
from transformer_jax.model.kv_cache import KVCache
from transformer_jax.model.ops import moe as moe_ops
from transformer_jax.model.ops.quantized import PackedInt4, take_rows
from transformer_jax.model.quant import (
    dequantize,
    dequantize_params,
    for_model,
    from_saved,
    parse_quant,
    quantize_params,
)
from transformer_jax.model.transformer import Transformer, abstract_params
from transformer_jax.serving import Engine, SamplingParams

pytestmark = pytest.mark.usefixtures("fast_generate_compiles", "fast_engine_compiles")

E, K, D, F = 5, 2, 32, 24
MOE = TINY.replace(moe=MoE(n_experts=E, top_k=K, d_ff=F, shared_d_ff=16, shared_gate=True))
MIXED = MOE.replace(moe=MoE(n_experts=E, top_k=K, d_ff=F, shared_d_ff=16,
                                         shared_gate=True, dense_layers=(0,)))
PROMPTS = [[5, 9, 2, 7, 1, 33, 8], [3, 3], [60, 1, 2, 4]]
N_NEW = 6


@pytest.fixture(scope="module")
def models():
    # Drawn with numpy (helpers.random_params): no init program compiles (two, 2 s, jitted).
    return {c: jax.device_put(random_params(c, seed=1)) for c in (MOE, MIXED)}


@functools.cache  # one jitted forward (traced, compiled once) per config
def _forward_fn(config):
    return jax.jit(lambda p, t: Transformer(config).apply({"params": p}, t).logits,
                   compiler_options=FAST_COMPILE)


def _greedy_reference(forward, params, prompt, n, width=16):
    """Greedy decoding with no cache: the full forward (the training path's experts) over the
    prefix in a fixed buffer at every token."""
    seq = list(prompt)
    for _ in range(n):
        buf = np.zeros((1, width), np.int32)
        buf[0, :len(seq)] = seq
        seq.append(int(np.argmax(np.asarray(forward(params, buf))[0, len(seq) - 1])))
    return seq[len(prompt):]


@pytest.mark.parametrize("config", [MOE, MIXED], ids=["sparse", "dense_layers"])
def test_greedy_generate_of_ragged_prompts_equals_a_no_cache_loop(models, config):
    # Two rows: N*k = 4 <= E, so the decode steps gather the chosen experts (the reference's
    # full forward takes the grouped path).
    params = models[config]
    got = generation.generate(config, params, PROMPTS[:2], max_new_tokens=N_NEW)
    forward = _forward_fn(config)
    assert got.tokens == [_greedy_reference(forward, params, p, N_NEW) for p in PROMPTS[:2]]


def test_sampling_is_per_sequence_and_batch_independent(models):
    # A row's tokens depend on its prompt and seed only, not on what shares its batch (nor
    # the experts the other rows chose).
    params = models[MOE]
    kw = dict(max_new_tokens=N_NEW, temperature=0.9, top_k=20)
    one = generation.generate(MOE, params, PROMPTS[:2], seed=[4, 7], **kw)
    two = generation.generate(MOE, params, [PROMPTS[0], PROMPTS[2]], seed=[4, 9], **kw)
    assert one.tokens[0] == two.tokens[0]
    assert one.tokens[0] != generation.generate(MOE, params, PROMPTS[:2], seed=[5, 7],
                                                **kw).tokens[0]


def test_prepare_keeps_the_experts_in_first_and_lays_out_the_router(models):
    params = models[MIXED]
    w = decode.prepare(MIXED, params, platform="cpu", experts_split=False).params
    moe, raw = w["blocks_1"]["moe"], params["blocks_1"]["moe"]
    for name in ("gate", "up", "down"):  # [E, D, F] / [E, F, D] as stored: never transposed
        np.testing.assert_array_equal(moe[name], raw[name])
    # The rest are OutFirst leaves for this CPU target, stored transposed.
    np.testing.assert_array_equal(moe["router"].w, raw["router"].T)  # [E, D]
    np.testing.assert_array_equal(moe["shared_gate"].w, raw["shared_gate"].T)
    np.testing.assert_array_equal(moe["shared"]["down"].w, raw["shared"]["down"].T)
    np.testing.assert_array_equal(w["blocks_0"]["mlp"]["down"].w,
                                  params["blocks_0"]["mlp"]["down"].T)
    bf16 = decode.prepare(MIXED.replace(dtype="bfloat16"), params).params["blocks_1"]["moe"]
    assert {x.dtype for n in ("gate", "up", "down") for x in jax.tree.leaves(bf16[n])} | {
        bf16["router"].dtype} == {jnp.dtype("bfloat16")}


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_split_experts_hold_each_expert_and_decode_as_the_stack(models, scan):
    # The CPU default stores each expert apart (ExpertList); the same steps, float and int4,
    # give the stacked layout's logits.
    config = MOE.replace(scan_layers=scan)
    assert decode.prepare(config, models[MOE]).experts_split  # the CPU default
    cache = KVCache.init(config, 2, 16)
    step = jax.jit(lambda p, c: decode.decode_step(config, p, c, jnp.array([1, 2]),
                                                   jnp.array([3, 4]))[0])
    for quant in (None, "int4"):
        split = decode.prepare(config, models[MOE], quant=quant, experts_split=True)
        stack = decode.prepare(config, models[MOE], quant=quant, experts_split=False)
        blocks = split.params["blocks"] if scan else split.params["blocks_0"]
        gate = blocks["moe"]["gate"]
        assert isinstance(gate, moe_ops.ExpertList) and len(gate.experts) == E
        raw = stack.params["blocks"] if scan else stack.params["blocks_0"]
        for e in (0, E - 1):
            for a, b in zip(jax.tree.leaves(gate.experts[e]),
                            jax.tree.leaves(raw["moe"]["gate"]), strict=True):
                np.testing.assert_array_equal(a, b[:, e] if scan else b[e])
        np.testing.assert_allclose(step(split.params, cache), step(stack.params, cache),
                                   atol=2e-6, rtol=1e-5)


def _expert_inputs(jaxpr, shapes, inside=()):
    """(primitive, shape, the containers it sits in) of every equation, nested ones included,
    that takes an array of one of ``shapes`` (expert matrices) as an input."""
    found = []
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            shape = tuple(getattr(v.aval, "shape", ()))
            if shape in shapes:
                found.append((eqn.primitive.name, shape, inside))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _expert_inputs(sub, shapes, inside + (eqn.primitive.name,))
    return found


CONTAINERS = {"pjit", "jit", "closed_call", "while", "cond", "scan", "custom_jvp_call",
              "custom_vjp_call"}


@pytest.mark.parametrize("quant", [None, "int8", "int4", "nf4"])
@pytest.mark.parametrize("split", [False, True], ids=["stacked", "split"])
def test_a_decode_step_reads_only_the_chosen_experts(models, quant, split):
    # B = 2 tokens, k = 2: N*k <= E, so "auto" reads only the chosen experts' matrices (and,
    # when quantised, their bytes and scales before unpacking). Stacked: no op but a gather
    # touches a whole [E, ...] stack, in particular no product over every expert. Split: each
    # expert's arrays are used only inside a switch's branch (run for the pairs that chose it).
    weights = decode.prepare(MOE, models[MOE], quant=quant, experts_split=split)
    cache = KVCache.init(MOE, 2, 16)
    jaxpr = jax.make_jaxpr(lambda p, c: decode.decode_step(
        MOE, p, c, jnp.array([1, 2]), jnp.array([3, 4])))(weights.params, cache).jaxpr
    moe = weights.params["blocks_0"]["moe"]
    if split:
        arrays = {tuple(x.shape) for name in ("gate", "up", "down")  # the values, not the
                  for x in jax.tree.leaves(moe[name]) if min(x.shape) > 1}  # [1, F] scales
        uses = _expert_inputs(jaxpr, arrays)
        outside = [u for u in uses if u[0] not in CONTAINERS and "cond" not in u[2]]
        assert uses and not outside, outside
        assert any("cond" in inside for _, _, inside in uses)
    else:
        stacks = {tuple(x.shape) for name in ("gate", "up", "down")
                  for x in jax.tree.leaves(moe[name]) if x.shape[0] == E}
        uses = _expert_inputs(jaxpr, stacks)
        assert uses and {p for p, _, _ in uses} - CONTAINERS == {"gather"}, uses
    if quant in ("int4", "nf4"):
        gate = moe["gate"].experts[0] if split else moe["gate"]
        assert isinstance(gate, PackedInt4)


def _nf4_half_gap() -> float:
    """Half the widest gap between NF4's 16 levels (in units of the group's absmax)."""
    from qwix._src.core import numerics

    levels = np.sort(np.asarray(numerics.nf4_to_fp(jnp.arange(16, dtype=jnp.uint8))))
    return float(np.max(np.diff(levels))) / 2


@pytest.mark.parametrize("quant", ["int8", "int4", "nf4"])
def test_quantised_experts_are_within_the_bound_and_decode_as_their_dequantised_floats(
        models, quant):
    params = models[MIXED]
    weights = decode.prepare(MIXED, params, quant=quant, experts_split=False)
    moe = weights.params["blocks_1"]["moe"]
    assert not any(hasattr(moe[n], "scale") for n in ("router", "shared_gate"))  # kept float
    for name, axis in (("gate", 1), ("up", 1), ("down", 1)):  # groups along the input axis
        w = np.asarray(params["blocks_1"]["moe"][name])
        q = moe[name]
        scale = np.asarray(q.scale)
        assert scale.shape[0] == E and scale.shape[2] == w.shape[2]  # per expert and channel
        group = w.shape[axis] // scale.shape[axis]
        err = np.abs(np.asarray(dequantize(q)) - w)
        shape = (E, w.shape[1] // group, group, w.shape[2])
        absmax = np.abs(w.reshape(shape)).max(axis=2, keepdims=True)
        step = {"int8": 1 / (2 * 127), "int4": 1 / (2 * 7), "nf4": _nf4_half_gap()}[quant]
        assert np.all(err.reshape(shape) <= absmax * step * (1 + 1e-5) + 1e-7), name
        # A gather of some experts dequantises exactly what the whole stack dequantises.
        ids = jnp.array([[4, 0], [2, 2]])
        np.testing.assert_allclose(take_rows(q, ids), np.asarray(dequantize(q))[np.asarray(ids)],
                                   rtol=0, atol=0)
    if quant != "nf4":  # (one end-to-end decode: int4 stores as nf4 does, int8 as the dense)
        return
    dequantised = decode.DecodeWeights(jax.jit(dequantize_params)(weights.params), MIXED, None,
                                       weights.out_first)
    split = decode.prepare(MIXED, params, quant=quant, experts_split=True)
    got = generation.generate(MIXED, split, PROMPTS[:2], max_new_tokens=N_NEW)  # switched
    want = generation.generate(MIXED, dequantised, PROMPTS[:2], max_new_tokens=N_NEW)
    assert got.tokens == want.tokens
    np.testing.assert_allclose(got.logprob_array, want.logprob_array, atol=1e-5)


def test_the_engine_under_load_equals_generate(models):
    # Against the no-cache greedy loop, which generate equals (the ragged-prompts test above):
    # its one forward program is that test's, where generate of 3 rows would be a new one.
    params = models[MIXED]
    weights = decode.prepare(MIXED, params)
    forward = _forward_fn(MIXED)
    want = [_greedy_reference(forward, params, p, N_NEW) for p in PROMPTS]
    engine = Engine(MIXED, weights, num_slots=2, num_pages=8, page_size=4, token_budget=10)
    ids = [engine.add_request(p, SamplingParams(max_tokens=N_NEW)) for p in PROMPTS * 2]
    done = engine.run_until_idle(max_steps=300)
    engine.check_no_leaks()
    assert [done[i].tokens for i in ids] == want * 2


LORA = lora.LoraConfig(rank=2, alpha=4.0, targets=("q", "down", "experts.gate", "experts.down",
                                                  "shared.up"))


def test_lora_on_the_experts_trains_only_adapters_and_merges_to_the_adapted_forward(models):
    params = models[MIXED]
    # One compiled init of the adapters (op by op, each A's normal compiles apart).
    init = jax.jit(lora.init_adapters, static_argnums=(0, 1), compiler_options=FAST_COMPILE)
    tree = {lora.BASE: params, lora.ADAPTERS: init(MIXED, LORA, params, jax.random.key(2))}
    ad = tree[lora.ADAPTERS]
    assert ad["blocks_1"]["moe"]["gate"]["a"].shape == (E, D, 2)  # one adapter per expert
    assert ad["blocks_1"]["moe"]["down"]["b"].shape == (E, 2, D)
    assert ad["blocks_1"]["moe"]["shared"]["up"]["b"].shape == (2, 16)
    assert "moe" not in ad["blocks_0"] and "mlp" not in ad["blocks_1"]
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 12)), jnp.int32)
    tx = lora.optimizer(optax.adam(1e-2))

    def loss(t):
        logits = Transformer(MIXED).apply({"params": lora.model_params(t, LORA)},
                                          tokens[:, :-1]).logits
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    @jax.jit
    def step(t, opt):
        grads = jax.grad(loss)(t)
        updates, opt = tx.update(grads, opt, t)
        return optax.apply_updates(t, updates), opt

    new, _ = step(tree, tx.init(tree))
    new, _ = step(new, tx.init(new))
    jax.tree.map(np.testing.assert_array_equal, new[lora.BASE], params)  # the base never moves
    moved = jax.tree.map(lambda a, b: not np.array_equal(a, b), new[lora.ADAPTERS], ad)
    assert all(jax.tree.leaves(moved))  # every factor moved (B leaves zero after a step)
    # Jitted: op by op, merging and applying the adapters compile a program per op and shape.
    merged = jax.jit(lambda p, a: lora.merge(p, a, LORA))(params, new[lora.ADAPTERS])
    assert not np.allclose(merged["blocks_1"]["moe"]["gate"], params["blocks_1"]["moe"]["gate"])
    fwd = _forward_fn(MIXED)
    adapted = jax.jit(lambda t: lora.model_params(t, LORA))(new)
    np.testing.assert_allclose(fwd(merged, tokens), fwd(adapted, tokens), atol=1e-5)
    with pytest.raises(ValueError, match="lora target 'experts.gate' adapts moe/gate"):
        lora.init_adapters(TINY, LORA, abstract_params(TINY), jax.random.key(0))  # shapes only


@pytest.mark.parametrize("spec", ["nf4"])
def test_qlora_base_quantises_the_experts_and_is_rebuilt_from_a_checkpoint(models, spec):
    params = models[MIXED]
    quant = for_model(MIXED, parse_quant(spec))
    # One compiled program (op by op, quantising compiles some 200 small ones).
    base = jax.jit(quantize_params, static_argnums=1,
                   compiler_options=FAST_COMPILE)(params, quant)
    gate = base["blocks_1"]["moe"]["gate"]
    assert gate.scale.shape[:1] == (E,) and gate.shape == (E, D, F)
    # As orbax restores it without a target tree: each quantised weight a dict of its arrays.
    plain = jax.tree.map(
        lambda q: ({"packed": q.packed, "scale": q.scale} if isinstance(q, PackedInt4) else
                   {"qvalue": q.qvalue, "scale": q.scale}) if hasattr(q, "scale") else q,
        base, is_leaf=lambda x: hasattr(x, "scale"))
    rebuilt = from_saved(plain, spec)
    for name in ("gate", "down"):
        np.testing.assert_array_equal(dequantize(rebuilt["blocks_1"]["moe"][name]),
                                      dequantize(base["blocks_1"]["moe"][name]))
