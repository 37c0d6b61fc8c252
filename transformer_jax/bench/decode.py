"""Decode benchmark: ``transformer-jax bench decode --config NAME``.

Each point of the grid (batch, prompt length, new tokens, ``--tensor`` size) runs on random
weights. Measured: compile time, prefill tokens/s, time to first token, decode step time (and
its course over the generation) and tokens/s; the step against its memory-bandwidth bound
(weight + KV bytes / a bandwidth measured before every point) and the device's peak
(``PEAK_GB_S``); the step's matrix products alone; a no-cache baseline; quantised weights
(``--quant``) and a mixture's expert bytes and dense twin (``decode_compare.py``); HuggingFace
``generate`` on the same weights. Prints a table and writes the JSON.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.bench import args as args_lib
from transformer_jax.bench import decode_args, decode_compare
from transformer_jax.decode import generation
from transformer_jax.decode import loop as decode
from transformer_jax.decode import prompts as prompt_lib
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.kv_cache import cache_bytes
from transformer_jax.model.ops import moe as moe_ops
from transformer_jax.model.ops.dense import dense
from transformer_jax.model.ops.layouts import OutFirst
from transformer_jax.model.transformer import Transformer, init_params, unstack_blocks
from transformer_jax.parallel import sharding


def _seconds(fn) -> tuple[float, Any]:
    """``fn()``'s wall-clock seconds (its result ready) and its result."""
    return args_lib.timed(lambda: jax.block_until_ready(fn()))


def _median_time(fn, repeats: int) -> float:
    return statistics.median(_seconds(fn)[0] for _ in range(repeats))


_BANDWIDTH_OPERANDS: dict[int, tuple[jax.Array, jax.Array, Any]] = {}

#: Published peak memory bandwidth (GB/s) by a substring of ``device_kind``, first match wins;
#: ``--peak-gb-s`` overrides it. CPUs have no entry: the measured matvec bandwidth stands in.
PEAK_GB_S = (
    ("H200", 4800.0), ("H100 NVL", 3900.0), ("H100 PCIe", 2000.0), ("H100", 3350.0),
    ("A100-SXM4-80GB", 2039.0), ("A100 80GB PCIe", 1935.0), ("A100", 1555.0),
    ("L40S", 864.0), ("L4", 300.0), ("A10G", 600.0), ("V100", 900.0), ("T4", 320.0),
    ("TPU v6 lite", 1640.0), ("TPU v5 lite", 819.0), ("TPU v5p", 2765.0), ("TPU v4", 1200.0),
)


def measure_bandwidth(nbytes: int = 256 << 20, repeats: int = 15) -> float:
    """Read bandwidth in bytes/s: a jitted float32 matrix-vector product over ``nbytes``."""
    if nbytes not in _BANDWIDTH_OPERANDS:
        n = int((nbytes // 4) ** 0.5)
        w = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
        matvec = jax.jit(lambda w, x: w @ x)
        x = jnp.ones((n,), jnp.float32)
        matvec(w, x).block_until_ready()
        _BANDWIDTH_OPERANDS[nbytes] = (w, x, matvec)
    w, x, matvec = _BANDWIDTH_OPERANDS[nbytes]
    return w.nbytes / _median_time(lambda: matvec(w, x), repeats)


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def _bench_ours(config: ModelConfig, weights: decode.DecodeWeights, prompts: list[list[int]],
                n: int, repeats: int, cache_size: int | None, weight_bytes: int,
                cache_dtype: str | None = None) -> dict[str, Any]:
    b, p = len(prompts), len(prompts[0])
    kw = dict(max_new_tokens=n, cache_size=cache_size, cache_dtype=cache_dtype)
    t = prompt_lib.prompt_bucket(p)
    s_max = cache_size or prompt_lib.default_cache_size(config, t, n)
    nbytes = weight_bytes + cache_bytes(config, b, s_max, cache_dtype)

    # The first call compiles. A step is (generate N tokens - generate 1) / (N - 1) on the same
    # cache size, so everything outside the loop cancels; each pair of calls follows its own
    # bandwidth sample (other tenants of a shared machine change both).
    run = functools.partial(generation.generate, config, weights, prompts)
    first, _ = _seconds(lambda: run(**kw))
    one = dict(kw, max_new_tokens=1, cache_size=s_max)
    run(**one)
    totals, singles, steps_ms, bandwidths, ratios = [], [], [], [], []
    for _ in range(repeats):
        bandwidths.append(measure_bandwidth(repeats=7))
        singles.append(_seconds(lambda: run(**one))[0])
        seconds, result = _seconds(lambda: run(**kw))
        totals.append(seconds)
        steps_ms.append((totals[-1] - singles[-1]) / (n - 1) * 1e3)
        ratios.append(steps_ms[-1] / (nbytes / bandwidths[-1] * 1e3))

    # Per-step host timestamps from the stream callback (a second compiled program).
    stamps: list[float] = []
    run(stream=lambda *a: None, **kw)
    start = time.perf_counter()
    run(stream=lambda *a: stamps.append(time.perf_counter()), **kw)
    series = np.diff(np.asarray(stamps)) * 1e3  # ms; series[i] is decode step i + 1
    quarter = max(1, len(series) // 4)
    step_ms = statistics.median(steps_ms)
    # The prefill: a whole generate of one token (its token comes from the prefill's logits).
    prefill_s = statistics.median(singles)
    return dict(
        compile_s=first - statistics.median(totals), total_s=statistics.median(totals),
        ttft_s=stamps[0] - start, prefill_s=prefill_s, prefill_tok_s=b * p / prefill_s,
        step_ms=step_ms, decode_tok_s=b / step_ms * 1e3,
        bandwidth_gb_s=statistics.median(bandwidths) / 1e9,
        bound_step_ms=nbytes / statistics.median(bandwidths) * 1e3,
        step_bytes=nbytes, achieved_gb_s=nbytes / step_ms / 1e6,
        step_vs_bound=statistics.median(ratios), step_vs_bound_all=ratios,
        # With the per-step callback (its host round trip is included).
        step_ms_callback=float(np.median(series)),
        step_ms_first_quarter=float(np.median(series[:quarter])),
        step_ms_last_quarter=float(np.median(series[-quarter:])),
        step_ms_series=[round(float(x), 3) for x in series],
        cache_len=s_max, cache_bytes=cache_bytes(config, b, s_max, cache_dtype),
        cache_dtype=cache_dtype or config.dtype, tokens=result.token_array.tolist(),
    )


def _bench_weights_only(config: ModelConfig, weights: decode.DecodeWeights, batch: int,
                        steps: int, repeats: int) -> float:
    """Milliseconds per step of the decode step's matrix products alone, at batch B: the same
    prepared weights and the model's own contractions chained through a norm-free residual in a
    ``lax.fori_loop`` of ``steps`` iterations, without attention or sampling."""
    c, params = config, weights.params
    scan = "blocks" in params  # one scanned group; any other layout runs unrolled here
    unrolled = params if scan else unstack_blocks(params)
    blocks = params["blocks"] if scan else [unrolled[f"blocks_{i}"] for i in range(c.n_layers)]
    # The head as the decode reads it (a tied [V, D] table is the [D, V] head out-first).
    head = params["embed"]["embedding"] if c.tie_embeddings else params["lm_head"]
    if c.tie_embeddings and not isinstance(head, OutFirst):
        head = OutFirst(head)

    def ffn(x: jax.Array, m: Any) -> jax.Array:
        hidden = dense(x, m["up"], "BD,DF->BF")
        if "gate" in m:
            hidden = hidden * dense(x, m["gate"], "BD,DF->BF")
        return dense(hidden, m["down"], "BF,FD->BD")

    def experts(x: jax.Array, m: Any) -> jax.Array:
        # A mixture's step: the model's expert op on k experts per row (ids the compiler
        # cannot fold away).
        k = c.moe.top_k
        ids = jnp.arange(batch * k).reshape(batch, k) % c.moe.n_experts
        routing = moe_ops.Routing(jnp.full((batch, k), 1.0 / k), ids + (
            x[0, 0] > 1e30).astype(jnp.int32), None, None)
        y = moe_ops.experts_ffn(x, routing, m["gate"], m["up"], m["down"], impl=c.moe_impl)
        return y + ffn(x, m["shared"]) if "shared" in m else y

    def latent(x: jax.Array, a: Any) -> jax.Array:
        # A latent attention step's matrices: the query, the latent, its up-projection
        # (absorbed into the query and the output in the model), the output.
        q = (dense(x, a["q_proj"], "BD,DNH->BNH") if "q_proj" in a else dense(
            dense(x, a["q_a_proj"], "BD,DQ->BQ"), a["q_b_proj"], "BQ,QNH->BNH"))
        c_t = dense(x, a["kv_a_proj"], "BD,DE->BE")[:, :c.mla.kv_lora_rank]
        v = dense(c_t, a["kv_b_proj"], "BR,RNH->BNH")[..., c.mla.qk_nope_head_dim:]
        return dense(v + q.mean() * 1e-6, a["o_proj"], "BNH,NHD->BD")

    def layer(x: jax.Array, p: Any) -> jax.Array:
        a = p["attn"]
        if c.mla is not None:
            x = x + latent(x, a)
        else:
            q = dense(x, a["q_proj"], "BD,DNH->BNH")
            kv = (dense(x, a["k_proj"], "BD,DKH->BKH").mean()
                  + dense(x, a["v_proj"], "BD,DKH->BKH").mean())
            x = x + dense(q, a["o_proj"], "BNH,NHD->BD") + kv * 1e-6
        return x + (experts(x, p["moe"]) if "moe" in p else ffn(x, p["mlp"]))

    def chain(blocks: Any, head: jax.Array, x: jax.Array, n: int) -> jax.Array:
        def body(_, x):
            if scan:
                x = jax.lax.scan(lambda x, p: (layer(x, p), None), x, blocks)[0]
            else:
                for p in blocks:
                    x = layer(x, p)
            return x + jnp.mean(dense(x, head, "BD,DV->BV")) * 1e-6
        return jax.lax.fori_loop(0, n, body, x)

    fn = jax.jit(chain, static_argnums=3)
    x = jnp.ones((batch, c.d_model), c.jnp_dtype)
    # (2n iterations - n) / n: dispatch and everything outside the loop cancel.
    times = {}
    for n in (steps, 2 * steps):
        jax.block_until_ready(fn(blocks, head, x, n))
        times[n] = _median_time(lambda n=n: fn(blocks, head, x, n), repeats)
    return (times[2 * steps] - times[steps]) / steps * 1e3


def compile_times(config: ModelConfig, layers: tuple[int, ...] = (4, 32), batch: int = 1,
                  prompt_len: int = 128, new_tokens: int = 64,
                  dtype: str = "bfloat16", repeats: int = 1) -> dict[str, Any]:
    """Seconds to lower and compile the jitted generate at several depths, from abstract inputs
    (nothing is allocated); with a scanned model it should not grow with depth."""
    out: dict[str, float] = {}
    for _ in range(repeats):  # interleaved, the fastest counts (a repeat may hit JAX's cache)
        for n_layers in layers:
            c = config.replace(n_layers=n_layers, dtype=dtype, param_dtype=dtype)
            args = (decode.abstract_weights(c),
                    jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32),
                    jax.ShapeDtypeStruct((batch,), jnp.int32),
                    jax.ShapeDtypeStruct((batch, 2), jnp.uint32))
            fn = jax.jit(decode.generate_padded, static_argnames=decode.GENERATE_STATIC_ARGNAMES)
            seconds, _ = args_lib.timed(lambda fn=fn, c=c, args=args: fn.lower(  # lower + compile
                c, *args, max_new_tokens=new_tokens).compile())
            out[str(n_layers)] = min(seconds, out.get(str(n_layers), seconds))
            print(f"  {n_layers} layers: lower + compile {seconds:.1f} s", flush=True)
    first, last = str(layers[0]), str(layers[-1])
    return dict(compile_s=out, ratio=out[last] / out[first], scan_layers=config.scan_layers,
                batch=batch, prompt_len=prompt_len, new_tokens=new_tokens, dtype=dtype)


def _bench_no_cache(config: ModelConfig, params: Any, prompts: list[list[int]],
                    repeats: int) -> dict[str, Any]:
    model = Transformer(config)

    @jax.jit
    def next_token(params, tokens):
        return jnp.argmax(model.apply({"params": params}, tokens).logits[:, -1], axis=-1)

    tokens = jnp.asarray(prompts, jnp.int32)
    jax.block_until_ready(next_token(params, tokens))
    step = _median_time(lambda: next_token(params, tokens), repeats)
    return dict(step_ms=step * 1e3, decode_tok_s=len(prompts) / step)


def _load_hf(config: ModelConfig, params: Any) -> Any:
    """The same weights as a transformers model (via ``hf.save``), or None without the extra."""
    try:
        import torch
        import transformers

        from transformer_jax import hf
    except ImportError as e:
        print(f"  (HF comparison skipped: {e})", file=sys.stderr)
        return None
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        hf.save(config, params, tmp)
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
    model.eval()
    with torch.no_grad():  # the first generate of a process is much slower: not measured
        model.generate(torch.zeros((1, 4), dtype=torch.long), max_new_tokens=8, do_sample=False,
                       pad_token_id=0, eos_token_id=None)
    return model


def _bench_hf(model: Any, prompts: list[list[int]], n: int, repeats: int) -> dict[str, Any]:
    import torch

    ids = torch.tensor(prompts)
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None, max_new_tokens=n,
              min_new_tokens=n)

    class Stamps(list):  # HF calls put() with the prompt, then once per generated token
        def put(self, value: Any) -> None:
            self.append(time.perf_counter())

        def end(self) -> None:
            pass

    def run() -> tuple[float, float, float, Any]:
        stamps = Stamps()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, streamer=stamps if len(prompts) == 1 else None, **kw)
        total = time.perf_counter() - start
        if len(prompts) == 1:
            ttft = stamps[1] - start
            step = float(np.median(np.diff(stamps[1:])))
        else:  # HF streamers take batch 1 only: time one new token for the first-token latency
            with torch.no_grad():
                ttft, _ = _seconds(lambda: model.generate(
                    ids, **{**kw, "max_new_tokens": 1, "min_new_tokens": 1}))
            step = (total - ttft) / (n - 1)
        return total, ttft, step, out

    run()  # warm-up
    runs = [run() for _ in range(repeats)]
    total, ttft, step = (statistics.median(r[i] for r in runs) for i in range(3))
    out = runs[-1][3][:, len(prompts[0]):].tolist()
    return dict(ttft_s=ttft, total_s=total, step_ms=step * 1e3,
                decode_tok_s=len(prompts) / step, tokens=out)


def main(argv: list[str]) -> int:
    args, config = decode_args.parse(argv, __doc__.split("\n\n")[0])
    name = Path(args.config).stem
    if args.compile_time:
        print(f"generate compile time, {name} shapes (scan_layers={config.scan_layers}):")
        layers = tuple(args.layers)
        result = compile_times(config, layers=layers)
        print(f"{layers[-1]} layers / {layers[0]} layers = {result['ratio']:.2f}")
        args_lib.write_json(args.out, result)
        print(f"wrote {args.out}")
        return 0
    # Before JAX starts its CPU backend: one device per core (the count divides K, N and F).
    cores = sharding.configure_cpu_devices(math.gcd(config.n_kv_heads, config.d_ff))
    per_core = cores if jax.default_backend() == "cpu" else 0
    sizes = [t or per_core or len(jax.devices()) for t in args.tensor]
    meshes = {}
    for t in dict.fromkeys(sizes):
        try:
            decode.check_tensor_parallel(config, t)
            if t > len(jax.devices()):
                raise ValueError(f"only {len(jax.devices())} devices")
            meshes[t] = None if t == 1 else sharding.make_mesh(
                sharding.MeshConfig(data=1, fsdp=1, tensor=t), jax.devices()[:t])
        except ValueError as e:
            print(f"skip tensor={t}: {e}")
    params = jax.jit(init_params, static_argnums=0)(config, jax.random.key(0))
    # The weights are prepared once per mesh (decode.prepare), as a serving process would.
    placed, prepare_s = {}, {}
    for t, mesh in meshes.items():
        prepare_s[t], placed[t] = _seconds(lambda mesh=mesh: decode.prepare(config, params, mesh))
    quantized = {t: decode.prepare(config, params, mesh, quant=args.quant)
                 for t, mesh in meshes.items()} if args.quant else {}
    weight_bytes = decode_compare.step_weight_bytes(config, next(iter(placed.values())))
    n_params = sum(x.size for x in jax.tree.leaves(params))
    print(f"decode benchmark: {name}, {n_params / 1e6:.1f}M params ({weight_bytes / 1e6:.0f} MB "
          f"read per step), {config.dtype}, {jax.devices()[0].device_kind} x "
          f"{len(jax.devices())}, tensor sizes {list(meshes)}, load average {_load():.2f}; "
          "prepare (with compile) " + ", ".join(f"tensor={t} {s:.2f} s"
                                                for t, s in prepare_s.items()))
    kind = jax.devices()[0].device_kind
    peak = args.peak_gb_s or next((gb_s for name, gb_s in PEAK_GB_S if name in kind), None)
    if peak:
        print(f"peak memory bandwidth of {kind}: {peak:.0f} GB/s"
              + (" (given)" if args.peak_gb_s else " (published)"))
    hf_model = None if args.no_hf else _load_hf(config, params)
    records = []
    rng = np.random.default_rng(0)
    grid = itertools.product(args.batch, args.prompt_len, args.new_tokens, args.cache_size)
    for b, p, n, s_max in grid:
        if n < 2:
            print(f"skip N={n}: the step time needs at least 2 new tokens")
            continue
        prompts = rng.integers(0, config.vocab_size, (b, p)).tolist()
        point: dict[str, Any] = dict(batch=b, prompt_len=p, new_tokens=n, load_avg=_load(),
                                     weight_bytes=weight_bytes)
        if not args.no_baseline:
            point["no_cache"] = _bench_no_cache(config, params, prompts, args.repeats)
        hf_rec = None if hf_model is None else _bench_hf(hf_model, prompts, n, args.repeats)
        run = functools.partial(_bench_ours, prompts=prompts, n=n, repeats=args.repeats,
                                cache_size=s_max or None, cache_dtype=args.cache_dtype)
        for t in meshes:
            ours = run(config, placed[t], weight_bytes=weight_bytes)
            rec = dict(point, tensor=t, load_avg=_load(), ours=ours, prepare_s=prepare_s[t])
            if peak:  # per device: each of the T devices reads its 1/T of the bytes
                rec.update(peak_gb_s=peak, bandwidth_use_vs_peak=ours["achieved_gb_s"] / t / peak)
            weights_ms = _bench_weights_only(config, placed[t], b, n, args.repeats)
            rec["weights_only"] = dict(
                step_ms=weights_ms, gb_s=weight_bytes / weights_ms / 1e6,
                vs_weight_bound=weights_ms / (weight_bytes / ours["bandwidth_gb_s"] / 1e6))
            if "no_cache" in point:
                rec["speedup_vs_no_cache"] = point["no_cache"]["step_ms"] / ours["step_ms"]
            if hf_rec is not None:
                same = np.mean(np.asarray(hf_rec["tokens"]) == np.asarray(ours["tokens"]))
                rec.update(hf={k: v for k, v in hf_rec.items() if k != "tokens"},
                           speedup_vs_hf=hf_rec["step_ms"] / ours["step_ms"],
                           greedy_token_agreement_with_hf=float(same))
            if quantized:
                rec["quant"] = decode_compare.compare_quant(
                    config, quantized[t], ours, weight_bytes, run,
                    functools.partial(_bench_weights_only, config, batch=b, steps=n,
                                      repeats=args.repeats))
            if config.moe is not None:
                rec["moe"] = decode_compare.compare_moe(config, placed[t], ours, b, run)
            ours.pop("tokens")
            records.append(rec)
            _print_record(rec)
    args_lib.write_json(args.out, dict(config=name, params=n_params, platform=platform.platform(),
                                       jax=jax.__version__, records=records))
    print(f"wrote {args.out}")
    return 0


def _print_record(r: dict[str, Any]) -> None:
    o = r["ours"]
    print(f"B={r['batch']} P={r['prompt_len']} N={r['new_tokens']} tensor={r['tensor']} "
          f"(S_max={o['cache_len']}, cache {o['cache_bytes'] / 1e6:.1f} MB "
          f"{o['cache_dtype']}, load {r['load_avg']:.1f}):")
    print(f"  compile {o['compile_s']:.1f} s | prefill {o['prefill_tok_s']:.0f} tok/s | "
          f"TTFT {o['ttft_s'] * 1e3:.0f} ms | decode {o['decode_tok_s']:.0f} tok/s")
    print(f"  step {o['step_ms']:.2f} ms; with a per-step callback {o['step_ms_callback']:.2f} "
          f"(first quarter {o['step_ms_first_quarter']:.2f}, last quarter "
          f"{o['step_ms_last_quarter']:.2f})")
    print(f"  bandwidth {o['bandwidth_gb_s']:.1f} GB/s -> bound {o['bound_step_ms']:.2f} ms/step; "
          f"step / bound = {o['step_vs_bound']:.2f} (per repeat: "
          f"{', '.join(f'{x:.2f}' for x in o['step_vs_bound_all'])})")
    print(f"  reads {o['step_bytes'] / 1e6:.0f} MB per step: {o['achieved_gb_s']:.1f} GB/s"
          + (f", {r['bandwidth_use_vs_peak']:.0%} of each device's {r['peak_gb_s']:.0f} GB/s "
             "peak" if "peak_gb_s" in r else ""))
    w = r["weights_only"]
    print(f"  the step's matrix products alone: {w['step_ms']:.2f} ms/step ({w['gb_s']:.1f} GB/s "
          f"of weights) = {w['vs_weight_bound']:.2f}x the weights' own bound")
    if "quant" in r:
        q = r["quant"]
        print(f"  {q['scheme']} weights: {q['weight_bytes'] / 1e6:.1f} MB "
              f"({q['weight_bytes_vs_float']:.3f}x the float bytes), step {q['step_ms']:.2f} ms "
              f"= {q['step_vs_float']:.2f}x float's; matrix products alone "
              f"{q['weights_only_ms']:.2f} ms; greedy tokens agree with float "
              f"{q['greedy_token_agreement_with_float']:.0%}")
    if "moe" in r:
        m = r["moe"]
        print(f"  moe E={m['n_experts']} k={m['top_k']} F={m['expert_d_ff']} shared "
              f"{m['shared_d_ff']} ({m['impl']}): reads {m['expert_bytes_read'] / 1e6:.2f} of "
              f"{m['expert_bytes_all'] / 1e6:.2f} MB of experts per step "
              f"({m['read_fraction']:.0%}; k/E + shared = {m['bound_fraction']:.0%}) | step "
              f"{m['moe_step_ms']:.2f} ms vs dense twin (d_ff={m['dense_d_ff']}) "
              f"{m['dense_step_ms']:.2f} ms = {m['step_vs_dense']:.2f}x")
    if "no_cache" in r:
        print(f"  no-cache baseline {r['no_cache']['step_ms']:.1f} ms/step -> "
              f"{r['speedup_vs_no_cache']:.1f}x")
    if "hf" in r:
        h = r["hf"]
        print(f"  HF generate {h['step_ms']:.2f} ms/step, {h['decode_tok_s']:.0f} tok/s, TTFT "
              f"{h['ttft_s'] * 1e3:.0f} ms -> {r['speedup_vs_hf']:.2f}x; greedy tokens agree "
              f"{r['greedy_token_agreement_with_hf']:.0%}")
