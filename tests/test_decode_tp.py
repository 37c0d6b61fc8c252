"""Tensor-parallel decode: generate over a mesh's tensor axis equals generate on one device; a
mixture-of-experts model's generate and engine over tensor and expert axes equal one device's;
the serving engine over a tensor axis serves what it serves on one device, each device holding
half the kv heads of every page (and of every local layer's ring).

The multi-device runs happen in one subprocess with 4 simulated CPU devices
(``tests/decode_tp_worker.py``, which runs ``moe_tp_worker.py``'s and ``serving_tp_worker.py``'s
too), since this pytest process keeps its single device.
"""

from __future__ import annotations

import json
from pathlib import Path

import multihost_worker as worker
import numpy as np
import pytest
from decode_tp_worker import BASE
from decode_tp_worker import CASES as CASE_SPECS
from moe_tp_worker import CONFIG as MOE_CONFIG
from serving_tp_worker import CASES as SERVING_CASES

from transformer_jax.model.config import ModelConfig

WORKER = Path(__file__).with_name("decode_tp_worker.py")
CASES = tuple(CASE_SPECS)
OVERRIDES = {name: spec[0] for name, spec in CASE_SPECS.items()}


@pytest.fixture(scope="module")
def runs() -> dict:
    out = worker.run_python([str(WORKER)], n_devices=4, timeout=600)
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("quant", ["int8", "int4:8"])
def test_tensor_parallel_quantized_decode_equals_one_device(runs, quant):
    one, two = runs["quantized"][f"{quant}-1"], runs["quantized"][f"{quant}-2"]
    assert two["tokens"] == one["tokens"]
    for a, b in zip(two["logprobs"], one["logprobs"], strict=True):
        np.testing.assert_allclose(a, b, atol=2e-5)


@pytest.mark.parametrize("case", CASES)
def test_tensor_parallel_generate_equals_one_device(runs, case):
    results = runs[case]
    one = results.pop("1")
    assert results, "no tensor-parallel run"
    for tensor, got in results.items():
        assert got["tokens"] == one["tokens"], f"T={tensor}"
        for a, b in zip(got["logprobs"], one["logprobs"], strict=True):
            np.testing.assert_allclose(a, b, atol=2e-5, err_msg=f"T={tensor}")


@pytest.mark.parametrize("case", CASES)
def test_tensor_parallel_stream_calls_back_once_per_step_in_order(runs, case):
    for tensor, got in runs[case].items():
        steps = got["stream"]
        assert [s[0] for s in steps] == list(range(len(steps))), f"T={tensor}"
        # Step i's tokens are column i of the output (while every sequence is active).
        for b, tokens in enumerate(got["tokens"]):
            assert [s[1 + b] for s in steps[:len(tokens)]] == tokens, f"T={tensor} row {b}"


def test_tensor_parallel_program_sums_branches_and_gathers_nothing(runs):
    # The Megatron split, as XLA partitions the jitted program: each layer's attention and FFN
    # outputs are all-reduced, [B, T, D] (2 layers, in prefill and in the decode loop: 4 each
    # at T = 1 and at the prompts' padded length), plus the embedding lookup when the
    # vocabulary is split (once at each). The only all-gathers are of the split logits, [B, V]
    # in prefill and in the loop (``decode.whole_logits``: on a CPU target one gather costs
    # less than sampling's per-row reductions). A partitioner that gathered the activations
    # (q, k, v) or the cache would add all-gathers. Counted in programs that generate ran, of
    # two unrolled 2-layer cases (``COLLECTIVE_CASES``: B = 3 at tensor=2 with the vocabulary
    # split, B = 2 at tensor=4 with it whole).
    found = runs["collectives"]
    for counts in found.values():
        assert counts["all-to-all"] == counts["collective-permute"] == [], found
    d, v = BASE["d_model"], BASE["vocab_size"]
    whole, split = found["whole_vocab"], found["split_vocab"]

    def residual_sums(sizes: list[int], b: int, per_length: int) -> None:
        big = sorted(sizes)
        assert len(big) == 2 * per_length and big[:per_length] == [b * d] * per_length, found
        assert len(set(big[per_length:])) == 1 and big[-1] % (b * d) == 0 and big[-1] > b * d, found

    residual_sums(whole["all-reduce"], 2, 4)
    assert whole["all-gather"] == [], found
    residual_sums(split["all-reduce"], 3, 5)
    assert split["all-gather"] == [3 * v] * 2, found


def test_meshes_that_cannot_split_the_model_are_refused_with_the_reason(runs):
    errors = runs["errors"]
    assert "divisible by 3" in errors["tensor3"] and "n_kv_heads=2" in errors["tensor3"]
    assert "'data': 2" in errors["data2"]
    assert "'tensor' axis" in errors["no_tensor_axis"]
    assert "divisible by 3" in errors["prepare_tensor3"]
    assert "another mesh" in errors["prepared_other_mesh"]


@pytest.mark.parametrize("case", CASES)
def test_prepared_weights_are_split_across_the_mesh(runs, case):
    """prepare(mesh) leaves each device the block the training's logical-axis rules give:
    heads, kv heads, FFN units and the vocabulary split T ways (the vocabulary only when T
    divides it), the norms whole."""
    config = ModelConfig(**{**BASE, **OVERRIDES[case]})
    d, f, v = config.d_model, config.d_ff, config.vocab_size
    h, n, kv = config.head_dim, config.n_heads, config.n_kv_heads
    block_norms = {"pre": 2, "post": 2, "sandwich": 4, "post_branch": 2}[config.norm_position]
    norms = 4 * (block_norms * config.n_layers + 1) * d * (2 if config.norm == "layer" else 1)
    # Per-head QK-norm gains [H] are whole on every device; whole-projection ones [N, H] and
    # [K, H] split with their heads.
    if config.qk_norm == "head":
        norms += 4 * config.n_layers * 2 * h
    ffn_matrices = 3 if config.ffn in ("swiglu", "geglu", "geglu_tanh") else 2
    per_layer = 4 * (d * n * h * 2 + 2 * d * kv * h + ffn_matrices * d * f)
    if config.qk_norm == "full":
        per_layer += 4 * (n + kv) * h
    biases = 4 * config.n_layers * (n + 2 * kv) * h if config.qkv_bias else 0
    vocab = 4 * v * d * (1 if config.tie_embeddings else 2)
    for key, got in runs[case].items():
        if not key.endswith("-prepared"):
            continue
        t = int(key.split("-")[0])
        assert got["bytes_total"] == norms + config.n_layers * per_layer + biases + vocab
        want = norms + (config.n_layers * per_layer + biases) // t + (
            vocab // t if v % t == 0 else vocab)
        assert got["bytes_device0"] == want, key


def test_a_kernel_runs_per_device_over_a_kv_head_split(runs):
    """An attention kernel, which XLA cannot partition, runs under shard_map on each device's
    rows and heads when the context splits the kv heads (here the reference stands in for
    the kernel, a window passed through): the same output as unsplit."""
    got = runs["per_device_attention"]
    assert got["mapped"], got
    assert got["differs_without_window"] > 1e-3  # the window reached the per-device call
    assert got["max_diff"] < 1e-5, got


def test_a_tpu_kernel_runs_per_device_over_batch_and_kv_head_splits(runs):
    """JAX's Pallas TPU flash attention (interpreted), traced for a TPU target with the batch
    split over fsdp=2 and the kv heads over tensor=2: each device runs it on its rows and
    heads, and the output and the gradients of q, k, v are the unsplit reference's."""
    got = runs["per_device_kernel"]
    assert got["mapped"], got
    for name, diff in got["rel_diff"].items():
        assert diff < 1e-5, (name, got)


def test_tensor_and_expert_parallel_moe_decode_and_engine_equal_one_device(runs):
    """A mixture of experts (``moe_tp_worker.py``) generated and served on 1 device, over
    tensor=2, and over expert=2 x tensor=2."""
    runs = runs["moe"]
    d, f = MOE_CONFIG.d_model, MOE_CONFIG.moe.d_ff
    one, two = runs["1"], runs["2"]
    # Each expert's own arrays (the CPU layout) split as a dense FFN's: F over the tensor axis.
    assert two["specs"] == {"gate": "(None, 'tensor')", "up": "(None, 'tensor')",
                            "down": "('tensor', None)", "router": "(None, 'fsdp')"}
    assert two["block"] == [d, f // 2] and one["block"] == [d, f]
    # Over an expert axis the stacks stay whole, E split over it (6 experts: 3 a device).
    assert runs["e2t2"]["specs"]["gate"] == "('expert', None, 'tensor')"
    assert runs["e2t2"]["specs"]["down"] == "('expert', 'tensor', None)"
    assert runs["e2t2"]["block"] == [3, d, f // 2]
    for run in (two, runs["e2t2"]):
        for kind in ("generate", "engine"):
            assert run[kind] == one[kind] == one["generate"]
            for a, b in zip(run[f"{kind}_logprobs"], one[f"{kind}_logprobs"], strict=True):
                np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("case", tuple(SERVING_CASES))
def test_tensor_parallel_engine_equals_one_device(runs, case):
    one, two = runs["serving"][case]["1"], runs["serving"][case]["2"]
    assert two["tokens"] == one["tokens"]
    for a, b in zip(two["logprobs"], one["logprobs"], strict=True):
        np.testing.assert_allclose(a, b, atol=2e-5)
    assert one["preemptions"] == two["preemptions"] > 0  # the small pool preempts, on both
    # The unrolled case repeats a prompt, which forks from the first's prefill.
    assert one["forked"] == two["forked"] == (1 if case == "unrolled" else 0)
    # Pages [L, K, ...] stacked or [K, ...] per layer; the local layers' rings [L, S, K, ...].
    kv_axis = two["kv_axis"]
    stores = [("pages", kv_axis)] + ([("rings", kv_axis + 1)] if case != "unrolled" else [])
    for store, axis in stores:
        assert two[store]["block"][axis] * 2 == two[store]["whole"][axis] == 2, store
        assert one[store]["block"] == one[store]["whole"], store
