"""Subprocess side of ``test_serving_tp.py``: the engine on 1 and 2 simulated CPU devices.

Run as ``python tests/serving_tp_worker.py`` with ``--xla_force_host_platform_device_count=2``
(``multihost_worker.run_python`` sets it); prints one JSON line with, per case and tensor size,
each request's tokens and log-probabilities and the shape of one device's block of the pages.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np

from transformer_jax.model import lora
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.transformer import init_params
from transformer_jax.parallel import sharding
from transformer_jax.serving import Engine, SamplingParams

BASE = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
            d_ff=48, max_seq_len=64, init_std=0.2)
# "lora": two LoRA adapters beside the base, rows of all three in each step.
CASES = {"unrolled": {}, "scanned-window": dict(scan_layers=True, sliding_window=6),
         "lora": dict(scan_layers=True, lora=True)}
ROW_ADAPTERS = [None, "a", "b", "a"]
PARAMS = [SamplingParams(max_tokens=8, logprobs=True), SamplingParams(max_tokens=6),
          SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=5),
          SamplingParams(max_tokens=5, stop_token_ids=(3,))]


def _adapters(config: ModelConfig, params: dict) -> dict:
    """Two adapters with B far from zero: every dense matrix at rank 4, and q, v at rank 2."""
    out = {}
    for seed, cfg in enumerate((lora.LoraConfig(rank=4), lora.LoraConfig(rank=2, alpha=6.0,
                                                                         targets=("q", "v")))):
        tree = lora.init_adapters(config, cfg, params, jax.random.key(seed + 1))
        # The noise from numpy: jax.random.normal op by op would compile a program per shape.
        rng = np.random.default_rng(seed + 7)
        out["ab"[seed]] = (jax.tree.map(lambda x, r=rng: jax.numpy.asarray(
            np.asarray(x) + 0.2 * r.standard_normal(x.shape, np.float32)), tree), cfg)
    return out


def run_case(overrides: dict) -> dict:
    overrides = dict(overrides)
    with_lora = overrides.pop("lora", False)
    config = ModelConfig(**{**BASE, **overrides})
    # One compiled init per config, cheaper than compiling each of its ops apart.
    params = jax.jit(init_params, static_argnums=0)(config, jax.random.key(0))
    adapters = _adapters(config, params) if with_lora else None
    asks = [dataclasses.replace(p, adapter=a) for p, a in zip(PARAMS, ROW_ADAPTERS,
                                                                  strict=True)
            ] if with_lora else list(PARAMS)
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 64, 8).tolist()
    prompts = [shared + rng.integers(0, 64, n).tolist() for n in (3, 20, 9, 30)]
    if not overrides:  # the unrolled case (the others keep the load that preempts)
        # The first prompt again, sampled: it forks from the first's prefill (a copy of its
        # partial page, made on the split pages).
        prompts.insert(1, prompts[0])
        asks.insert(1, dataclasses.replace(asks[0], temperature=0.8, seed=9))
    out = {}
    for tensor in (1, 2):
        mesh = None if tensor == 1 else sharding.make_mesh(
            sharding.MeshConfig(data=1, fsdp=1, tensor=tensor), jax.devices()[:tensor])
        engine = Engine(config, params, num_slots=2, num_pages=12, page_size=4,
                        token_budget=18, mesh=mesh, adapters=adapters)
        ids = [engine.add_request(p, s) for p, s in zip(prompts, asks, strict=True)]
        done = engine.run_until_idle(max_steps=500)  # a leak fails here rather than hanging
        if not engine.idle:
            raise AssertionError(f"not idle after 500 steps: {engine.scheduler.describe()}")
        engine.check_no_leaks()
        # The kv-head-split storage: the pages, or the rings of a model whose every layer
        # keeps its window (its pages then hold no layer).
        rings = engine._rings is not None and not jax.tree.leaves(engine._k)[0].size
        leaf = jax.tree.leaves(engine._rings if rings else engine._k)[0]
        out[str(tensor)] = dict(
            tokens=[done[i].tokens for i in ids], logprobs=[done[i].logprobs for i in ids],
            preemptions=engine.scheduler.preemptions, forked=engine.scheduler.forked,
            block=list(leaf.addressable_shards[0].data.shape), whole=list(leaf.shape),
            kv_axis=int(config.scan_layers) + rings)  # [L, ..] stacked; rings [.., S, K, ..]
    return out


if __name__ == "__main__":
    print(json.dumps({name: run_case(overrides) for name, overrides in CASES.items()}))
