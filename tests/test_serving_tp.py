"""Tensor-parallel serving: the engine over a mesh's tensor axis serves what it serves on one
device, each device holding half the kv heads of every page.

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
    assert one["preemptions"] > 0  # the small pool preempts, on one device and on two
    # The unrolled case repeats a prompt, which forks from the first's prefill.
    assert one["forked"] == two["forked"] == (1 if case == "unrolled" else 0)
    kv_axis = two["kv_axis"]  # pages [L, K, ...] or [K, ...] per layer (rings [.., S, K, ..])
    assert two["block"][kv_axis] * 2 == two["whole"][kv_axis] == 2
    assert one["block"] == one["whole"]
