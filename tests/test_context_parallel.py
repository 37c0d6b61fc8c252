"""Context parallelism: the ``context`` mesh axis splits every training sequence, attention
gathers keys and values over it, and the batch is permuted for causal load balance
(``parallel.context``, ``model.ops.context_attention``).

The multi-device claim (context=4 and context=2 x fsdp=2 give the loss and gradients of one
device, with packed segments and a sliding-window layer) runs in ONE subprocess with 4
simulated CPU devices (``tests/context_parallel_worker.py``); the rest runs here.
"""

from __future__ import annotations

import json

import context_parallel_worker as cp
import jax
import jax.numpy as jnp
import multihost_worker as worker
import numpy as np
import pytest

from transformer_jax.model.config import ModelConfig
from transformer_jax.model.ops.attention import attention_mask, reference_attention
from transformer_jax.model.ops.chunked_attention import chunked_attention
from transformer_jax.parallel import sharding as sh
from transformer_jax.parallel.context import balanced_order
from transformer_jax.train.checks import check_context
from transformer_jax.train.config import TrainConfig


@pytest.fixture(scope="module")
def run() -> dict:
    out = worker.run_python(["tests/context_parallel_worker.py"], n_devices=4, timeout=600)
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(cp.MESHES))
def test_context_parallel_loss_and_gradients_equal_one_device(run, name):
    got = run["meshes"][name]
    assert got["mesh"]["context"] == cp.MESHES[name][0].context
    assert got["batch_spec"] == [["data", "fsdp"], "context"]  # T split over context
    assert got["count"] == got["ref_count"]
    assert abs(got["loss"] - got["ref_loss"]) <= 1e-5 * got["ref_count"]  # sums: 1e-5 a token
    assert got["grad_max_abs_diff"] <= 1e-5 * max(1.0, got["grad_scale"])
    assert got["grad_keys"] > 10
    assert got["all_gathers"] > 0  # keys and values gathered over context


def test_train_step_under_context_parallelism_has_the_reference_loss(run):
    assert run["train_step_loss"] == pytest.approx(run["ref_step_loss"], abs=1e-5)


@pytest.mark.parametrize("parts", [1, 2, 4])
def test_balanced_order_gives_every_device_two_chunks_and_equal_causal_work(parts):
    t = 8 * parts
    order = balanced_order(t, parts)
    assert sorted(order.tolist()) == list(range(t))
    per_device = order.reshape(parts, -1)
    # causal work of a query at position p: p + 1 keys; every device the same total.
    work = (per_device + 1).sum(axis=1)
    assert (work == work[0]).all()
    size = t // (2 * parts)
    for i, held in enumerate(per_device):
        chunks = sorted({int(p) // size for p in held})
        assert chunks == sorted({i, 2 * parts - 1 - i})


def test_balanced_order_refuses_a_length_not_a_multiple_of_twice_the_parts():
    with pytest.raises(ValueError, match="multiple of 8"):
        balanced_order(12, 4)


def test_chunked_attention_over_permuted_positions_equals_the_reference():
    # Small blocks, so that block skipping (by each block's min/max position) is exercised on
    # permuted positions: packed segments and a sliding window, forward and gradient.
    b, t, n, kv, h = 2, 32, 4, 2, 8
    rng = np.random.default_rng(1)  # numpy inputs: no eager op compiled per shape
    q, k, v, w = (rng.standard_normal(shape, np.float32)
                  for shape in ((b, t, n, h), (b, kv, t, h), (b, kv, t, h), (b, t, n, h)))
    seg = np.array([[1] * 11 + [2] * 13 + [3] * 5 + [0] * 3, [1] * 20 + [2] * 12], np.int32)
    pos = np.array([list(range(11)) + list(range(13)) + list(range(5)) + [0] * 3,
                    list(range(20)) + list(range(12))], np.int32)
    order = balanced_order(t, 4)
    inverse = np.argsort(order)

    def ref(q, k, v):
        mask = attention_mask(pos, pos, q_segments=seg, k_segments=seg, window=5)
        return jnp.sum(reference_attention(q, k, v, mask) * w)

    def permuted(q, k, v):
        p, s = jnp.asarray(pos[:, order]), jnp.asarray(seg[:, order])  # (traced constants)
        out = chunked_attention(q[:, order], k[:, :, order], v[:, :, order], q_positions=p,
                                k_positions=p, q_segments=s, k_segments=s, window=5,
                                block_q=4, block_k=4)
        return jnp.sum(out[:, inverse] * w)

    (value, got), (want_value, want) = (jax.jit(jax.value_and_grad(f, (0, 1, 2)))(q, k, v)
                                        for f in (permuted, ref))
    assert float(value) == pytest.approx(float(want_value), abs=1e-4)
    for g, r in zip(got, want, strict=True):
        np.testing.assert_allclose(g, r, atol=1e-5)


def test_mesh_config_context_axis_and_rules():
    config = sh.MeshConfig.parse("context=4,fsdp=2,data=1")
    assert config.axes == sh.CONTEXT_MESH_AXES == ("data", "fsdp", "context", "tensor")
    assert config.resolve(8) == (1, 2, 4, 1)
    mesh = jax.sharding.AbstractMesh((1, 2, 4, 1), config.axes)
    rules = dict(sh.rules_for(mesh))
    assert rules["length"] == "context" and rules["embed"] == ("fsdp", "context")
    assert dict(sh.LOGICAL_RULES)["length"] is None  # meshes without context: as before
    assert sh.MeshConfig.parse("1,8,1").axes == sh.MESH_AXES


@pytest.mark.parametrize("text, message", [
    ("context=0", "mesh.context must be a positive int"),
    ("context=-1", "mesh.context must be a positive int"),
    ("context=2,expert=2", "not supported"),
])
def test_mesh_config_refuses_bad_context_sizes(text, message):
    with pytest.raises(ValueError, match=message):
        sh.MeshConfig.parse(text)


@pytest.mark.parametrize("overrides, message", [
    (dict(seq_len=12), "multiple of 2 x context = 8"),
    (dict(objective="dpo"), "only train.objective=sft"),
])
def test_check_context_refuses_what_it_cannot_train(overrides, message):
    tc = TrainConfig(**{"batch_size": 2, "seq_len": 16, "mesh": "context=4", **overrides})
    with pytest.raises(ValueError, match=message):
        check_context(cp.CONFIG, tc)


def test_check_context_refuses_index_causal_pallas_and_passes_the_rest():
    tc = TrainConfig(batch_size=2, seq_len=16, mesh="context=4")
    check_context(cp.CONFIG, tc)
    with pytest.raises(ValueError, match="attention_impl='pallas'"):
        check_context(ModelConfig(**{**cp.CONFIG.__dict__, "attention_impl": "pallas"}), tc)


def test_memory_estimate_counts_a_device_its_part_of_the_sequence():
    from transformer_jax.train.memory import activation_bytes

    tc = TrainConfig(batch_size=1, seq_len=4096, loss_chunk=256)
    config = ModelConfig(**{**cp.CONFIG.__dict__, "max_seq_len": 4096,
                            "attention_impl": "chunked", "remat": "full"})
    one = activation_bytes(config, tc, {"data": 1, "fsdp": 1, "tensor": 1})
    four = activation_bytes(config, tc, {"data": 1, "fsdp": 1, "tensor": 1, "context": 4})
    # every per-token term splits 4 ways; only the loss chunk's logits (256 tokens) do not
    loss = 2 * 4 * 256 * config.vocab_size
    assert four - loss == pytest.approx((one - loss) / 4, rel=1e-6)
