"""Subprocess side of ``test_context_parallel.py``: context parallelism on 4 simulated CPU devices.

The reference is the loss and gradients of a plain ``jax.jit`` on one device (no mesh, no
sharding code, the batch in its natural order, attention ``xla``: one program for both meshes,
whatever attention they use); each mesh of ``MESHES`` computes them with the
sharded jit ``train.run`` uses (the batch split along T over ``context``, permuted inside the
step; on context=2 x fsdp=2 the LM-head loss chunked per device, ``parallel.context``). The
model has a sliding-window layer and a global one, and the batch packed segments, a padded
tail (segment 0) and loss weights. Prints one JSON object on its last stdout line.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import helpers  # noqa: F401  (its GC thresholds, for this process too)
import jax
import numpy as np

from transformer_jax.model.config import ModelConfig
from transformer_jax.parallel import sharding as sh
from transformer_jax.train.config import TrainConfig
from transformer_jax.train.step import make_init_fn, make_loss_fn, make_train_step

CONFIG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                     head_dim=8, d_ff=48, max_seq_len=32, init_std=0.2, sliding_window=5,
                     layer_pattern=("local", "global"))
B, T = 2, 32
TRAIN = TrainConfig(steps=10, batch_size=B, seq_len=T, lr=1e-2, warmup_steps=0)
#: name -> (mesh, attention impl, train.loss_chunk): 4 devices each. The reference computes
#: the logits whole (no loss chunk) with attention "xla".
MESHES = {
    "context4": (sh.MeshConfig(data=1, context=4), "xla", 0),
    "context2_fsdp2": (sh.MeshConfig(data=1, fsdp=2, context=2), "chunked", 4),
}


def batch() -> dict[str, np.ndarray]:
    """Two rows of packed segments: row 0 holds segments of 11, 13 and 5 tokens and 3 of
    padding, row 1 one segment of 20 and one of 12; positions restart at each segment."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, CONFIG.vocab_size, (B, T + 1), np.int32)
    segments = np.zeros((B, T), np.int32)
    positions = np.zeros((B, T), np.int32)
    for row, lengths in enumerate(((11, 13, 5), (20, 12))):
        start = 0
        for s, n in enumerate(lengths, 1):
            segments[row, start:start + n] = s
            positions[row, start:start + n] = np.arange(n)
            start += n
    mask = (segments > 0).astype(np.float32) * rng.uniform(0.5, 1.5, (B, T)).astype(np.float32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask,
            "segment_ids": segments, "positions": positions}


def flat(tree) -> dict[str, np.ndarray]:
    leaves, _ = jax.tree_util.tree_flatten_with_path(jax.device_get(tree))
    return {sh._path_str(p): np.asarray(x, np.float64) for p, x in leaves}


def main() -> int:
    assert jax.device_count() == 4, jax.devices()
    init = make_init_fn(CONFIG, TRAIN)
    state0 = jax.jit(init)(jax.random.key(0))
    params = state0.params
    data = batch()
    out: dict = {"meshes": {}}
    reference = dataclasses.replace(CONFIG, attention_impl="xla")
    ref_grad = jax.value_and_grad(make_loss_fn(reference, TRAIN), has_aux=True)
    (ref_loss, ref_aux), ref_grads = jax.jit(ref_grad)(params, data)  # one device, no mesh
    for name, (mesh_config, impl, chunk) in MESHES.items():
        config = dataclasses.replace(CONFIG, attention_impl=impl)
        grad = jax.value_and_grad(
            make_loss_fn(config, dataclasses.replace(TRAIN, loss_chunk=chunk)), has_aux=True)
        mesh = sh.make_mesh(mesh_config)
        p_shard = sh.param_shardings(config, mesh)
        b_shard = sh.batch_sharding(mesh)
        fn = sh.jit_sharded(grad, mesh, (p_shard, b_shard),
                            ((sh.replicated(mesh), sh.replicated(mesh)), p_shard))
        placed = (jax.device_put(params, p_shard), jax.device_put(data, b_shard))
        compiled = fn.lower(*placed).compile()
        (loss, aux), grads = compiled(*placed)
        hlo = compiled.as_text()
        ref, got = flat(ref_grads), flat(grads)
        scale = max(float(np.max(np.abs(x))) for x in ref.values())
        out["meshes"][name] = {
            "mesh": dict(mesh.shape), "batch_spec": [list(a) if isinstance(a, tuple) else a
                                                     for a in b_shard.spec],
            "loss": float(loss), "ref_loss": float(ref_loss),
            "count": float(aux[2]), "ref_count": float(ref_aux[2]),
            # Of the step's gradient (the sums' over the weighted token count).
            "grad_max_abs_diff": max(float(np.max(np.abs(got[k] - ref[k]))) for k in ref)
            / float(ref_aux[2]),
            "grad_scale": scale / float(ref_aux[2]),
            "all_gathers": hlo.count(" all-gather("), "grad_keys": len(ref)}
    # The whole train step, as train.run jits it, on the first mesh (the initial state placed
    # there): its loss is the reference's mean cross-entropy.
    mesh = sh.make_mesh(MESHES["context4"][0])
    step = make_train_step(CONFIG, TRAIN)
    s_shard = sh.state_shardings(jax.eval_shape(init, jax.random.key(0)),
                                 sh.param_shardings(CONFIG, mesh))
    step_fn = sh.jit_train_step(step, s_shard, sh.batch_sharding(mesh))
    _, metrics = step_fn(jax.device_put(state0, s_shard),
                         jax.device_put(data, sh.batch_sharding(mesh)))
    out["train_step_loss"] = float(metrics["loss"])
    out["ref_step_loss"] = float(ref_aux[0] / ref_aux[2])  # the same model (attention "xla")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
