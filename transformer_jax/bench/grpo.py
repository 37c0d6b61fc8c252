"""GRPO on a verifiable task the benchmark makes (addition in a chat format, exact-match reward):
a tiny HF Llama (``save_pretrained`` from random init) gets a short SFT, then GRPO; the mean
sampled reward before and after, GRPO steps per minute against TRL's ``GRPOTrainer`` on the
same model, prompts, G and lengths, and the weight refresh's share of a step.

The speed phase runs ours and TRL from the random model ``--rounds`` times in turn, the first
(compiling) step of each left out, and compares each side's median step time.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from transformer_jax.bench import args as arg_types

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ '<|im_end|>\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
WORDS = [*"0123456789", "+", "=", "user", "assistant"]


def exact_match(completion: str, record: dict) -> float:
    """1.0 when the completion, spaces removed, is the record's ``answer``."""
    return float("".join(completion.split()) == record["answer"])


def write_tokenizer(directory: Path) -> None:
    """A word-level tokenizer (one token per digit) with the ChatML-like template above."""
    import tokenizers
    from tokenizers import models, pre_tokenizers

    vocab = [*SPECIALS, *WORDS]
    tok = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)},
                                                unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Whitespace(), pre_tokenizers.Digits(individual_digits=True)])
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in SPECIALS])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<unk>",
        "add_bos_token": True, "chat_template": CHAT_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast"}))


def write_model(directory: Path, args: argparse.Namespace) -> None:
    """A random tiny Llama written by ``save_pretrained``, with the tokenizer."""
    import torch
    import transformers

    torch.manual_seed(args.seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=len(SPECIALS) + len(WORDS), hidden_size=args.width,
        intermediate_size=2 * args.width,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0))
    model.generation_config.eos_token_id = 2
    model.save_pretrained(directory, safe_serialization=True)
    write_tokenizer(directory)


def make_task(root: Path, max_operand: int) -> tuple[Path, Path, list[dict]]:
    """``(sft.jsonl, prompts.jsonl, records)``: every ``a+b=`` with a, b < max_operand."""
    records, sft = [], []
    for a in range(max_operand):
        for b in range(max_operand):
            user = {"role": "user", "content": f"{a}+{b}="}
            records.append({"messages": [user], "answer": str(a + b)})
            sft.append({"messages": [user, {"role": "assistant", "content": str(a + b)}]})
    paths = root / "sft.jsonl", root / "prompts.jsonl"
    for path, rows in zip(paths, (sft, records), strict=True):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths[0], paths[1], records


def evaluate(run_dir: Path, prompts_file: Path, samples: int, max_tokens: int, seed: int
             ) -> tuple[float, float]:
    """``(sampled, greedy)``: the mean exact-match reward over every prompt of ``samples``
    completions at temperature 1, and of one greedy completion, from ``run_dir``'s weights."""
    from transformer_jax.checkpoint import loading
    from transformer_jax.serving.requests import SamplingParams
    from transformer_jax.train.config import TrainConfig
    from transformer_jax.train.grpo import completion_text, make_engine
    from transformer_jax.train.grpo_data import load_prompts, load_rewards, score

    ckpt = loading.load(loading.locate(str(run_dir)))
    prompts = load_prompts(prompts_file, ckpt.tokenizer, 48)
    rewards = load_rewards("transformer_jax.bench.grpo:exact_match")
    settings = TrainConfig(batch_size=64, grpo_max_tokens=max_tokens, grpo_group_size=samples)
    engine = make_engine(ckpt.config, ckpt.params, settings, max(len(p.tokens) for p in prompts))
    out = []
    for temperature, n in ((1.0, samples), (0.0, 1)):
        total = 0
        for start in range(0, len(prompts), 64 // n):
            chunk = prompts[start:start + 64 // n]
            ids = [(p, engine.add_request(p.tokens.tolist(), SamplingParams(
                max_tokens=max_tokens, temperature=temperature, stop_token_ids=(2,),
                seed=seed + 1000 * start + i))) for p in chunk for i in range(n)]
            done = engine.run_until_idle()
            for p, rid in ids:
                total += score(rewards, completion_text(ckpt.tokenizer, done[rid].tokens), p)
        out.append(total / (n * len(prompts)))
    return out[0], out[1]


def logprob_gap(run_dir: Path, prompts_file: Path, args: argparse.Namespace) -> float:
    """The largest |engine log-prob - trainer log-prob| over one rollout of ``run_dir``'s
    weights (every sampled completion token of ``--prompts`` prompts x G)."""
    from transformer_jax.checkpoint import loading
    from transformer_jax.model.transformer import Transformer
    from transformer_jax.train.config import TrainConfig
    from transformer_jax.train.grpo import grpo_batch, make_engine, make_logps_fn, sample
    from transformer_jax.train.grpo_data import load_prompts

    ckpt = loading.load(loading.locate(str(run_dir)))
    prompts = load_prompts(prompts_file, ckpt.tokenizer, 28)[:args.prompts]
    tc = TrainConfig(batch_size=args.prompts * args.group, grpo_max_tokens=args.max_tokens,
                     grpo_group_size=args.group, grpo_temperature=1.0, seed=args.seed)
    engine = make_engine(ckpt.config, ckpt.params, tc, max(len(p.tokens) for p in prompts))
    rows, completions, lps = sample(engine, prompts, tc, 0, ckpt.tokenizer.eos_id)
    batch = grpo_batch(rows, completions, lps, np.zeros(len(rows)), 32)
    ours = np.asarray(make_logps_fn(Transformer(ckpt.config))(ckpt.params, batch))
    mask = batch["mask"] > 0
    return float(np.abs(ours[mask] - batch["old_logps"][mask]).max())


def grpo_overrides(model_dir: Path, prompts: Path, run_dir: Path, steps: int,
                   args: argparse.Namespace, lr: float, ckpt_every: int) -> list[str]:
    """The ``grpo`` preset's overrides of our GRPO run from ``model_dir``."""
    return [
        f"train.init_from={model_dir}", f"data.path={prompts}", f"train.run_dir={run_dir}",
        "train.reward=transformer_jax.bench.grpo:exact_match", f"train.steps={steps}",
        f"train.batch_size={args.prompts * args.group}", f"train.grpo_group_size={args.group}",
        f"train.grpo_max_tokens={args.max_tokens}", "train.seq_len=32", f"train.lr={lr}",
        f"train.min_lr={lr}", f"train.grpo_kl_beta={args.beta}", f"train.seed={args.seed}",
        f"train.warmup_steps={min(args.warmup, steps - 1)}",
        f"train.ckpt_every={ckpt_every}", "train.log_every=10", "train.mesh=1,1,1",
        f"train.grad_accum={args.grad_accum}"]


def sft_overrides(root: Path, sft_file: Path, args: argparse.Namespace) -> list[str]:
    """The ``finetune`` preset's overrides of the SFT run before GRPO."""
    return [f"train.init_from={root / 'hf'}", f"data.path={sft_file}",
            f"train.run_dir={root / 'sft'}", f"train.steps={args.sft_steps}",
            "train.batch_size=32", "train.seq_len=32", f"train.lr={args.sft_lr}",
            f"train.min_lr={args.sft_lr / 10}", "train.warmup_steps=10", "train.eval_every=0",
            "train.sample_tokens=0", "data.val_fraction=0", "train.mesh=1,1,1",
            f"train.ckpt_every={args.sft_steps}", "train.weight_decay=0"]


def check_runs(args: argparse.Namespace) -> None:
    """``arg_types.check_runs`` of every run the benchmark will start."""
    here = Path("unused")
    runs = []
    if "learn" not in args.skip:
        runs += [("finetune", sft_overrides(here, here, args)),
                 ("grpo", grpo_overrides(here, here, here, args.steps, args, args.lr, args.steps))]
    if "speed" not in args.skip:
        runs.append(("grpo", grpo_overrides(here, here, here, args.speed_steps, args, args.lr,
                                            10**6)))
    arg_types.check_runs(*runs)


class Stopped(Exception):
    """One of the benchmark's runs was stopped by SIGTERM/SIGINT (``RunSummary.interrupted``)."""

    def __init__(self, what: str, summary: Any, planned: int, records: list[dict]) -> None:
        super().__init__(f"{what} stopped by {summary.interrupted} after "
                         f"{summary.final_step} of {planned} steps")
        self.what, self.summary, self.records = what, summary, records


def train(preset: str, overrides: list[str], what: str, planned: int) -> list[dict]:
    """``train.run`` of ``preset`` with ``overrides``; its metrics records.

    Raises:
      Stopped: the run was stopped by a signal (a checkpoint of its last step saved).
    """
    from transformer_jax.train.config import build_configs
    from transformer_jax.train.run import run

    model, train_config, data = build_configs(preset, overrides)
    summary = run(model, train_config, data, progress=False)
    records = [json.loads(line) for line in
               (Path(train_config.run_dir) / "metrics.jsonl").read_text().splitlines()]
    if summary.interrupted:
        raise Stopped(what, summary, planned, records)
    return records


def ours(model_dir: Path, prompts: Path, run_dir: Path, steps: int, args: argparse.Namespace,
         lr: float, ckpt_every: int, what: str = "GRPO") -> list[dict]:
    """Our GRPO run from ``model_dir``; its metrics records (``Stopped`` by a signal)."""
    return train("grpo", grpo_overrides(model_dir, prompts, run_dir, steps, args, lr, ckpt_every),
                 what, steps)


def trl_step_times(model_dir: Path, records: list[dict], args: argparse.Namespace,
                   out_dir: Path) -> list[float]:
    """Seconds of each ``GRPOTrainer.train()`` step on the same prompts and settings."""
    import datasets
    import torch
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(args.seed)
    times: list[float] = []

    class Timer(transformers.TrainerCallback):
        def on_step_begin(self, *unused, **unused_kw):
            self.start = time.perf_counter()

        def on_step_end(self, *unused, **unused_kw):
            times.append(time.perf_counter() - self.start)

    def reward(completions, answer, **unused):
        return [exact_match(c[0]["content"], {"answer": a})
                for c, a in zip(completions, answer, strict=True)]

    dataset = datasets.Dataset.from_list([{"prompt": r["messages"], "answer": r["answer"]}
                                          for r in records])
    config = GRPOConfig(
        output_dir=str(out_dir),
        per_device_train_batch_size=args.prompts * args.group // args.grad_accum,
        num_generations=args.group, max_completion_length=args.max_tokens, temperature=1.0,
        beta=args.beta, epsilon=0.2, loss_type="dapo", learning_rate=args.lr,
        lr_scheduler_type="constant", warmup_steps=0, max_steps=args.speed_steps,
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=args.seed,
        gradient_accumulation_steps=args.grad_accum, steps_per_generation=args.grad_accum,
        num_iterations=1, disable_tqdm=True, dataloader_num_workers=0)
    trainer = GRPOTrainer(
        model=transformers.AutoModelForCausalLM.from_pretrained(model_dir),
        reward_funcs=[reward], args=config, train_dataset=dataset,
        processing_class=transformers.AutoTokenizer.from_pretrained(model_dir), callbacks=[Timer()])
    trainer.train()
    return times


#: What ``--skip`` may name.
PHASES = ("learn", "speed")


def phases(text: str) -> set[str]:
    """A type: comma-separated ``PHASES`` (or none)."""
    names = {p.strip() for p in text.split(",") if p.strip()}
    unknown = sorted(names - set(PHASES))
    if unknown:
        raise argparse.ArgumentTypeError(f"must be comma-separated phases among "
                                         f"{', '.join(PHASES)}, got {', '.join(unknown)}")
    return names


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's arguments, each checked when parsed (``bench.args``)."""
    parser = arg_types.parser("grpo", __doc__)
    positive, rate = arg_types.positive_int, arg_types.positive_float()
    parser.add_argument("--max-operand", type=positive, default=10)
    parser.add_argument("--sft-steps", type=positive, default=60)
    parser.add_argument("--sft-lr", type=rate, default=3e-3)
    parser.add_argument("--steps", type=positive, default=600,
                        help="GRPO steps of the learning run")
    parser.add_argument("--lr", type=rate, default=5e-4)
    parser.add_argument("--prompts", type=positive, default=32, help="prompts per step")
    parser.add_argument("--group", type=arg_types.int_at_least(2), default=8, help="G")
    parser.add_argument("--max-tokens", type=positive, default=4)
    parser.add_argument("--beta", type=float, default=0.04)
    parser.add_argument("--warmup", type=arg_types.nonnegative_int, default=10,
                        help="GRPO lr warmup steps")
    parser.add_argument("--width", type=positive, default=64, help="a multiple of 4 (heads)")
    parser.add_argument("--layers", type=positive, default=2)
    parser.add_argument("--eval-samples", type=positive, default=16)
    parser.add_argument("--speed-steps", type=arg_types.int_at_least(2), default=8,
                        help="the first (compiling) step is left out of the timing")
    parser.add_argument("--grad-accum", type=positive, default=1,
                        help="micro-batches per update, ours and TRL's alike (one generation "
                             "of the whole batch per step either way)")
    parser.add_argument("--rounds", type=positive, default=2,
                        help="speed: run ours and TRL this many times each, alternating")
    parser.add_argument("--seed", type=arg_types.nonnegative_int, default=0)
    parser.add_argument("--skip", type=phases, default=set(),
                        help=f"comma-separated phases to skip: {', '.join(PHASES)}")
    parser.add_argument("--dir", default="", help="work directory (default: a temporary one)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark; prints the figures. A run stopped by SIGTERM/SIGINT ends it there: the
    steps that ran are reported and the exit status is 128 + the signal's number."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.width % 4 or args.width // 4 % 2:
        parser.error(f"argument --width: must be a multiple of 8 (4 heads of an even size), got "
                     f"{args.width}")
    if args.prompts * args.group % args.grad_accum:
        parser.error(f"argument --grad-accum: must divide the batch, --prompts x --group = "
                     f"{args.prompts * args.group}, got {args.grad_accum}")
    try:
        check_runs(args)
    except ValueError as e:  # ConfigError: the setting named
        parser.error(" ".join(str(e).split()))
    logging.basicConfig(level=logging.WARNING)
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench_grpo_"))
    root.mkdir(parents=True, exist_ok=True)
    result: dict = {}
    try:
        return measure(args, root, result)
    except Stopped as e:
        print(f"{e}; the benchmark stops here")
        if e.what == "GRPO":
            curve = [round(m["reward_mean"], 3) for m in e.records if "reward_mean" in m]
            print(f"rollout reward per step: {curve}")
            result.update(steps=e.summary.final_step, curve=curve)
        result.update(interrupted=e.summary.interrupted, stopped_in=e.what,
                      stopped_at_step=e.summary.final_step)
        print(json.dumps(result))
        return 128 + signal.Signals[e.summary.interrupted].value


def measure(args: argparse.Namespace, root: Path, result: dict) -> int:
    """The benchmark's phases (``main``'s), filling ``result``."""
    write_model(root / "hf", args)
    sft_file, prompts, records = make_task(root, args.max_operand)
    print(f"task: {len(records)} prompts a+b= (a, b < {args.max_operand}), exact match; model "
          f"Llama {args.layers} layers x {args.width}, vocab 19, float32, CPU; GRPO "
          f"{args.prompts} prompts x G={args.group} per step, max {args.max_tokens} tokens, "
          f"temperature 1, beta {args.beta}, clip 0.2, token (DAPO) loss, lr {args.lr}")
    result.update({"prompts": len(records), "group": args.group, "batch": args.prompts *
                   args.group, "max_tokens": args.max_tokens})
    if "learn" not in args.skip:
        sft_s, _ = arg_types.timed(lambda: train("finetune", sft_overrides(root, sft_file, args),
                                                 "SFT", args.sft_steps))
        before = evaluate(root / "sft", prompts, args.eval_samples, args.max_tokens, 1)
        print(f"SFT {args.sft_steps} steps ({sft_s:.0f} s): reward sampled {before[0]:.3f}, "
              f"greedy {before[1]:.3f}")
        result.update(sft_steps=args.sft_steps, sft_s=round(sft_s, 1), reward_before=before[0],
                      greedy_before=before[1])
        grpo_s, metrics = arg_types.timed(lambda: ours(root / "sft", prompts, root / "grpo",
                                                       args.steps, args, args.lr, args.steps))
        after = evaluate(root / "grpo", prompts, args.eval_samples, args.max_tokens, 2)
        curve = [round(m["reward_mean"], 3) for m in metrics]
        print(f"GRPO {len(metrics)} steps ({grpo_s:.0f} s): reward sampled {before[0]:.3f} -> "
              f"{after[0]:.3f}, greedy {before[1]:.3f} -> {after[1]:.3f}")
        print(f"rollout reward per step: {curve}")
        refresh = [m["time/refresh_share"] for m in metrics[1:]]
        if refresh:
            print(f"weight refresh share of a step (steps 2+): median "
                  f"{100 * statistics.median(refresh):.2f}%, max {100 * max(refresh):.2f}%")
        gap = logprob_gap(root / "grpo", prompts, args)
        print(f"engine vs trainer log-probs (float32), largest gap over a rollout: {gap:.2e}")
        result.update(logprob_gap=gap, steps=len(metrics), grpo_s=round(grpo_s, 1),
                      reward_after=after[0], greedy_after=after[1], curve=curve,
                      refresh_share_median=statistics.median(refresh) if refresh else None)
    if "speed" not in args.skip:
        n = args.speed_steps
        our_times, trl_times, refresh, rollout, rounds = [], [], [], [], []
        for r in range(args.rounds):
            metrics = ours(root / "hf", prompts, root / f"speed{r}", n, args, args.lr, 10**6,
                           what=f"speed round {r + 1}")
            mine = [m["time/step_s"] for m in metrics[1:]]
            theirs = trl_step_times(root / "hf", records, args, root / f"trl{r}")[1:]
            refresh += [m["time/refresh_share"] for m in metrics[1:]]
            rollout += [m["time/rollout_share"] for m in metrics[1:]]
            rounds.append(statistics.median(theirs) / statistics.median(mine))
            print(f"round {r + 1}: ours {statistics.median(mine):.3f} s/step, TRL "
                  f"{statistics.median(theirs):.3f} s/step (medians of {len(mine)} and "
                  f"{len(theirs)} steps); ratio {rounds[-1]:.2f}; load average "
                  f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
            our_times += mine
            trl_times += theirs
        ours_rate = 60 / statistics.median(our_times)
        trl_rate = 60 / statistics.median(trl_times)
        print(f"speed ({args.rounds} rounds of {n} steps each, first left out; batch "
              f"{args.prompts * args.group}; median step): ours {ours_rate:.1f} steps/min "
              f"({statistics.median(our_times):.3f} s/step: rollout "
              f"{100 * np.mean(rollout):.0f}%, refresh {100 * np.mean(refresh):.2f}%), TRL "
              f"GRPOTrainer {trl_rate:.1f} steps/min ({statistics.median(trl_times):.3f} "
              f"s/step, fastest {min(trl_times):.3f}); ratio {ours_rate / trl_rate:.2f}")
        result.update(ours_steps_per_min=ours_rate, trl_steps_per_min=trl_rate,
                      ratio=ours_rate / trl_rate, round_ratios=rounds,
                      speed_refresh_share=float(np.mean(refresh)))
    print(json.dumps(result))
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
