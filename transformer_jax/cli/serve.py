"""``transformer-jax serve --checkpoint PATH``: an OpenAI-compatible HTTP server.

The port is bound first (a busy port fails at once, exit 1); then the checkpoint is loaded, the
``serving.Engine`` built from the flags and its step shapes compiled (through JAX's persistent
compilation cache), and only then served. SIGTERM (or Ctrl-C) lets the requests in flight
finish for ``--grace-period`` seconds, ends the rest (``finish_reason`` ``"abort"``) and exits 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path
from typing import Any

import uvicorn

from transformer_jax.cli.common import PROG, fail
from transformer_jax.decode.speculative import parse_spec
from transformer_jax.model.quant_spec import parse_quant
from transformer_jax.serve.limits import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES
from transformer_jax.serve.server import DrainingServer, is_loopback, listen, url_of

# The engine, the checkpoint loaders and the web app are imported where they are used: a
# command refused for its flags answers before they load (seconds of imports).

#: The environment variable an API key may come from (``--api-key`` wins).
API_KEY_ENV = "TRANSFORMER_JAX_API_KEY"
DEFAULT_CACHE_DIR = Path("~/.cache/transformer_jax/xla")

logger = logging.getLogger("transformer_jax.serve")


def build_parser() -> argparse.ArgumentParser:
    """The CLI's arguments; each help states its default."""
    p = argparse.ArgumentParser(prog=f"{PROG} serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True,
                   help="HF checkpoint directory or a training run (run directory, its "
                   "checkpoints/ or a step directory)")
    p.add_argument("--tokenizer", help="tokenizer file or directory (default: the checkpoint's)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port, 0 for a free one (default: "
                   "%(default)s)")
    p.add_argument("--served-model-name", help="the model name clients send (default: the "
                   "checkpoint directory's name)")
    p.add_argument("--api-key", help=f"require 'Authorization: Bearer KEY' on /v1 (default: "
                   f"${API_KEY_ENV}, else no key)")
    p.add_argument("--lora", action="append", default=[], metavar="NAME=RUN_DIR",
                   help="serve the LoRA adapters of training run RUN_DIR (trained on this "
                        "checkpoint) as model NAME beside the base; repeatable")
    p.add_argument("--tool-call-parser", choices=("hermes", "llama3_json"),
                   help="the format of the model's tool calls (default: the chat template's)")
    p.add_argument("--reasoning-parser", choices=("qwen3", "deepseek_r1"),
                   help="chat replies' <think> block goes to the message's reasoning_content "
                        "(serve/reasoning.py; default: left in the content)")
    e = p.add_argument_group("engine")
    e.add_argument("--slots", type=int, default=8,
                   help="sequences decoded at once (default: %(default)s)")
    e.add_argument("--page-size", type=int, default=16,
                   help="positions per KV page (default: %(default)s)")
    e.add_argument("--pages", type=int, default=0, help="KV pages in the pool (default: 0, "
                   "enough for every slot at the full context)")
    e.add_argument("--memory-fraction", type=float, help="size the pool to this fraction of "
                   "the device memory left after the weights (default: --pages)")
    e.add_argument("--token-budget", type=int, default=0, help="most tokens per step: a "
                   "decode row per slot plus a prefill chunk (default: 0, slots + 256)")
    e.add_argument("--prefill-rows", type=int, default=1, help="most prompts whose chunks one "
                   "step prefills together; more step shapes to compile (default: %(default)s)")
    e.add_argument("--min-context", type=int, help="narrowest page table a step attends over, "
                   "in positions; each wider power of two compiles more shapes (default: 128)")
    e.add_argument("--tensor", type=int, default=1, metavar="T", help="tensor-parallel over T "
                   "devices, as generate --tensor (default: %(default)s)")
    e.add_argument("--expert", type=int, default=1, metavar="X", help="a mixture's experts "
                   "split over X devices, as generate --expert (default: %(default)s)")
    e.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="compute dtype (default: the checkpoint's)")
    e.add_argument("--cache-dtype", choices=("float32", "bfloat16", "float16", "int8"),
                   help="KV page dtype; int8 stores a scale per token and kv head (default: "
                   "the compute dtype)")
    e.add_argument("--quant", metavar="SCHEME", help="store the weights quantised: int8, int4 "
                   "or int4:G, as generate --quant (default: float)")
    e.add_argument("--no-prefix-caching", action="store_true",
                   help="do not share prompt pages between requests (default: share)")
    e.add_argument("--speculative", metavar="SPEC", help="speculative decoding for every "
                   "request: ngram[:k=K][:n=N] (prompt lookup), draft:PATH[:k=K] (a draft "
                   "model) or mtp (the checkpoint's multi-token prediction) (default: off)")
    e.add_argument("--compilation-cache", default=str(DEFAULT_CACHE_DIR),
                   help="JAX persistent compilation cache directory, '' for none "
                   "(default: %(default)s)")
    s = p.add_argument_group("requests")
    s.add_argument("--max-requests", type=int, default=256, help="requests in flight "
                   "(running or waiting) beyond which a request gets 429 (default: %(default)s)")
    s.add_argument("--request-timeout", type=float, help="seconds a request may run; then it "
                   "ends with finish_reason 'timeout' (default: no limit)")
    s.add_argument("--grace-period", type=float, default=30.0, help="seconds requests in "
                   "flight may finish after SIGTERM; then streams end with finish_reason "
                   "'abort' and requests not started get 503 (default: %(default)s)")
    s.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="largest request body; a larger one gets 413 (default: %(default)s)")
    s.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_S,
                   help="seconds a request's body may take to arrive; then 408 and the "
                   "connection closes (default: %(default)s)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                   help="(default: %(default)s)")
    return p


def _check(args: argparse.Namespace) -> None:
    for name in ("slots", "page_size", "max_requests", "prefill_rows", "min_context"):
        if (value := getattr(args, name)) is not None and value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
    for name in ("pages", "token_budget", "tensor"):
        if (value := getattr(args, name)) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {value}")
    fraction, timeout, inf = args.memory_fraction, args.request_timeout, float("inf")
    for flag, value, ok, wants in (
            ("--expert", args.expert, args.expert >= 1, ">= 1"),
            ("--memory-fraction", fraction, fraction is None or 0 < fraction <= 1, "in (0, 1]"),
            ("--request-timeout", timeout, timeout is None or timeout > 0, "positive"),
            ("--port", args.port, 0 <= args.port < 65536, "in [0, 65535] (0: a free port)"),
            ("--max-body-bytes", args.max_body_bytes, args.max_body_bytes > 0, "positive"),
            ("--body-timeout", args.body_timeout, 0 < args.body_timeout < inf,
             "a positive number of seconds"),
            ("--grace-period", args.grace_period, 0 <= args.grace_period < inf,
             "a number of seconds >= 0")):
        if not ok:
            raise ValueError(f"{flag} must be {wants}, got {value}")
    if args.quant:
        parse_quant(args.quant, field="--quant")  # before any weight is read
    parse_lora(args.lora, args.served_model_name)
    if args.speculative is not None:
        parse_spec(args.speculative)
        if args.tensor > 1 or args.expert > 1:  # before the checkpoint loads
            raise ValueError(f"--speculative {args.speculative}: speculative decoding in the "
                             "engine needs one device; drop --tensor and --expert")


def parse_lora(specs: list[str], served_name: str | None = None) -> dict[str, str]:
    """``--lora NAME=RUN_DIR`` values -> {name: run dir}, in order.

    Raises:
      ValueError: a value without ``=``, an empty or repeated name, or the base's own name.
    """
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise ValueError(f"--lora takes NAME=RUN_DIR, got {spec!r}")
        if name in out:
            raise ValueError(f"--lora names {name!r} twice")
        if served_name is not None and name == served_name:
            raise ValueError(f"--lora {spec!r}: {name!r} is the base model's name "
                             "(--served-model-name)")
        out[name] = path
    return out


def configure_compilation_cache(directory: str) -> None:
    """Points JAX's persistent compilation cache at ``directory`` (every program cached)."""
    import jax

    if not directory:
        return
    path = Path(directory).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pool_pages(args: argparse.Namespace, config: Any, draft: Any = None) -> int:
    """The pool size the flags ask for (page 0, the null page, included); each page also holds
    ``draft``'s pages' bytes (a draft model's config, or the MTP module's one layer)."""
    import jax

    from transformer_jax.serving.page_pool import pages_for
    from transformer_jax.serving.paged_cache import page_bytes, ring_bytes

    full = 1 + args.slots * pages_for(config.max_seq_len, args.page_size)
    if args.memory_fraction is None:
        return args.pages or full
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        raise ValueError(f"--memory-fraction needs a device that reports its memory; "
                         f"{jax.devices()[0].device_kind} does not: give --pages")
    shards = max(1, args.tensor)
    # Pages hold the global layers; local layers keep a ring per slot beside them.
    page = page_bytes(config, args.page_size, args.cache_dtype) // shards
    if draft is not None and page:
        page += page_bytes(draft, args.page_size, None)
    if page == 0:  # every layer keeps a ring: the pages only count positions
        return full
    free = (args.memory_fraction * stats["bytes_limit"] - stats.get("bytes_in_use", 0)
            - ring_bytes(config, args.slots, args.cache_dtype) // shards)
    return max(2, int(free // page))


def build(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """Loads the checkpoint and compiles the engine: (runner, model info, timings)."""
    from transformer_jax.checkpoint.adapters import load_adapter
    from transformer_jax.checkpoint.loading import HF, load_draft, load_for_decode
    from transformer_jax.decode.speculative_mtp import cache_config, check_mtp
    from transformer_jax.hf.generation_config import generation_stop_ids
    from transformer_jax.serve.completions import ModelInfo
    from transformer_jax.serve.metrics import Metrics
    from transformer_jax.serve.runner import EngineRunner
    from transformer_jax.serving import Engine
    from transformer_jax.serving.scheduler import MIN_CONTEXT

    timings = {}
    t = time.perf_counter()
    loaded, mesh = load_for_decode(args.checkpoint, args.tensor, args.tokenizer, args.expert)
    config = loaded.config.replace(dtype=args.dtype) if args.dtype else loaded.config
    adapters = {}
    for name, path in parse_lora(args.lora, args.served_model_name).items():
        found = load_adapter(path, config, loaded.params, name=name)
        adapters[name] = (found.adapters, found.lora_config)
    spec = parse_spec(args.speculative)
    draft = None
    if spec is not None and spec.method == "draft":
        draft = load_draft(spec.draft)  # its vocabulary checked against the model's
    timings["load_s"] = time.perf_counter() - t
    module = None  # the multi-token prediction module's pages: one more layer of each page
    if spec is not None and spec.method == "mtp":
        check_mtp(config, spec.k)
        module = cache_config(config)
    pages = pool_pages(args, config, module if draft is None else draft.config)
    engine = Engine(config, loaded.params, args.slots, pages, args.page_size,
                    args.token_budget or args.slots + 256, mesh,
                    prefix_caching=not args.no_prefix_caching, cache_dtype=args.cache_dtype,
                    min_context=min(args.min_context or MIN_CONTEXT, config.max_seq_len),
                    tokenizer=loaded.tokenizer, quant=args.quant, adapters=adapters or None,
                    max_prefill_rows=args.prefill_rows, draft=draft)
    if draft is not None:
        engine.speculation.draft.path = spec.draft  # requests name it as --speculative does
    if module is not None:
        engine.speculation.enable_mtp()
    t = time.perf_counter()
    shapes = engine.compile(speculative=spec.k if spec is not None else 0)
    shapes += engine.multistep.compile()  # the greedy multi-step rounds
    timings["compile_s"] = time.perf_counter() - t
    logger.info("loaded %s in %.1f s; compiled %d step shapes in %.1f s (%d slots, %d pages of "
                "%d, %.1f MiB of KV pages)", args.checkpoint, timings["load_s"], shapes,
                timings["compile_s"], args.slots, pages, args.page_size,
                engine.cache_bytes / 2 ** 20)
    name = args.served_model_name or Path(args.checkpoint).resolve().name
    if name in adapters:
        raise ValueError(f"--lora {name}=...: {name!r} is the base model's name; give the "
                         "adapter another name or --served-model-name")
    runner = EngineRunner(engine, Metrics(), args.max_requests, args.request_timeout)
    # The checkpoint's generation_config eos ids: e.g. Llama 3.1's <|eom_id|> after a tool call.
    stop_ids = generation_stop_ids(loaded.source.path) if loaded.source.kind == HF else ()
    return runner, ModelInfo.of(name, config, loaded.tokenizer, tuple(adapters),
                                args.tool_call_parser, stop_ids, args.reasoning_parser,
                                args.speculative), timings


def main(argv: list[str] | None = None) -> int:
    """Runs the server until SIGTERM; returns the exit status."""
    start = time.perf_counter()
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    try:
        _check(args)
        sock = listen(args.host, args.port)  # before loading: a busy port fails now
    except (ValueError, OSError) as e:
        return fail(str(e), 1)
    try:
        if api_key is None and not is_loopback(sock):
            logger.warning("the API is open to the network: %s serves every interface it is "
                           "bound to (--host %s) without an API key; anyone who can reach it "
                           "can use it. Give --api-key KEY (or $%s), or --host 127.0.0.1",
                           url_of(sock), args.host, API_KEY_ENV)
        if args.tensor * args.expert != 1:  # before anything starts JAX's CPU backend
            from transformer_jax.parallel import sharding

            sharding.configure_cpu_devices(devices=args.tensor * args.expert)
        configure_compilation_cache(args.compilation_cache)
        runner, model, _ = build(args)
    except (ValueError, OSError) as e:
        sock.close()
        return fail(str(e), 1)
    except Exception as e:  # CheckpointError and the like: one line, not a traceback
        sock.close()
        return fail(f"{type(e).__name__}: {e}", 1)
    from transformer_jax.serve.app import create_app

    app = create_app(runner, model, api_key, max_body_bytes=args.max_body_bytes,
                     body_timeout=args.body_timeout)

    def started() -> None:
        runner.ready = True
        logger.info("serving %r on %s (ready %.1f s after start; auth %s)", model.name,
                    url_of(sock), time.perf_counter() - start, "on" if api_key else "off")

    server = DrainingServer(runner, uvicorn.Config(
        app, log_level=args.log_level, timeout_graceful_shutdown=args.grace_period,
        access_log=False), on_started=started)
    runner.start()
    try:
        server.run(sockets=[sock])
    finally:
        runner.stop()
        sock.close()
    logger.info("stopped")
    return 0

