"""DPO loss curve against TRL's formulas in torch: a tiny random HF Llama trained for N steps by
our train step and by a torch loop on the same weights, pairs, data order and learning rate.

The torch side is TRL 1.16's ``DPOTrainer`` loss (``sigmoid``: summed completion log-probs of
right-padded, unpacked sequences, a frozen copy of the initial model as the reference) with
``torch.optim.AdamW`` (no weight decay, no clipping, constant lr); ours is
``train.preference_run.make_objective_step`` on packed rows with the first-pass reference.
Prints the loss of both at every step and the largest gap. Needs torch and transformers; TRL
itself is not needed (its formula is a few lines, written out below).

Run: ``python -m transformer_jax.bench.dpo [--steps 60] [--lr 1e-3]``.
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
from pathlib import Path

import jax
import numpy as np

from transformer_jax import hf
from transformer_jax.data.instruct_records import Example
from transformer_jax.data.preference import PairBatches, pack_pairs
from transformer_jax.parallel import sharding as sharding_lib
from transformer_jax.train.config import TrainConfig
from transformer_jax.train.preference_run import make_objective_step, reference_pass
from transformer_jax.train.step import make_init_fn

VOCAB = 64


def make_pairs(n: int, seed: int = 0) -> list[tuple[Example, Example]]:
    """Random token pairs: a shared prompt of 4-8 tokens, answers of 3-6 (loss on those)."""
    rng = np.random.default_rng(seed)
    pairs = []
    for i in range(n):
        prompt = rng.integers(3, VOCAB, rng.integers(4, 9))
        sides = []
        for _ in range(2):
            answer = rng.integers(3, VOCAB, rng.integers(3, 7))
            tokens = np.concatenate([prompt, answer]).astype(np.int32)
            sides.append(Example(tokens, np.arange(len(tokens)) >= len(prompt), i + 1, 0))
        pairs.append((sides[0], sides[1]))
    return pairs


def torch_curve(model, batches_ids, pairs, steps: int, lr: float, beta: float) -> list[float]:
    """TRL's sigmoid DPO loss per step, AdamW on ``model`` (a frozen copy is the reference)."""
    import torch
    import torch.nn.functional as F

    reference = copy.deepcopy(model).eval()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8,
                                  weight_decay=0.0)

    def logps(m, sequences):
        n = max(len(e.tokens) for e in sequences)
        ids = torch.zeros((len(sequences), n), dtype=torch.long)
        attention = torch.zeros_like(ids)
        completion = torch.zeros((len(sequences), n))
        for i, e in enumerate(sequences):
            ids[i, :len(e.tokens)] = torch.tensor(e.tokens.astype(np.int64))
            attention[i, :len(e.tokens)] = 1
            completion[i, :len(e.tokens)] = torch.tensor(e.loss.astype(np.float32))
        logits = m(input_ids=ids, attention_mask=attention).logits[:, :-1]
        per_token = torch.gather(logits.log_softmax(-1), 2, ids[:, 1:, None])[..., 0]
        return (per_token * completion[:, 1:]).sum(-1)

    losses = []
    for step in range(steps):
        chosen = [pairs[i][0] for i in batches_ids[step]]
        rejected = [pairs[i][1] for i in batches_ids[step]]
        both = logps(model, chosen + rejected)
        with torch.no_grad():
            ref = logps(reference, chosen + rejected)
        k = len(chosen)
        delta = (both[:k] - ref[:k]) - (both[k:] - ref[k:])
        loss = -F.logsigmoid(beta * delta).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def main(argv: list[str] | None = None) -> int:
    """Runs both curves; prints per-step losses and the max gap as JSON on the last line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--pairs", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4, help="packed rows per step")
    args = parser.parse_args(argv)
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-5, initializer_range=0.2, tie_word_embeddings=False,
        attn_implementation="eager"))
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(Path(tmp), safe_serialization=True)
        config, params = hf.load(tmp, dtype="float32")
    pairs = make_pairs(args.pairs)
    packed = pack_pairs(pairs, seq_len=47)
    tc = TrainConfig(objective="dpo", dpo_beta=args.beta, batch_size=args.batch_size,
                     seq_len=47, steps=args.steps, lr=args.lr, min_lr=args.lr, warmup_steps=0,
                     weight_decay=0.0, grad_clip=0.0, b1=0.9, b2=0.95, eps=1e-8)
    mesh = sharding_lib.make_mesh(sharding_lib.MeshConfig.parse("1,1,1"))
    batch_sharding = sharding_lib.batch_sharding(mesh)
    reference = reference_pass(config, tc, params, packed, batch_sharding)
    source = PairBatches(packed, tc.batch_size, tc.seed, reference=reference)
    state = jax.jit(make_init_fn(config, tc))(jax.random.key(0), params)

    class Data:  # what make_objective_step reads of a run's data
        pairs = packed

    step_fn = jax.jit(make_objective_step(config, tc, Data))
    ours, order = [], []
    for step in range(args.steps):
        batch = source.get(step)
        order.append([int(i) for i in batch["pair_ids"].ravel() if i >= 0])
        state, metrics = step_fn(state, batch)
        ours.append(float(metrics["loss"]))
    theirs = torch_curve(model.train(), order, pairs, args.steps, args.lr, args.beta)
    gaps = [abs(a - b) for a, b in zip(ours, theirs, strict=True)]
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True), start=1):
        print(f"step {step:3d}: ours {a:.6f}  torch/TRL {b:.6f}  gap {abs(a - b):.2e}")
    print(json.dumps({"steps": args.steps, "lr": args.lr, "beta": args.beta,
                      "first_loss": ours[0], "last_loss": ours[-1],
                      "max_gap": max(gaps)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
