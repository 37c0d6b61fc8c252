"""The load of ``bench serve``: random requests and their arrivals, and the latency figures of
their token times (shared by the in-process modes and the HTTP client, ``serve_http.py``)."""

from __future__ import annotations

import dataclasses
import math
import statistics
from pathlib import Path
from typing import Any

import numpy as np


@dataclasses.dataclass
class Workload:
    """Requests to serve: prompts, their ``max_tokens`` and arrival offsets in seconds."""

    prompts: list[list[int]]
    max_tokens: list[int]
    arrivals: list[float]


def make_workload(n: int, input_len: tuple[int, int], output_len: tuple[int, int],
                  output_multiple: int, rate: float, burstiness: float, vocab: int,
                  seed: int, shared_prefix: int = 0) -> Workload:
    """n random requests; arrivals all at 0 (``rate`` inf) or with gamma(burstiness) gaps of
    mean 1/rate (burstiness 1 is Poisson); with ``shared_prefix`` every prompt starts with the
    same tokens (counted in its input length)."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, vocab, shared_prefix).tolist()
    prompts = [prefix + rng.integers(0, vocab, int(rng.integers(*input_len, endpoint=True))
                                     - shared_prefix).tolist() for _ in range(n)]
    outs = rng.integers(*output_len, size=n, endpoint=True)
    outs = [int(math.ceil(o / output_multiple) * output_multiple) for o in outs]
    if math.isinf(rate):
        arrivals = [0.0] * n
    else:
        gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), n)
        arrivals = np.cumsum(gaps).tolist()
    return Workload(prompts, outs, arrivals)


def summarize(records: list[dict[str, Any]], start: float) -> dict[str, Any]:
    """Latency percentiles and throughputs of the requests' records: ``{"arrival": offset,
    "times": its token times (absolute seconds)}``."""
    def stats(xs: list[float]) -> dict[str, float]:
        xs = sorted(xs) or [0.0]
        return {"mean": statistics.fmean(xs), "median": statistics.median(xs),
                "p99": xs[min(len(xs) - 1, math.ceil(0.99 * len(xs)) - 1)]}

    ttft, tpot, itl, e2e = [], [], [], []
    for r in records:
        t = r["times"]
        arrival = start + r["arrival"]
        ttft.append(t[0] - arrival)
        e2e.append(t[-1] - arrival)
        if len(t) > 1:
            tpot.append((t[-1] - t[0]) / (len(t) - 1))
            itl += np.diff(t).tolist()
    end = max(r["times"][-1] for r in records)
    tokens = sum(len(r["times"]) for r in records)
    return {"ttft_s": stats(ttft), "tpot_s": stats(tpot), "itl_s": stats(itl),
            "e2e_s": stats(e2e), "duration_s": end - start, "output_tokens": tokens,
            "request_throughput": len(records) / (end - start),
            "output_token_throughput": tokens / (end - start)}


def text_repeat_prompts(tokenizer: Any, path: str, lengths: list[int], lead: int, rng: Any
                        ) -> list[list[int]]:
    """Input-heavy prompts of the given lengths cut from the text at ``path``:
    ``speculative.repeat_workload``'s (a passage, a blank line, its first ``lead`` tokens with
    one changed), bos first when the tokenizer adds one (as ``generate`` encodes text)."""
    from transformer_jax.bench.speculative import workload_prompts
    from transformer_jax.tokenizer.prompt import adds_bos

    ids = np.asarray(tokenizer.encode(Path(path).read_text()), np.int64)
    sep = tokenizer.encode("\n\n")
    bos = tokenizer.bos_id if adds_bos(tokenizer) else None
    extra = lead + len(sep) + (bos is not None)
    prompts = []
    for n in lengths:
        passage = n - extra
        if passage < lead:
            raise ValueError(f"an input length of {n} leaves no passage of at least --lead "
                             f"{lead} tokens (the blank line and bos take {extra - lead})")
        if len(ids) <= passage:
            raise ValueError(f"--text {path}: {len(ids)} tokens, too short for passages of "
                             f"{passage}")
        prompts += workload_prompts("repeat", ids, 1, passage, lead, rng, sep, bos)
    return prompts
