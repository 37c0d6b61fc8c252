"""Tensor-parallel decode: generate over a mesh's tensor axis equals generate on one device.

The multi-device runs happen in one subprocess with 4 simulated CPU devices
(``tests/decode_tp_worker.py``), since this pytest process keeps its single device.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import multihost_worker as worker
import numpy as np
import pytest
from decode_tp_worker import BASE
from decode_tp_worker import CASES as CASE_SPECS

from transformer_jax import decode
from transformer_jax.config import ModelConfig
from transformer_jax.model import init_params

WORKER = Path(__file__).with_name("decode_tp_worker.py")
CASES = tuple(CASE_SPECS)
OVERRIDES = {name: spec[0] for name, spec in CASE_SPECS.items()}


@pytest.fixture(scope="module")
def runs() -> dict:
    out = worker.run_python([str(WORKER)], n_devices=4, timeout=600)
    return json.loads(out.strip().splitlines()[-1])


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


def test_meshes_that_cannot_split_the_model_are_refused_with_the_reason(runs):
    errors = runs["errors"]
    assert "divisible by 3" in errors["tensor3"] and "n_kv_heads=2" in errors["tensor3"]
    assert "'data': 2" in errors["data2"]
    assert "'tensor' axis" in errors["no_tensor_axis"]
    assert "divisible by 3" in errors["prepare_tensor3"]
    assert "another mesh" in errors["prepared_other_mesh"]


@pytest.mark.parametrize("case", CASES)
def test_prepared_weights_are_split_across_the_mesh(runs, case):
    """prepare(mesh) leaves each device its block: the matrices shrink by T, only the
    embedding, the norms (and a head whose vocabulary T does not divide) stay whole."""
    config = ModelConfig(**{**BASE, **OVERRIDES[case]})
    for key, got in runs[case].items():
        if not key.endswith("-prepared"):
            continue
        t = int(key.split("-")[0])
        whole = 4 * (config.vocab_size * config.d_model + (2 * config.n_layers + 1)
                     * config.d_model * (2 if config.norm == "layer" else 1))
        if config.vocab_size % t:
            whole += 4 * config.vocab_size * config.d_model
        split = got["bytes_total"] - whole
        assert got["bytes_device0"] == whole + split // t, key


def test_tensor_parallel_layout_splits_each_shards_heads_into_one_block():
    """decode_params(T) orders fused rows shard by shard: block j of qkv is shard j's heads."""
    config = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                         head_dim=8, d_ff=48, max_seq_len=32)
    params = init_params(config, jax.random.key(0))
    attn, mlp = params["blocks_0"]["attn"], params["blocks_0"]["mlp"]
    fused = decode.decode_params(config, params, shards=2)["blocks_0"]
    for j in range(2):  # shard j: q heads 2j, 2j+1; kv head j
        block = np.asarray(fused["qkv"]).reshape(2, -1, config.d_model)[j]
        q = np.asarray(attn["q_proj"])[:, 2 * j:2 * j + 2].reshape(config.d_model, -1).T
        k = np.asarray(attn["k_proj"])[:, j].T
        v = np.asarray(attn["v_proj"])[:, j].T
        np.testing.assert_array_equal(block, np.concatenate([q, k, v]))
        inner = np.asarray(fused["inner"]).reshape(2, -1, config.d_model)[j]
        cols = slice(24 * j, 24 * j + 24)
        np.testing.assert_array_equal(inner, np.concatenate([np.asarray(mlp["gate"])[:, cols].T,
                                                             np.asarray(mlp["up"])[:, cols].T]))
