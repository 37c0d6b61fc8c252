"""Tensor-parallel serving: the engine over a mesh's tensor axis serves what it serves on one
device, each device holding half the kv heads of every page (and of every local layer's ring).

The two-device runs happen in one subprocess (``tests/serving_tp_worker.py``), since this pytest
process keeps its single device.
"""

from __future__ import annotations

import json
from pathlib import Path

import multihost_worker as worker
import numpy as np
import pytest
from serving_tp_worker import CASES

WORKER = Path(__file__).with_name("serving_tp_worker.py")


@pytest.fixture(scope="module")
def runs() -> dict:
    out = worker.run_python([str(WORKER)], n_devices=2, timeout=600)
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("case", tuple(CASES))
def test_tensor_parallel_engine_equals_one_device(runs, case):
    one, two = runs[case]["1"], runs[case]["2"]
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
