"""What ``n`` choices of one request cost in the serving engine, against one choice.

Each round adds one prompt as 1 request, then a fresh prompt of the same length as ``--n``
requests (the server's ``n``: the same tokens, seeds ``seed + i``), and times each from adding
to idle; with ``--max-tokens 1`` (the default) that is the prefill and the first token. The
``n`` requests are timed twice per round, with the forks (``scheduler.Scheduler``: the choices
take the prompt's last chunk's logits and a copy of its partial page) and without (each choice
prefills the part after the full pages it finds in the prefix cache), in alternating order.
Prints the median time of each and the ratios to one choice, per prompt length.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import jax
import numpy as np

from transformer_jax import decode
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.transformer import init_params
from transformer_jax.serving import Engine, SamplingParams


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="transformer-jax bench choices", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="decode_25m", help="model preset (random weights)")
    p.add_argument("--prompt-lens", default="256,512", help="comma-separated prompt lengths")
    p.add_argument("--n", type=int, default=4, help="choices per request")
    p.add_argument("--max-tokens", type=int, default=1, help="tokens per choice")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (median taken)")
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--token-budget", type=int, default=None,
                   help="default: slots + the longest prompt (one chunk per prompt)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the results to this file")
    return p


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
    args = build_parser().parse_args(argv)
    lengths = [int(x) for x in args.prompt_lens.split(",")]
    if args.n < 2 or args.n > args.slots:
        raise SystemExit(f"--n must be in [2, --slots={args.slots}], got {args.n}")
    config = ModelConfig.preset(args.config)
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0
