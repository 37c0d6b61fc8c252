"""DPO loss curve against TRL's own ``DPOTrainer.train()``: a tiny random HF Llama trained for
N steps by our train step and by TRL on the same weights, pairs, data order and learning rate.

Run: ``python -m transformer_jax.bench.dpo [--steps 60] [--lr 1e-3] [--pairs-per-step N]``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import jax
import numpy as np

from transformer_jax import hf
from transformer_jax.bench import args as arg_types
from transformer_jax.data.instruct_records import Example
from transformer_jax.data.preference import PairBatches, group_pairs, pack_pairs
from transformer_jax.parallel import sharding as sharding_lib
from transformer_jax.train.config import TrainConfig
from transformer_jax.train.preference import reference_pass
from transformer_jax.train.run import make_objective
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


def trl_curve(model_dir: str, order: list[list[int]], pairs, args: argparse.Namespace,
              out_dir: str) -> list[float]:
    """TRL's logged ``loss`` of each step of ``DPOTrainer.train()`` on ``order``'s pairs."""
    import datasets
    import tokenizers
    import torch
    import transformers
    from trl import DPOConfig, DPOTrainer

    def split(example) -> tuple[list[int], list[int]]:
        first = int(np.argmax(example.loss))
        tokens = [int(t) for t in example.tokens]
        return tokens[:first], tokens[first:]

    rows = []
    for chosen, rejected in pairs:
        (prompt, c), (_, r) = split(chosen), split(rejected)
        rows.append({"prompt_ids": prompt, "chosen_ids": c, "rejected_ids": r})
    dataset = datasets.Dataset.from_list(rows)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, "t2")),
        pad_token="t0", eos_token="t1", unk_token="t2")

    class OrderedDPO(DPOTrainer):  # TRL's trainer fed our data order, pre-tokenized
        def _prepare_dataset(self, dataset, *unused, **unused_kw):
            return dataset

        def get_train_dataloader(self):
            return torch.utils.data.DataLoader(self.train_dataset, batch_sampler=order,
                                               collate_fn=self.data_collator)

    load = lambda: transformers.LlamaForCausalLM.from_pretrained(  # noqa: E731
        model_dir, dtype=torch.float32, attn_implementation="eager")
    config = DPOConfig(
        output_dir=out_dir, loss_type=["sigmoid"], beta=args.beta, learning_rate=args.lr,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9,
        adam_beta2=0.95, adam_epsilon=1e-8, optim="adamw_torch", max_grad_norm=0.0,
        max_steps=args.steps, logging_steps=1, report_to=[], save_strategy="no",
        use_cpu=True, bf16=False, remove_unused_columns=False, disable_tqdm=True,
        per_device_train_batch_size=1)
    trainer = OrderedDPO(model=load(), ref_model=load(), args=config, train_dataset=dataset,
                         processing_class=tokenizer)
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def main(argv: list[str] | None = None) -> int:
    """Runs both curves; prints per-step losses and the max gap as JSON on the last line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=arg_types.positive_int, default=60)
    parser.add_argument("--lr", type=arg_types.positive_float(), default=1e-3)
    parser.add_argument("--beta", type=arg_types.positive_float(), default=0.1)
    parser.add_argument("--pairs", type=arg_types.positive_int, default=64)
    parser.add_argument("--batch-size", type=arg_types.positive_int, default=4,
                        help="packed rows per step (without --pairs-per-step)")
    parser.add_argument("--pairs-per-step", type=arg_types.nonnegative_int, default=0,
                        help="N > 0: exactly N pairs a step (train.pairs_per_step), TRL's "
                             "batch; 0: --batch-size packed rows")
    args = parser.parse_args(argv)
    import torch
    import transformers

    torch.manual_seed(0)
    tmp = tempfile.mkdtemp(prefix="bench_dpo_")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-5, initializer_range=0.2, tie_word_embeddings=False,
        attn_implementation="eager"))
    model.save_pretrained(Path(tmp) / "model", safe_serialization=True)
    config, params = hf.load(Path(tmp) / "model", dtype="float32")
    pairs = make_pairs(args.pairs)
    packed = pack_pairs(pairs, seq_len=47)
    if args.pairs_per_step:  # as train.pairs_per_step: grouped by step, the rows they take
        packed = group_pairs(packed, args.pairs_per_step, seed=0)
        args.batch_size = packed.step_rows
    tc = TrainConfig(objective="dpo", dpo_beta=args.beta, batch_size=args.batch_size,
                     seq_len=47, steps=args.steps, lr=args.lr, min_lr=args.lr, warmup_steps=0,
                     weight_decay=0.0, grad_clip=0.0, b1=0.9, b2=0.95, eps=1e-8)
    mesh = sharding_lib.make_mesh(sharding_lib.MeshConfig.parse("1,1,1"))
    batch_sharding = sharding_lib.batch_sharding(mesh)
    reference = reference_pass(config, tc, params, packed, batch_sharding)
    source = PairBatches(packed, tc.batch_size, tc.seed, reference=reference)
    state = jax.jit(make_init_fn(config, tc))(jax.random.key(0), params)

    class Data:  # what the objective's step_fn reads of a run's data
        pairs = packed

    step_fn = jax.jit(make_objective(tc).step_fn(config, Data))
    ours, order = [], []
    for step in range(args.steps):
        batch = source.get(step)
        order.append([int(i) for i in batch["pair_ids"].ravel() if i >= 0])
        state, metrics = step_fn(state, batch)
        ours.append(float(metrics["loss"]))
    theirs = trl_curve(str(Path(tmp) / "model"), order, pairs, args, str(Path(tmp) / "trl"))
    if len(theirs) != len(ours):
        raise RuntimeError(f"TRL logged {len(theirs)} losses for {len(ours)} steps")
    gaps = [abs(a - b) for a, b in zip(ours, theirs, strict=True)]
    print(f"config: tiny Llama (vocab {VOCAB}, d_model 32, 2 layers, 4 heads / 2 kv), "
          f"{args.pairs} random pairs packed into {packed.rows.num_rows} rows (seq_len 47"
          f"{'; grouped by step' if packed.step_rows else ''}), "
          f"batch {tc.batch_size} rows/step ({min(map(len, order))}-{max(map(len, order))} "
          f"pairs), AdamW lr {args.lr} constant, beta {args.beta}; float32 on "
          f"{jax.devices()[0].platform} ({len(jax.devices())} device) vs TRL on torch CPU")
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True), start=1):
        print(f"step {step:3d}: ours {a:.6f}  TRL DPOTrainer {b:.6f}  gap {abs(a - b):.2e}")
    print(json.dumps({"steps": args.steps, "lr": args.lr, "beta": args.beta,
                      "first_loss": ours[0], "last_loss": ours[-1], "trl_last_loss": theirs[-1],
                      "max_gap": max(gaps), "target_0.05_met": max(gaps) <= 0.05}))
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
