"""Subprocess side of ``test_decode_tp.py``'s serving test: the engine on 1 and 2 simulated CPU
devices.

Run by ``decode_tp_worker.py`` (in its subprocess, with 4 devices: the first 2 serve), or alone
as ``python tests/serving_tp_worker.py`` with ``--xla_force_host_platform_device_count=2`` or
more; ``main`` gives, per case and tensor size, each request's tokens and log-probabilities
and the shape of one device's block of the pages and of the local layers' rings.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
from helpers import random_params

from transformer_jax.model import lora
from transformer_jax.model.config import ModelConfig
from transformer_jax.parallel import sharding
from transformer_jax.serving import Engine, SamplingParams

BASE = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
            d_ff=48, max_seq_len=64, init_std=0.2)
# "unrolled": greedy and sampled rows (one request, and a fork of the first prompt).
# "scanned-window-lora": stacked layers, local ones (their windows in rings) and global ones
# (in pages), two of each, and two LoRA adapters beside the base, rows of all three in each
# step; its requests greedy, so that each tensor size compiles two step programs, not four
# (the sampled programs are the unrolled case's).
CASES = {"unrolled": {},
         "scanned-window-lora": dict(scan_layers=True, sliding_window=6, n_layers=4,
                                     layer_pattern=("local", "global"), lora=True)}
ROW_ADAPTERS = [None, "a", "b", "a"]
PARAMS = [SamplingParams(max_tokens=8, logprobs=True), SamplingParams(max_tokens=6),
          SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=5),
          SamplingParams(max_tokens=5, stop_token_ids=(3,))]


def _adapters(config: ModelConfig, params: dict) -> dict:
    """Two adapters with A and B random (numpy, from the shapes alone: no program compiles):
    every dense matrix at rank 4, and q, v at rank 2."""
    out = {}
    for seed, cfg in enumerate((lora.LoraConfig(rank=4), lora.LoraConfig(rank=2, alpha=6.0,
                                                                         targets=("q", "v")))):
        shapes = jax.eval_shape(lambda c=cfg: lora.init_adapters(config, c, params,
                                                                  jax.random.key(0)))
        rng = np.random.default_rng(seed + 7)
        out["ab"[seed]] = (jax.tree.map(
            lambda x, r=rng: 0.2 * r.standard_normal(x.shape).astype(x.dtype), shapes), cfg)
    return out


def _split(leaf: jax.Array) -> dict:
    return dict(block=list(leaf.addressable_shards[0].data.shape), whole=list(leaf.shape))


def run_case(overrides: dict) -> dict:
    overrides = dict(overrides)
    with_lora = overrides.pop("lora", False)
    config = ModelConfig(**{**BASE, **overrides})
    params = random_params(config)
    adapters = _adapters(config, params) if with_lora else None
    asks = list(PARAMS)
    if with_lora:
        asks = [dataclasses.replace(p, adapter=a, temperature=0.0, top_p=None)
                for p, a in zip(asks, ROW_ADAPTERS, strict=True)]
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 64, 8).tolist()
    prompts = [shared + rng.integers(0, 64, n).tolist() for n in (3, 20, 9, 30)]
    if not overrides:  # the unrolled case (the other keeps the load that preempts)
        # The first prompt again, sampled: it forks from the first's prefill (a copy of its
        # partial page, made on the split pages). Its top-p as PARAMS[2]'s: one sampled program.
        prompts.insert(1, prompts[0])
        asks.insert(1, dataclasses.replace(asks[0], temperature=0.8, top_p=0.9, seed=9))
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
        # The kv-head-split storage: the pages ([L, K, ...] stacked, or [K, ...] per layer)
        # and the local layers' rings ([L, S, K, ...] stacked).
        out[str(tensor)] = dict(
            tokens=[done[i].tokens for i in ids], logprobs=[done[i].logprobs for i in ids],
            preemptions=engine.scheduler.preemptions, forked=engine.scheduler.forked,
            pages=_split(jax.tree.leaves(engine._k)[0]),
            rings=None if engine._rings is None else _split(jax.tree.leaves(engine._rings)[0]),
            kv_axis=int(config.scan_layers))
    return out


def main() -> dict:
    return {name: run_case(overrides) for name, overrides in CASES.items()}


if __name__ == "__main__":
    print(json.dumps(main()))
