"""Subprocess side of ``test_decode_tp.py``'s mixture-of-experts test: a mixture-of-experts model
generated and served on 1 device, tensor-parallel over 2, and expert-parallel over 2 experts
x 2 tensor (4 simulated CPU devices).

Run by ``decode_tp_worker.py`` (in its subprocess, with 4 devices), or alone with
``--xla_force_host_platform_device_count=4``; ``main`` gives, per mesh, ``generate``'s and the
engine's greedy tokens and log-probabilities, and the specs of a sparse layer's prepared
weights (expert 0's array when they are split per expert).
"""

from __future__ import annotations

import json

import jax
import numpy as np
from helpers import random_params

from transformer_jax.decode import generation
from transformer_jax.decode import loop as decode
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.fields import MoE
from transformer_jax.model.ops.moe import ExpertList
from transformer_jax.parallel import sharding
from transformer_jax.serving import Engine, SamplingParams

CONFIG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                     head_dim=8, d_ff=48, max_seq_len=64, init_std=0.2,
                     moe=MoE(n_experts=6, top_k=2, d_ff=24, shared_d_ff=16, shared_gate=True,
                             dense_layers=(0,)))


def main() -> dict:
    # Drawn with numpy (helpers.random_params): no init program compiles (op by op, a
    # mixture's init compiles each of its ops apart; jitted, one program of 1.4 s).
    params = random_params(CONFIG)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 64, n).tolist() for n in (3, 11, 6)]
    out = {}
    for name, expert, tensor in (("1", 1, 1), ("2", 1, 2), ("e2t2", 2, 2)):
        mesh = None if name == "1" else sharding.make_mesh(
            sharding.MeshConfig(data=1, fsdp=1, tensor=tensor, expert=expert),
            jax.devices()[:tensor * expert])
        weights = decode.prepare(CONFIG, params, mesh)
        gen = generation.generate(CONFIG, weights, prompts, max_new_tokens=6)
        engine = Engine(CONFIG, weights, num_slots=2, num_pages=10, page_size=4,
                        token_budget=12)
        ids = [engine.add_request(p, SamplingParams(max_tokens=6, logprobs=True))
               for p in prompts]
        done = engine.run_until_idle(max_steps=200)
        moe = {k: v.experts[0] if isinstance(v, ExpertList) else v
               for k, v in weights.params["blocks_1"]["moe"].items()}
        out[name] = dict(
            generate=gen.tokens, generate_logprobs=gen.logprobs,
            engine=[done[i].tokens for i in ids], engine_logprobs=[done[i].logprobs for i in ids],
            specs={k: str(tuple(getattr(getattr(moe[k], "w", moe[k]).sharding, "spec", ())))
                   for k in ("gate", "up", "down", "router")},
            block=list(moe["gate"].addressable_shards[0].data.shape))
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
