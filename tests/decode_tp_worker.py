"""Subprocess side of ``test_decode_tp.py``: generate on 1, 2 and 4 simulated CPU devices.

Run as ``python tests/decode_tp_worker.py`` with ``--xla_force_host_platform_device_count=4``
(``multihost_worker.run_python`` sets it); prints one JSON line with, per case and tensor size,
the generated tokens and log-probabilities, the streamed steps, the collective ops of two of
those programs, and the error messages of meshes that cannot split the model; under "moe" the
mixture-of-experts model's runs (``moe_tp_worker.py``) and under "serving" the engine's
(``serving_tp_worker.py``): one subprocess for the three, each a process start and JAX's
imports (some 3.5 CPU seconds) fewer.
"""

from __future__ import annotations

import functools
import json
import re
import sys

import jax
import jax.numpy as jnp
import moe_tp_worker
import numpy as np
import serving_tp_worker
from helpers import random_params

from transformer_jax.decode import generation
from transformer_jax.decode import loop as decode
from transformer_jax.model.config import ModelConfig
from transformer_jax.parallel import sharding

BASE = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, head_dim=8, d_ff=48,
            max_seq_len=64, init_std=0.2)
# name -> (config overrides, batch prompt lengths, sampling kwargs, tensor sizes). Each case
# compiles generate once per tensor size, so independent variations share a case: sampling
# goes with multi-head attention (over 2 and 4 devices, 4 not dividing its vocabulary), a batch
# of one with the sliding window. The scanned layers are the patterned case's and
# ``quantized``'s.
CASES = {
    "gqa-ragged-greedy": (dict(n_kv_heads=2), [5, 11, 2], {}, (2,)),
    "mha-bias-untied-odd-vocab-sampled": (
        dict(n_kv_heads=4, qkv_bias=True, tie_embeddings=False, vocab_size=66), [4, 9],
        dict(temperature=0.9, top_p=0.9, seed=3), (2, 4)),
    "sliding-window-gelu-batch1": (dict(n_kv_heads=2, ffn="gelu", sliding_window=4), [12], {},
                                   (2,)),
    # QK-norm over whole projections (its statistics span the shards' heads), norms inside
    # the residual branch, local and global layers in one scan, soft-capped logits.
    "full-qk-norm-patterned-softcap": (
        dict(n_kv_heads=2, qk_norm="full", norm_position="post_branch", sliding_window=4,
             layer_pattern=("local", "global"), scan_layers=True, attn_softcap=3.0,
             final_softcap=5.0), [9, 3], {}, (2,)),
    "head-qk-norm-sandwich-offset": (
        dict(n_kv_heads=2, qk_norm="head", norm_position="sandwich", norm_offset=1.0,
             scale_embeddings=True, ffn="geglu_tanh", local_rope_base=100.0,
             sliding_window=4, layer_pattern=("local", "local", "global"), n_layers=3),
        [10, 4], {}, (2,)),
}
# kind -> (case, tensor size): the collectives are counted in programs of two unrolled 2-layer
# cases, one whose vocabulary T divides, one whose vocabulary it does not (the embedding and
# head replicated).
COLLECTIVE_CASES = {"split_vocab": ("gqa-ragged-greedy", 2),
                    "whole_vocab": ("mha-bias-untied-odd-vocab-sampled", 4)}
COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute")


class _Recorder:
    """``decode._generate_jit`` keeping its last call's arguments, to read that compiled
    program's HLO back (``lower`` then ``compile`` of the same call hits the jit's cache)."""

    def __init__(self, jitted):
        self.jitted, self.last = jitted, None

    def __call__(self, *args, **kwargs):
        self.last = (args, kwargs)
        return self.jitted(*args, **kwargs)

    def last_hlo(self) -> str:
        args, kwargs = self.last
        return self.jitted.lower(*args, **kwargs).compile().as_text()


def collective_counts(hlo: str) -> dict[str, list[int]]:
    """Per collective op, the element count of each of its results in a compiled program."""
    found: dict[str, list[int]] = {op: [] for op in COLLECTIVES}
    for op in COLLECTIVES:
        for dims in re.findall(rf"= \w+\[([\d,]*)\]\S* {op}(?:-start)?\(", hlo):
            found[op].append(int(np.prod([int(d) for d in dims.split(",") if d])))
    return found


def _mesh(tensor: int) -> jax.sharding.Mesh:
    return sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=1, tensor=tensor),
                              jax.devices()[:tensor])


def vocab_edges(vocab: int, sizes: tuple[int, ...]) -> list[int]:
    """The first and last ids of each shard's block of the vocabulary, over every T in
    ``sizes`` that splits it (0 and V - 1 always)."""
    edges = {0, vocab - 1}
    for t in sizes:
        if vocab % t == 0:
            edges |= {k * vocab // t + d for k in range(1, t) for d in (-1, 0)}
    return sorted(edges)


def run_case(overrides: dict, lengths: list[int], kwargs: dict, sizes: tuple[int, ...], *,
             count_collectives: int = 0, raw: bool = True) -> dict:
    """Generate at each tensor size, and the collectives of the ``count_collectives`` one;
    on a mesh from the raw parameters (prepared inside the program) only with ``raw``, from
    weights prepared once always."""
    config = ModelConfig(**{**BASE, **overrides})
    params = random_params(config)  # biases and norm gains random too
    rng = np.random.default_rng(len(lengths))
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in lengths]
    # The longest prompt starts with the ids at the edges of the vocabulary's shards, so that
    # a shard that looked up a row off by one at an edge would change the output.
    edges = vocab_edges(config.vocab_size, sizes)
    longest = max(prompts, key=len)
    longest[:len(edges)] = edges
    out = {}
    for tensor in (1, *sizes):
        mesh = None if tensor == 1 else _mesh(tensor)
        steps: list[list[int]] = []

        def record(step, tokens, active, steps=steps):
            steps.append([int(step), *np.asarray(tokens).tolist()])

        if mesh is None or raw:
            result = generation.generate(config, params, prompts, max_new_tokens=6, mesh=mesh,
                                         stream=record, **kwargs)
            out[str(tensor)] = dict(tokens=result.tokens, logprobs=result.logprobs, stream=steps)
        if mesh is None:
            continue
        # The same through weights prepared once on the mesh (each device holds its block).
        weights = decode.prepare(config, params, mesh)
        prepared_steps: list[list[int]] = []
        result = generation.generate(config, weights, prompts, max_new_tokens=6,
                                 stream=lambda *a, s=prepared_steps: record(*a, steps=s),
                                 **kwargs)
        if tensor == count_collectives:
            out["collectives"] = collective_counts(decode._generate_jit.last_hlo())
        out[f"{tensor}-prepared"] = dict(
            tokens=result.tokens, logprobs=result.logprobs, stream=prepared_steps,
            bytes_total=weights.nbytes,
            bytes_device0=sum(shard.data.nbytes for x in jax.tree.leaves(weights.params)
                              for shard in x.addressable_shards
                              if shard.device == mesh.devices.flat[0]))
    return out


def errors() -> dict:
    config = ModelConfig(**{**BASE, "n_kv_heads": 2})
    params = random_params(config)
    found = {}
    meshes = {
        "tensor3": lambda: _mesh(3),
        "data2": lambda: sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=1, tensor=2)),
        "no_tensor_axis": lambda: jax.make_mesh((2,), ("model",)),
    }
    for name, make in meshes.items():
        try:
            generation.generate(config, params, [[1, 2, 3]], max_new_tokens=2, mesh=make())
            found[name] = None
        except ValueError as e:
            found[name] = str(e)
    attempts = {
        "prepare_tensor3": lambda: decode.prepare(config, params, _mesh(3)),
        "prepared_other_mesh": lambda: generation.generate(
            config, decode.prepare(config, params, _mesh(2)), [[1, 2, 3]], max_new_tokens=2,
            mesh=_mesh(4)),
    }
    for name, attempt in attempts.items():
        try:
            attempt()
            found[name] = None
        except ValueError as e:
            found[name] = str(e)
    return found


def quantized() -> dict:
    """Generate with int8 and int4 weights prepared on one device and split over 2 (the
    vocabulary split with it), per scheme, plus the quantised bytes on device 0."""
    config = ModelConfig(**{**BASE, "n_kv_heads": 2, "scan_layers": True})
    params = random_params(config, seed=1)
    prompts = [[*vocab_edges(config.vocab_size, (2,)), 5], [9, 2]]
    found = {}
    for quant in ("int8", "int4:8"):
        for tensor in (1, 2):
            mesh = None if tensor == 1 else _mesh(tensor)
            weights = decode.prepare(config, params, mesh, quant=quant)
            result = generation.generate(config, weights, prompts, max_new_tokens=6)
            found[f"{quant}-{tensor}"] = dict(tokens=result.tokens, logprobs=result.logprobs)
    return found


def per_device_attention() -> dict:
    """What a kernel's per-device run does (``ops.attention``: XLA cannot partition a Pallas
    or cuDNN call), with the reference in the kernel's place, over tensor=2 under a decode's
    context: the largest difference from the unsplit reference, and whether the traced
    program mapped it over the heads."""
    from transformer_jax.model.ops import attention as attn

    config = ModelConfig(**{**BASE, "n_kv_heads": 2})
    mesh = _mesh(2)
    rng = np.random.default_rng(5)
    q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32)
               for s in ((3, 5, 4, 8), (3, 2, 7, 8), (3, 2, 7, 8)))
    positions = jnp.broadcast_to(jnp.arange(2, 7), (3, 5))
    want = attn.attention(q, k, v, q_positions=positions, impl="xla")

    def split(q, k, v, positions):
        with decode.decode_context(config, mesh):
            where = attn._kernel_split(q.shape[0], k.shape[1])
            return attn._per_device(where, functools.partial(attn.attention, impl="xla"),
                                    q, k, v, q_positions=positions, window=3)

    placed = jax.device_put((q, k, v, positions),
                            jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    got = jax.jit(split)(*placed)
    windowed = attn.attention(q, k, v, q_positions=positions, impl="xla", window=3)
    text = jax.jit(split).lower(*placed).as_text()
    return dict(max_diff=float(jnp.max(jnp.abs(got - windowed))),
                differs_without_window=float(jnp.max(jnp.abs(want - windowed))),
                mapped="shard_map" in text or "manual" in text.lower())


def per_device_kernel() -> dict:
    """JAX's Pallas TPU flash attention (interpreted here) run per device as a TPU-targeted
    train step runs it: traced with the mesh and logical rules in context (``jit_sharded``),
    the batch split over fsdp=2 and the kv heads over tensor=2; packed rows with padding, GQA.
    The largest difference of the output and of the gradients of q, k, v from the unsplit
    reference, relative to the largest entry of each."""
    from jax.experimental.pallas import tpu as pltpu

    from transformer_jax.model.ops import attention as attn
    from transformer_jax.model.ops import target

    b, t, n, kv, h = 4, 128, 4, 2, 128  # the kernel's 128-position blocks
    mesh = sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=2, tensor=2), jax.devices())
    rng = np.random.default_rng(7)
    q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32)
               for s in ((b, t, n, h), (b, kv, t, h), (b, kv, t, h)))
    cuts = rng.integers(20, 100, size=b)  # row i: a document of cuts[i], one to 120, padding
    seg = np.where(np.arange(t) < cuts[:, None], 1, np.where(np.arange(t) < 120, 2, 0))
    pos = np.where(seg == 2, np.arange(t) - cuts[:, None], np.arange(t))
    seg, pos = jnp.asarray(seg, jnp.int32), jnp.asarray(pos, jnp.int32)
    weights = jnp.asarray(rng.normal(size=h), jnp.float32)

    def run(impl):
        def both(q, k, v, pos, seg):
            def fn(q, k, v):
                return attn.attention(q, k, v, q_positions=pos, k_positions=pos,
                                      q_segments=seg, k_segments=seg, impl=impl)
            with target.targeting("tpu" if impl == "pallas" else None):
                grads = jax.grad(lambda *a: (fn(*a) * weights).sum(), argnums=(0, 1, 2))(
                    q, k, v)
                return fn(q, k, v), *grads
        return both

    want = jax.jit(run("xla"))(q, k, v, pos, seg)
    P = jax.sharding.PartitionSpec
    shardings = tuple(jax.sharding.NamedSharding(mesh, s) for s in (
        P("fsdp", None, "tensor"), P("fsdp", "tensor"), P("fsdp", "tensor"), P("fsdp"),
        P("fsdp")))
    split = sharding.jit_sharded(run("pallas"), mesh, shardings, None)
    # Pallas's plain interpreter (the kernel lowered to XLA ops): TPU interpret mode's
    # simulated memory, shared by the 4 devices' kernels through callbacks, hung here.
    with pltpu.force_tpu_interpret_mode(True):
        placed = jax.device_put((q, k, v, pos, seg), shardings)
        got = split(*placed)
        text = split.lower(*placed).as_text()
    return dict(mapped="shard_map" in text or "manual" in text.lower(),
                rel_diff={name: float(jnp.max(jnp.abs(g - w)) / jnp.max(jnp.abs(w)))
                          for name, g, w in zip(("out", "dq", "dk", "dv"), got, want,
                                                strict=True)})


def main() -> int:
    assert len(jax.devices()) == 4, jax.devices()
    decode._generate_jit = _Recorder(decode._generate_jit)
    counted = dict(COLLECTIVE_CASES.values())
    # The raw parameters' path on a mesh (the same program with the preparation traced in) is
    # run by the two collective cases; the others run prepared weights only.
    result = {name: run_case(*case, count_collectives=counted.get(name, 0),
                             raw=name in counted)
              for name, case in CASES.items()}
    # Collective ops in a compiled tensor-parallel generate (the prepared weights' program, the
    # one the raw parameters' call ran too), for a vocabulary T divides and one it does not.
    result["collectives"] = {kind: result[name].pop("collectives")
                             for kind, (name, _) in COLLECTIVE_CASES.items()}
    result["errors"] = errors()
    result["quantized"] = quantized()
    result["per_device_attention"] = per_device_attention()
    result["per_device_kernel"] = per_device_kernel()
    result["moe"] = moe_tp_worker.main()
    result["serving"] = serving_tp_worker.main()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
