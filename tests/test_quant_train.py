"""Quantised training (``train.quant``, through qwix's QT): the int8 step quantises the weight
products and keeps float32 parameters and no state outside ``TrainState`` (so a run resumes
exactly); the fp8 step lowers for cuda from this CPU and is refused for a CPU run. QLoRA
(``train.lora_base_quant``) keeps the frozen base 4-bit and merges to float for export."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FAST_COMPILE, TINY

from transformer_jax.model import lora
from transformer_jax.model.config import ModelConfig, load_toml
from transformer_jax.model.ops.quantized import PackedInt4
from transformer_jax.model.transformer import abstract_params, param_count
from transformer_jax.train.checks import check_config
from transformer_jax.train.config import TrainConfig
from transformer_jax.train.step import make_init_fn, make_train_step

B, T = 4, 16


def _batch(seed: int) -> dict:
    tokens = np.random.default_rng(seed).integers(0, TINY.vocab_size, (B, T + 1), np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def _steps(quant: str):
    tc = TrainConfig(steps=10, batch_size=B, seq_len=T, warmup_steps=1, quant=quant)
    init = jax.jit(make_init_fn(TINY, tc), compiler_options=FAST_COMPILE)
    step = jax.jit(make_train_step(TINY, tc), compiler_options=FAST_COMPILE)
    return init(jax.random.key(0)), step


def test_int8_training_quantises_the_products_and_resumes_exactly():
    state, step = _steps("int8")
    start = straight = state
    for i in range(3):
        straight, metrics = step(straight, _batch(i))
    # Two steps, the state through the host (as a checkpoint holds it), one more.
    for i in range(2):
        state, _ = step(state, _batch(i))
    state = jax.tree.map(jnp.asarray, jax.device_get(state))
    state, resumed = step(state, _batch(2))
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(straight), strict=True):
        np.testing.assert_array_equal(a, b)
    assert resumed["loss"] == metrics["loss"]
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}
    # The products run on int8 operands (forward and backward): int8 x int8 dots in the step.
    hlo = step.lower(start, _batch(0)).as_text()
    assert len(re.findall(r"dot_general.*tensor<[0-9x]+xi8>, tensor<[0-9x]+xi8>", hlo)) >= 3


def test_fp8_train_step_lowers_for_cuda_and_a_cpu_run_refuses_it():
    tc = TrainConfig(batch_size=B, seq_len=T, quant="fp8")
    state = jax.eval_shape(make_init_fn(TINY, tc), jax.random.key(0))
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _batch(0))
    exported = jax.export.export(jax.jit(make_train_step(TINY, tc)), platforms=("cuda",))(
        state, batch)
    text = exported.mlir_module()
    assert "f8E4M3FN" in text and "f8E5M2" in text  # forward e4m3, gradients e5m2
    with pytest.raises(ValueError, match="train.quant=fp8 needs a GPU or TPU"):
        check_config(TINY, tc, num_devices=1)


@pytest.mark.parametrize("train, message", [
    (dict(quant="int4"), r"quant must be one of \('int8', 'fp8'\) or empty, got 'int4'"),
    (dict(lora_base_quant="nf4"), "quantises a LoRA base: set lora_rank > 0"),
    (dict(lora_rank=2, lora_base_quant="fp4"), "lora_base_quant must be int8, int4, nf4"),
    (dict(lora_rank=2, lora_base_quant="int8", lora_base_dtype="bfloat16"), "set one"),
])
def test_bad_training_quantisation_is_refused_naming_it(train, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**train)


def test_qlora_keeps_the_base_quantised_trains_the_adapters_and_merges_to_float():
    def run(base_quant: str):
        tc = TrainConfig(steps=10, batch_size=B, seq_len=T, warmup_steps=1, lr=1e-2,
                         lora_rank=4, lora_base_quant=base_quant)
        state = jax.jit(make_init_fn(TINY, tc), compiler_options=FAST_COMPILE)(
            jax.random.key(0))
        step = jax.jit(make_train_step(TINY, tc), compiler_options=FAST_COMPILE)
        losses = []
        for _ in range(3):  # the same batch: the loss must fall
            state, metrics = step(state, _batch(0))
            losses.append(float(metrics["loss"]))
        return state, losses, tc

    state, qlora, tc = run("nf4")
    base = state.params[lora.BASE]
    assert isinstance(base["blocks_0"]["mlp"]["up"], PackedInt4)  # 4 bits a value, frozen
    assert qlora[-1] < qlora[0]
    # The export merges the adapters into full-precision weights.
    meta = {"lora": tc.lora_config.to_dict()}
    merged = jax.jit(lambda p: lora.merge_checkpoint_params(p, meta, "here"))(state.params)
    assert {x.dtype for x in jax.tree.leaves(merged)} == {jnp.dtype(jnp.float32)}
    assert jax.tree.structure(merged) == jax.tree.structure(abstract_params(TINY))


def test_a_4_bit_qlora_base_is_under_0_3x_its_bfloat16_size():
    config = ModelConfig.from_dict(load_toml("decode_25m")["model"])
    tc = TrainConfig(lora_rank=8, lora_base_quant="nf4")
    state = jax.eval_shape(make_init_fn(config, tc), jax.random.key(0))
    base_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.params["base"]))
    assert base_bytes <= 0.3 * 2 * param_count(config)
