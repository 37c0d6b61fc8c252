"""Serving benchmark: ``transformer-jax bench serve --config NAME``.

Serves random requests (all at once, or Poisson or gamma arrivals) with the ``serving.Engine``
and, in the same run, with ``generate`` one request at a time and in fixed batches. It reports
TTFT, TPOT, ITL and E2E latency (mean, median, p99) and throughputs, and for the engine its
peaks and where its steps' time went. Programs compile before the clock starts; outputs are
greedy with no stop token, so each request makes its drawn number of tokens in every mode.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
from typing import Any

import jax
import numpy as np

from transformer_jax.bench import args as args_lib
from transformer_jax.bench import serve_stall, serve_structured
from transformer_jax.bench.serve_workload import (
    Workload,
    make_workload,
    summarize,
    text_repeat_prompts,
)
from transformer_jax.decode import generation
from transformer_jax.decode import loop as decode
from transformer_jax.decode import prompts as prompt_lib
from transformer_jax.decode.speculative import parse_spec
from transformer_jax.decode.speculative_mtp import check_mtp
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.kv_cache import cache_bytes
from transformer_jax.model.transformer import init_params
from transformer_jax.serving import Engine, SamplingParams
from transformer_jax.serving import step_times as step_times_lib


def _wait_until(t: float) -> None:
    delay = t - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def run_engine(engine: Engine, work: Workload, grammars: list[Any] | None = None,
               speculative: str | None = None) -> dict[str, Any]:
    """Serves ``work`` with the engine in real time; token times from its consumers. Request i
    uses LoRA adapter i mod N of ``engine.adapter_names`` (if any) and draws under ``grammars[i]``
    (with ``grammars``); with ``speculative``, every request speculates so."""
    records = [{"arrival": a, "times": []} for a in work.arrivals]
    order = sorted(range(len(records)), key=lambda i: work.arrivals[i])
    peak_running = peak_pages = 0
    start = time.perf_counter()
    nxt = 0
    while nxt < len(order) or not engine.idle:
        now = time.perf_counter() - start
        while nxt < len(order) and work.arrivals[order[nxt]] <= now:
            i = order[nxt]
            names = engine.adapter_names
            engine.add_request(work.prompts[i], SamplingParams(
                max_tokens=work.max_tokens[i], adapter=names[i % len(names)] if names else None,
                grammar=None if grammars is None else grammars[i], speculative=speculative),
                               lambda e, r=records[i]: r["times"].append(time.perf_counter()))
            nxt += 1
        if engine.idle:
            _wait_until(start + work.arrivals[order[nxt]])
            continue
        ran = engine.steps
        engine.step()
        sched = engine.scheduler
        if engine.steps == ran and not sched.idle:  # a stuck engine fails, it does not spin
            raise RuntimeError(f"the engine cannot make progress: {sched.describe()}")
        peak_running = max(peak_running, len(sched.running) + len(sched.prefilling))
        peak_pages = max(peak_pages, engine.pages_in_use)
    out = summarize(records, start)
    out.update(records=records, peak_running=peak_running, peak_pages=peak_pages,
               steps=engine.steps, rounds=engine.multistep.rounds,
               round_tokens=engine.multistep.round_tokens, lagged=engine.overlap.lagged,
               discarded=engine.overlap.discarded, preemptions=engine.scheduler.preemptions,
               prefix_hit_pages=engine.scheduler.prefix.hits,
               step_times=engine.step_times.summary())
    if speculative:
        out["speculative"] = engine.speculation.metrics()
    return out


def run_fixed_batches(config: ModelConfig, weights: decode.DecodeWeights, work: Workload,
                      batch: int) -> dict[str, Any]:
    """``generate`` on batches of ``batch`` requests in arrival order, each once its last request
    has arrived (``batch`` 1: each request alone)."""
    records = [{"arrival": a, "times": []} for a in work.arrivals]
    order = sorted(range(len(records)), key=lambda i: work.arrivals[i])
    start = time.perf_counter()
    for group in _batches(order, batch):
        _wait_until(start + max(work.arrivals[i] for i in group))

        def stream(step: int, tokens: np.ndarray, active: np.ndarray, group=group) -> None:
            now = time.perf_counter()  # each step's host time, for the rows that want it
            for i in group:
                if step < work.max_tokens[i]:
                    records[i]["times"].append(now)

        generation.generate(config, weights, [work.prompts[i] for i in group],
                            max_new_tokens=max(work.max_tokens[i] for i in group),
                            stream=stream)
    return summarize(records, start)


def _batches(order: list[int], batch: int) -> list[list[int]]:
    return [order[i:i + batch] for i in range(0, len(order), batch)]


def compile_generate(config: ModelConfig, weights: decode.DecodeWeights, work: Workload,
                     batch: int) -> int:
    """Runs ``generate`` once on every (batch, prompt bucket, new tokens) shape the baselines
    will run, so their timed runs do not compile; returns the number of shapes."""
    shapes = set()
    order = sorted(range(len(work.prompts)), key=lambda i: work.arrivals[i])
    for group in _batches(order, 1) + _batches(order, batch):
        longest = max(len(work.prompts[i]) for i in group)
        shapes.add((len(group), prompt_lib.prompt_bucket(longest),
                    max(work.max_tokens[i] for i in group)))
    for b, bucket, n in sorted(shapes):
        generation.generate(config, weights, [[0] * bucket] * b, max_new_tokens=n,
                            stream=lambda *_: None)
    return len(shapes)


def _line(name: str, r: dict[str, Any]) -> str:
    ms = {k: r[k] for k in ("ttft_s", "tpot_s", "itl_s", "e2e_s")}
    cells = "  ".join(f"{k[:-2].upper()} {v['mean'] * 1e3:7.1f}/{v['median'] * 1e3:7.1f}/"
                      f"{v['p99'] * 1e3:7.1f}" for k, v in ms.items())
    return (f"{name:<16} {r['output_token_throughput']:8.1f} tok/s  "
            f"{r['request_throughput']:6.2f} req/s  {cells}")


MODES = ("engine", "engine-sync", "engine-noprefix", "engine-lora", "engine-json",
         "engine-json-mixed", "engine-spec", "one", "batch", "http")


def random_adapters(config: ModelConfig, params: Any, n: int, rank: int, seed: int
                    ) -> dict[str, Any]:
    """``n`` LoRA adapters of rank ``rank`` on every dense matrix, with B random (as trained)."""
    from transformer_jax.model import lora

    out = {}
    cfg = lora.LoraConfig(rank=rank, alpha=2.0 * rank)
    for i in range(n):
        tree = lora.init_adapters(config, cfg, params, jax.random.key(seed + i + 1))
        leaves, tree_def = jax.tree.flatten(tree)
        keys = jax.random.split(jax.random.key(seed + 1000 + i), len(leaves))
        out[f"lora{i}"] = (jax.tree.unflatten(tree_def, [
            x + 0.02 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys,
                                                                          strict=True)]), cfg)
    return out


def build_parser() -> argparse.ArgumentParser:
    """The arguments, each checked by its type as it is parsed."""
    a = args_lib
    parser = a.parser("serve", __doc__)
    parser.add_argument("--config", type=a.model_config, default="decode_25m",
                        help="preset name or TOML path")
    parser.add_argument("--requests", type=a.positive_int, default=48)
    parser.add_argument("--input-len", type=a.int_range, default=(16, 256), metavar="MIN,MAX")
    parser.add_argument("--output-len", type=a.int_range, default=(16, 64), metavar="MIN,MAX")
    parser.add_argument("--output-multiple", type=a.positive_int, default=16,
                        help="round output lengths up to a multiple (fewer generate shapes)")
    parser.add_argument("--rate", type=a.positive_float(allow_inf=True), default=math.inf,
                        help="requests per second (inf: all at once)")
    parser.add_argument("--burstiness", type=a.positive_float(), default=1.0,
                        help="gamma shape of the arrival gaps (1: Poisson)")
    parser.add_argument("--shared-prefix", type=a.nonnegative_int, default=0,
                        help="tokens every prompt starts with")
    parser.add_argument("--slots", type=a.positive_int, default=8)
    parser.add_argument("--page-size", type=a.positive_int, default=16)
    parser.add_argument("--pages", type=a.nonnegative_int, default=0,
                        help="pages in the pool (0: enough for every slot at its longest)")
    parser.add_argument("--token-budget", type=a.positive_int, default=264)
    parser.add_argument("--multi-steps", type=a.positive_int, default=1,
                        help="the engine's most decode steps per host round (serving.multistep)")
    parser.add_argument("--modes", default=None,
                        help="comma list of engine, one (generate one at a time), batch "
                             "(generate in fixed batches), engine-sync (no lagged steps), "
                             "engine-noprefix, engine-lora, engine-json (every request under "
                             "--response-format), engine-json-mixed (every other one), http "
                             "(the server at --url) (default: engine,one,batch; http with --url)")
    parser.add_argument("--speculative", default=None, metavar="SPEC",
                        help="the engine-spec mode's speculation, e.g. ngram:k=4, draft:PATH:k=4 "
                             "or mtp (added to the modes when given)")
    parser.add_argument("--workload", choices=("random", "repeat"), default="random",
                        help="repeat: input-heavy prompts, each a random passage then its "
                             "first --lead tokens again, so the output can copy the input")
    parser.add_argument("--lead", type=a.positive_int, default=8)
    parser.add_argument("--text", type=a.existing_file, default=None, metavar="FILE",
                        help="with --workload repeat and a --checkpoint: cut the passages from "
                             "this text, each followed by a blank line and its first --lead "
                             "tokens with one changed (bench speculative's repeat prompts)")
    parser.add_argument("--checkpoint", default=None,
                        help="serve a trained checkpoint instead of random weights of --config")
    parser.add_argument("--lora", type=a.positive_int, default=4, metavar="N",
                        help="the engine-lora mode's adapters: requests take them in turn")
    parser.add_argument("--lora-rank", type=a.positive_int, default=16)
    parser.add_argument("--response-format", default=None, metavar="json_object|SCHEMA",
                        help="the engine-json modes' grammar: json_object, a JSON schema file "
                             "or inline JSON (default: an array of --output-len's maximum words)")
    parser.add_argument("--tokenizer", type=a.existing_dir, default=None, metavar="DIR",
                        help="the engine-json modes' HF tokenizer (default: a byte-level BPE "
                             "made here, padded to the model's vocabulary)")
    parser.add_argument("--url", type=a.server_url, help="a running server (transformer-jax "
                        "serve) serving a model of --config's vocabulary, for the http mode")
    parser.add_argument("--api-key", help="the server's API key, if it has one")
    parser.add_argument("--http-prompts", choices=("ids", "text"), default="ids",
                        help="the http mode's prompts: token ids (with ignore_eos and usage per "
                             "chunk) or text from --checkpoint's tokenizer (OpenAI's fields "
                             "only, tokens counted by text: transformers serve; serve_http.py)")
    parser.add_argument("--seed", type=a.nonnegative_int, default=0)
    parser.add_argument("--json", type=a.output_file, default=None,
                        help="write the results to this file")
    parser.add_argument("--scenario", choices=("load", "stall"), default="load",
                        help="load: the requests above in every mode; stall: --slots sequences "
                             "decoding when a --long-prompt arrives, chunked and unchunked")
    parser.add_argument("--long-prompt", type=a.positive_int, default=900,
                        help="the stall scenario's long prompt, in tokens")
    return parser


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace,
               config: ModelConfig) -> list[str]:
    """Exits with an argparse error for values that do not fit together or the model; returns the
    modes to run."""
    if args.scenario == "stall":
        if args.long_prompt + 1 > config.max_seq_len:
            parser.error(f"--long-prompt {args.long_prompt} + its token must fit the model's "
                         f"max_seq_len {config.max_seq_len}")
        if args.token_budget <= args.slots + 1:
            parser.error(f"--token-budget {args.token_budget} must exceed --slots + 1 = "
                         f"{args.slots + 1} (the stall scenario's sequences)")
        return []
    modes = (args.modes or ("http" if args.url else "engine,one,batch")).split(",")
    if args.speculative:
        try:
            spec = parse_spec(args.speculative)
            if spec.method == "mtp":  # the model's own module (tiny presets have none)
                check_mtp(config, spec.k)
        except ValueError as e:
            parser.error(str(e))
        if "engine-spec" not in modes:
            modes.append("engine-spec")
        if "engine" not in modes:
            modes.insert(0, "engine")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"--modes: unknown mode(s) {', '.join(map(repr, unknown))}; choose from "
                     f"{', '.join(MODES)}")
    if "http" in modes and not args.url:
        parser.error("the http mode needs --url")
    if "http" in modes and args.http_prompts == "text" and not args.checkpoint:
        parser.error("--http-prompts text needs --checkpoint (its tokenizer)")
    if args.shared_prefix > args.input_len[0]:
        parser.error(f"--shared-prefix {args.shared_prefix} must be at most the shortest "
                     f"--input-len {args.input_len[0]} (prompts include it)")
    out_hi = -(-args.output_len[1] // args.output_multiple) * args.output_multiple
    longest = args.input_len[1] + out_hi
    if longest > config.max_seq_len:
        parser.error(f"--input-len max {args.input_len[1]} + --output-len max {out_hi} "
                     f"(rounded to --output-multiple) = {longest} exceeds the model's "
                     f"max_seq_len {config.max_seq_len}")
    if args.text and (args.workload != "repeat" or not args.checkpoint):
        parser.error("--text makes the repeat workload's prompts with a checkpoint's tokenizer: "
                     "it needs --workload repeat and --checkpoint")
    if any(m.startswith("engine") for m in modes):
        if args.token_budget <= args.slots:
            parser.error(f"--token-budget {args.token_budget} must exceed --slots "
                         f"{args.slots} (one decode token per slot, the rest prefills)")
        if args.pages and args.pages - 1 < -(-longest // args.page_size):
            parser.error(f"--pages {args.pages} cannot hold the longest request ({longest} "
                         f"positions = {-(-longest // args.page_size)} pages of "
                         f"{args.page_size}, plus the null page)")
    if "http" in modes:
        _check_server(parser, args, longest)
    if any(m.startswith("engine-json") for m in modes):
        try:
            args.grammar = serve_structured.grammar_of(args.response_format, out_hi)
        except (OSError, ValueError) as e:
            parser.error(f"--response-format: {e}")
    return modes


def _check_server(parser: argparse.ArgumentParser, args: argparse.Namespace,
                  longest: int) -> None:
    """The server at ``--url`` answers ``/v1/models`` and its model fits the workload."""
    import httpx

    from transformer_jax.bench.serve_http import served_model

    try:
        model = served_model(args.url, args.api_key)
    except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError) as e:
        parser.error(f"--url {args.url}: GET /v1/models failed: {' '.join(str(e).split())}")
    if model.get("max_model_len", longest) < longest:
        parser.error(f"--url {args.url}: the workload needs up to {longest} positions; the "
                     f"served model has {model['max_model_len']}")


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    loaded = None
    if args.checkpoint:
        from transformer_jax.checkpoint.loading import load

        loaded = load(args.checkpoint)
        config = loaded.config
    else:
        config = ModelConfig.preset(args.config)
    modes = check_args(parser, args, config)
    if args.scenario == "stall":
        weights = decode.prepare(config, init_params(config, jax.random.key(args.seed)))
        stall = serve_stall.run_both(config, weights, slots=args.slots,
                                     token_budget=args.token_budget, page_size=args.page_size,
                                     long_prompt=args.long_prompt, seed=args.seed)
        args_lib.write_json(args.json, {"config": args.config, "dtype": config.dtype,
                                        "backend": jax.default_backend(), "stall": stall})
        return 0
    work = make_workload(args.requests, args.input_len, args.output_len, args.output_multiple,
                         args.rate, args.burstiness, config.vocab_size, args.seed,
                         args.shared_prefix)
    if args.workload == "repeat":
        rng = np.random.default_rng(args.seed + 1)
        if args.text:
            try:
                work.prompts = text_repeat_prompts(loaded.tokenizer, args.text,
                                                   [len(q) for q in work.prompts], args.lead, rng)
            except ValueError as e:
                parser.error(str(e))
        else:
            work.prompts = [p + p[:args.lead] for p in
                            (rng.integers(0, config.vocab_size,
                                          max(1, len(q) - args.lead)).tolist()
                             for q in work.prompts)]
    params = None if modes == ["http"] else (
        loaded.params if loaded is not None else init_params(config, jax.random.key(args.seed)))
    weights = None if params is None else decode.prepare(config, params)
    longest = max(len(p) + n for p, n in zip(work.prompts, work.max_tokens, strict=True))
    pages = args.pages or 1 + args.slots * -(-longest // args.page_size)
    result: dict[str, Any] = {
        "config": args.config, "dtype": config.dtype, "device": jax.devices()[0].device_kind,
        "backend": jax.default_backend(), "host": platform.node(), "load_avg": os.getloadavg(),
        "args": {k: str(v) if isinstance(v, float) and math.isinf(v) else v
                 for k, v in vars(args).items() if k != "grammar"},  # not JSON; its flag is
        "pages": pages, "modes": {}}
    print(f"{args.checkpoint or args.config} ({config.dtype}, {jax.default_backend()}): "
          f"{args.requests} requests, inputs {args.input_len}, outputs {args.output_len}, rate "
          f"{args.rate}/s; {args.slots} slots, {pages} pages of {args.page_size}, budget "
          f"{args.token_budget}")
    # With the structured modes every engine mode detokenizes its tokens as they need to.
    tokenizer = None if not any(m.startswith("engine-json") for m in modes) else \
        serve_structured.bench_tokenizer(config.vocab_size, args.tokenizer)
    for mode in modes:
        if mode.startswith("engine"):
            adapters = None if mode != "engine-lora" else random_adapters(
                config, params, args.lora, args.lora_rank, args.seed)
            spec = parse_spec(args.speculative) if mode == "engine-spec" else None
            engine = Engine(config, weights, args.slots, pages, args.page_size,
                            args.token_budget, prefix_caching=mode != "engine-noprefix",
                            adapters=adapters, tokenizer=tokenizer,
                            overlap=mode != "engine-sync",
                            draft=spec.draft if spec and spec.method == "draft" else None)
            engine.multistep.max_steps = args.multi_steps
            if spec and spec.method == "mtp":  # the module's pages, before compile
                engine.speculation.enable_mtp()
            grammars = None
            if mode.startswith("engine-json"):
                every = 2 if mode == "engine-json-mixed" else 1
                grammars = [args.grammar if i % every == 0 else None
                            for i in range(len(work.prompts))]
            t = time.perf_counter()
            n = engine.compile(structured=mode.startswith("engine-json"),
                               speculative=spec.k if spec else 0)
            m = engine.multistep.compile()  # the greedy rounds
            print(f"  compiled {n} engine step shapes and {m} multi-step rounds in "
                  f"{time.perf_counter() - t:.1f} s")
            engine.steps = engine.multistep.rounds = engine.multistep.round_tokens = 0
            engine.overlap.lagged = engine.overlap.discarded = 0
            engine.step_times.reset()
            r = run_engine(engine, work, grammars,
                           args.speculative if mode == "engine-spec" else None)
            if mode == "engine-json-mixed":
                free = [rec for rec, g in zip(r.pop("records"), grammars, strict=True)
                        if g is None]
                r["unconstrained_tpot_median_s"] = float(np.median(
                    [(t[-1] - t[0]) / (len(t) - 1) for t in (x["times"] for x in free)
                     if len(t) > 1]))
            else:
                r.pop("records")
            contiguous = (pages - 1) * args.page_size // config.max_seq_len
            # The same pages with every layer global (no rings for the local layers).
            all_global = cache_bytes(config, 1, pages * args.page_size, window_rings=False)
            r.update(cache_bytes=engine.cache_bytes, contiguous_slots_same_memory=contiguous,
                     cache_bytes_all_global=all_global)
        elif mode == "http":
            from transformer_jax.bench.serve_http import run_http

            r = run_http(args.url, work, args.api_key, tokenizer=loaded.tokenizer
                         if args.http_prompts == "text" else None)
        else:  # one or batch (check_args accepts only MODES)
            t = time.perf_counter()
            n = compile_generate(config, weights, work, args.slots)
            if mode == "one":
                print(f"  compiled {n} generate shapes in {time.perf_counter() - t:.1f} s")
            r = run_fixed_batches(config, weights, work, 1 if mode == "one" else args.slots)
        result["modes"][mode] = r
        print(_line(mode, r))
        if mode.startswith("engine"):
            print(f"{'':16} peak {r['peak_running']} running, {r['peak_pages']} of {pages - 1} "
                  f"pages; contiguous slots of the same memory: "
                  f"{r['contiguous_slots_same_memory']}; {r['steps']} steps ({r['rounds']} "
                  f"multi-step rounds: {r['round_tokens']} tokens; {r['lagged']} lagged, "
                  f"{r['discarded']} tokens discarded), "
                  f"{r['preemptions']} preemptions, {r['prefix_hit_pages']} prefix-hit pages; "
                  f"KV {r['cache_bytes'] / 2 ** 20:.1f} MiB, "
                  f"{r['cache_bytes'] / r['cache_bytes_all_global']:.3f}x every layer global")
            for line in step_times_lib.table(r["step_times"]):
                print(f"{'':16} {line}")
    got = result["modes"]

    def tput(a: str, b: str) -> float:  # mode a's output tokens/s over mode b's
        return got[a]["output_token_throughput"] / got[b]["output_token_throughput"]

    if "engine" in got:
        if "engine-lora" in got:
            print(f"engine-lora vs engine: {tput('engine-lora', 'engine'):.2f}x output tokens/s "
                  f"({args.lora} adapters of rank {args.lora_rank} mixed, against the base alone)")
        if "engine-spec" in got:
            tpot = got["engine"]["tpot_s"]["median"] / got["engine-spec"]["tpot_s"]["median"]
            m = got["engine-spec"]["speculative"]
            print(f"engine-spec vs engine: {tput('engine-spec', 'engine'):.2f}x output tokens/s, "
                  f"{tpot:.2f}x lower median TPOT ({args.speculative}: acceptance "
                  f"{m['acceptance_rate']:.2f}, {m['mean_accepted_length']:.2f} tokens per "
                  f"verification, {m['verify_steps']} verify steps, {m['backed_off_steps']} "
                  "backed off)")
        for other in ("one", "batch", "engine-noprefix", "engine-sync"):
            if other in got:
                ttft = got[other]["ttft_s"]["median"] / got["engine"]["ttft_s"]["median"]
                print(f"engine vs {other}: {tput('engine', other):.2f}x output tokens/s, "
                      f"{ttft:.2f}x lower median TTFT")
        for line in serve_structured.compare(got):
            print(line)
        if "http" in got:
            print(f"http vs engine: {tput('http', 'engine'):.2f}x the engine's output tokens/s "
                  "through the server")
    args_lib.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
