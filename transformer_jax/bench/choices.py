"""What ``n`` choices of one request cost in the serving engine, against one choice.

Each round times one prompt as 1 request, then a fresh one as ``--n`` requests with forks (the
choices share the prompt's prefill) and without (each prefills what the prefix cache lacks), in
alternating order; prints the medians and the ratios to one choice, per prompt length.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import jax
import numpy as np

from transformer_jax import decode
from transformer_jax.bench import args as a
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.transformer import init_params
from transformer_jax.serving import Engine, SamplingParams


def build_parser() -> argparse.ArgumentParser:
    p = a.parser("choices", __doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=a.model_config, default="decode_25m",
                   help="model preset (random weights)")
    p.add_argument("--prompt-lens", type=a.int_list(1), default=[256, 512],
                   help="comma-separated prompt lengths")
    p.add_argument("--n", type=a.int_at_least(2), default=4, help="choices per request")
    p.add_argument("--max-tokens", type=a.positive_int, default=1, help="tokens per choice")
    p.add_argument("--rounds", type=a.positive_int, default=5, help="timed rounds (median taken)")
    p.add_argument("--slots", type=a.positive_int, default=8)
    p.add_argument("--page-size", type=a.positive_int, default=16)
    p.add_argument("--token-budget", type=a.positive_int, default=None,
                   help="default: slots + the longest prompt (one chunk per prompt)")
    p.add_argument("--seed", type=a.nonnegative_int, default=0)
    p.add_argument("--json", type=a.output_file, default=None,
                   help="also write the results to this file")
    return p


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace,
               config: ModelConfig) -> None:
    """Refuses (``parser.error``) what the engine would refuse after the weights are made: more
    choices than slots, a budget of no more than the slots, prompts beyond ``max_seq_len``."""
    if args.n > args.slots:
        parser.error(f"argument --n: must be <= --slots ({args.slots}), got {args.n}")
    if args.token_budget is not None and args.token_budget <= args.slots:
        parser.error(f"argument --token-budget: must exceed --slots ({args.slots}): each step "
                     f"decodes one token per slot, got {args.token_budget}")
    need = max(args.prompt_lens) + args.max_tokens
    if need > config.max_seq_len:
        parser.error(f"argument --prompt-lens: the longest prompt ({max(args.prompt_lens)}) "
                     f"and --max-tokens ({args.max_tokens}) need {need} positions, more than "
                     f"{args.config}'s max_seq_len {config.max_seq_len}")


def _timed(engine: Engine, prompt: list[int], n: int, max_tokens: int, seed: int) -> float:
    start = time.perf_counter()
    for i in range(n):
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=1.0,
                                                  seed=seed + i))
    engine.run_until_idle(max_steps=n * (len(prompt) + max_tokens + 1))
    if not engine.idle:
        raise RuntimeError(f"not idle after the step limit: {engine.scheduler.describe()}")
    return time.perf_counter() - start


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    lengths = args.prompt_lens
    config = ModelConfig.preset(args.config)
    check_args(parser, args, config)
    weights = decode.prepare(config, init_params(config, jax.random.key(args.seed)))
    longest = max(lengths)
    budget = args.token_budget or args.slots + longest
    pages = 1 + args.slots * -(-(longest + args.max_tokens) // args.page_size)
    engine = Engine(config, weights, num_slots=args.slots, num_pages=pages,
                    page_size=args.page_size, token_budget=budget)
    rng = np.random.default_rng(args.seed)
    result: dict[str, Any] = {"config": args.config, "dtype": config.dtype,
                              "backend": jax.default_backend(), "args": vars(args), "lengths": {}}
    print(f"{args.config} ({config.dtype}, {jax.default_backend()}): n={args.n}, max_tokens "
          f"{args.max_tokens}, {args.slots} slots, pages of {args.page_size}, budget {budget}, "
          f"median of {args.rounds}")
    for length in lengths:
        times: dict[str, list[float]] = {"one": [], "forks": [], "no_forks": []}
        for r in range(args.rounds + 1):  # round 0 compiles the programs (not timed)
            prompts = rng.integers(0, config.vocab_size, (3, length)).tolist()
            got = {"one": _timed(engine, prompts[0], 1, args.max_tokens, r)}
            for name in (("forks", "no_forks") if r % 2 else ("no_forks", "forks")):
                engine.scheduler.forks = name == "forks"
                got[name] = _timed(engine, prompts[1 + (name == "forks")], args.n,
                                   args.max_tokens, r)
            engine.scheduler.forks = True
            if r:
                for name, t in got.items():
                    times[name].append(t)
        med = {name: statistics.median(t) for name, t in times.items()}
        result["lengths"][length] = {**{f"{k}_s": v for k, v in med.items()},
                                     "forks_ratio": med["forks"] / med["one"],
                                     "no_forks_ratio": med["no_forks"] / med["one"]}
        print(f"prompt {length}: one choice {med['one'] * 1e3:.1f} ms; n={args.n} with forks "
              f"{med['forks'] * 1e3:.1f} ms ({med['forks'] / med['one']:.2f}x), without "
              f"{med['no_forks'] * 1e3:.1f} ms ({med['no_forks'] / med['one']:.2f}x)")
    engine.check_no_leaks()
    result["forked"] = engine.scheduler.forked  # (n - 1) per timed run with forks
    a.write_json(args.json, result)
    return 0
