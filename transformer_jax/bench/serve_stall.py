"""The chunked-prefill scenario of ``bench serve --scenario stall``: a long prompt arriving
while a batch decodes, with chunked prefill and without; the running sequences' inter-token
latency while it prefills, against their median step before, and the long prompt's TTFT."""

from __future__ import annotations

import itertools
import statistics
import time
from typing import Any

import numpy as np

from transformer_jax.bench.args import timed
from transformer_jax.decode.loop import DecodeWeights
from transformer_jax.model.config import ModelConfig
from transformer_jax.serving import Engine, SamplingParams
from transformer_jax.serving.page_pool import pages_for


def run_stall(config: ModelConfig, weights: DecodeWeights, *, slots: int, token_budget: int,
              page_size: int, long_prompt: int, prompt_len: int = 32, warmup: int = 16,
              seed: int = 0) -> dict[str, Any]:
    """One run of the scenario with this token budget.

    Returns:
      {"median_step_s", "itl_p99_s", "itl_max_s", "p99_over_median", "max_over_median",
       "long_ttft_s", "prefill_steps", "token_budget"}.
    """
    rng = np.random.default_rng(seed)
    max_tokens = config.max_seq_len - prompt_len
    if long_prompt + 1 > config.max_seq_len:
        raise ValueError(f"the long prompt ({long_prompt} tokens) does not fit the model's "
                         f"max_seq_len {config.max_seq_len}")
    pages = 1 + slots * pages_for(prompt_len + max_tokens, page_size) + \
        pages_for(long_prompt + 1, page_size)
    engine = Engine(config, weights, slots + 1, pages, page_size, token_budget,
                    prefix_caching=False)
    engine.compile()
    times: dict[int, list[float]] = {}

    def record(event: Any) -> None:
        if event.token is not None:
            times.setdefault(event.request_id, []).append(time.perf_counter())

    running = [engine.add_request(rng.integers(0, config.vocab_size, prompt_len).tolist(),
                                  SamplingParams(max_tokens=max_tokens), record)
               for _ in range(slots)]
    steps: list[float] = []
    while min(len(times.get(r, ())) for r in running) < warmup:
        steps.append(timed(engine.step)[0])
    decode_steps = steps[-warmup // 2:]  # all rows decoding, no prompt in
    arrival = time.perf_counter()
    long_id = engine.add_request(rng.integers(0, config.vocab_size, long_prompt).tolist(),
                                 SamplingParams(max_tokens=1), record)
    prefill_steps = 0
    while long_id not in times:
        engine.step()
        prefill_steps += 1
    end = time.perf_counter()  # the step that gave its first token has delivered everything
    first = times[long_id][0]
    for r in running:
        engine.cancel(r)
    engine.run_until_idle()
    engine.check_no_leaks()
    # The running sequences' gaps that end while the long prompt is in, its first token's step
    # included (that step delivers the prompt's token first, then the decode rows').
    itl = sorted(b - a for r in running for a, b in itertools.pairwise(times[r])
                 if arrival < b <= end) or [0.0]
    median = statistics.median(decode_steps)
    p99 = itl[min(len(itl) - 1, int(np.ceil(0.99 * len(itl))) - 1)]
    return {"token_budget": token_budget, "median_step_s": median, "itl_p99_s": p99,
            "itl_max_s": itl[-1], "p99_over_median": p99 / median,
            "max_over_median": itl[-1] / median, "long_ttft_s": first - arrival,
            "prefill_steps": prefill_steps}


def run_both(config: ModelConfig, weights: DecodeWeights, *, slots: int, token_budget: int,
             page_size: int, long_prompt: int, seed: int = 0) -> dict[str, Any]:
    """The scenario chunked (``token_budget``) and unchunked, side by side, printed."""
    print(f"stall: {slots} sequences decoding, a {long_prompt}-token prompt arrives")
    result = {}
    for name, budget in (("chunked", token_budget), ("unchunked", slots + 1 + long_prompt)):
        r = run_stall(config, weights, slots=slots, token_budget=budget, page_size=page_size,
                      long_prompt=long_prompt, seed=seed)
        result[name] = r
        print(f"  {name:<9} budget {budget:5d}: median step {r['median_step_s'] * 1e3:6.1f} ms; "
              f"ITL while it prefills p99 {r['itl_p99_s'] * 1e3:6.1f} ms "
              f"({r['p99_over_median']:.2f}x), max {r['itl_max_s'] * 1e3:6.1f} ms "
              f"({r['max_over_median']:.2f}x); its TTFT {r['long_ttft_s'] * 1e3:6.1f} ms in "
              f"{r['prefill_steps']} steps")
    return result
