"""Training-step benchmark: ``transformer-jax bench train --config NAME [k=v ...]``.

Times the jitted ``train_step`` of a config on random tokens and reports compile time, step
time, tokens/s, peak memory and MFU. MFU = flops_per_token x tokens/s / a dense-matmul peak
measured on the same device in the same run. ``--moe-layer`` times one MoE layer instead.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

import jax
import numpy as np

from transformer_jax.bench import args as a
from transformer_jax.bench import moe_layer
from transformer_jax.parallel import sharding as sharding_lib
from transformer_jax.parallel.sharding import configure_cpu_devices
from transformer_jax.train import perf
from transformer_jax.train.config import build_configs
from transformer_jax.train.step import make_init_fn, make_train_step


def main(argv: list[str]) -> int:
    parser = a.parser("train", __doc__)
    parser.add_argument("--config", default="tiny", help="preset name or TOML path")
    parser.add_argument("--steps", type=a.positive_int, default=20, help="timed steps")
    parser.add_argument("--warmup", type=a.nonnegative_int, default=3,
                        help="untimed steps after compiling")
    parser.add_argument("--peak-size", type=a.positive_int, default=1024,
                        help="n of the n x n matmul")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--cpu-devices", type=a.nonnegative_int, default=0, metavar="N",
                        help="CPU devices for data parallelism, as train.py (0: per core)")
    parser.add_argument("--no-fast-math", action="store_true",
                        help="keep XLA's exact CPU math (train.py's default is fast math)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    moe_layer.add_arguments(parser)
    args = parser.parse_intermixed_args(argv)
    try:
        if args.moe_layer:
            if not args.no_fast_math:
                perf.enable_cpu_fast_math()
            return moe_layer.main(args)
        model, tc, _ = build_configs(args.config, args.overrides)
        if tc.seq_len > model.max_seq_len:
            raise ValueError(f"train.seq_len={tc.seq_len} > model.max_seq_len={model.max_seq_len}")
        if not args.no_fast_math:  # as train.py does, before the backend starts
            perf.enable_cpu_fast_math()
        try:
            configure_cpu_devices(tc.micro_batch_size, args.cpu_devices)
        except ValueError as e:  # a negative count, or one that does not divide the micro-batch
            raise ValueError(f"--cpu-devices {args.cpu_devices}: {e}") from None
    except (ValueError, FileNotFoundError) as e:  # ConfigError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2

    device = jax.devices()[0]
    # The same mesh, shardings and jitted step as train.py's run().
    mesh = sharding_lib.make_mesh(sharding_lib.MeshConfig.parse(tc.mesh))
    batch_sharding = sharding_lib.batch_sharding(mesh)
    key = jax.random.key(tc.seed)
    init = make_init_fn(model, tc)
    state_shardings = sharding_lib.state_shardings(
        jax.eval_shape(init, key), sharding_lib.param_shardings(model, mesh))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, model.vocab_size, (tc.batch_size, tc.seq_len + 1)).astype(np.int32)
    batch = {"inputs": jax.device_put(tokens[:, :-1], batch_sharding),
             "targets": jax.device_put(tokens[:, 1:], batch_sharding)}
    state = sharding_lib.shard_init(init, state_shardings)(key)

    compile_s, compiled = a.timed(lambda: sharding_lib.jit_train_step(  # lower + compile
        make_train_step(model, tc), state_shardings, batch_sharding).lower(state, batch).compile())
    for _ in range(args.warmup):
        state, metrics = compiled(state, batch)
    jax.block_until_ready(state)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        state, metrics = jax.block_until_ready(compiled(state, batch))
        times.append(time.perf_counter() - start)
    step_s = float(np.median(times))
    tokens_per_s = tc.tokens_per_step / step_s
    peak = perf.measure_matmul_peak(args.peak_size, model.dtype, device=device)
    flops = perf.flops_per_token(model, tc.seq_len)
    mfu = flops * tokens_per_s / peak

    stats = device.memory_stats() or {}
    m = compiled.memory_analysis()
    program_bytes = None if m is None else int(m.argument_size_in_bytes + m.output_size_in_bytes
                                               + m.temp_size_in_bytes - m.alias_size_in_bytes)
    result = {
        "config": args.config, "device": str(device), "devices": jax.device_count(),
        "params": perf.param_counts(model)[0], "active_params": perf.param_counts(model)[1],
        "batch_size": tc.batch_size, "seq_len": tc.seq_len, "grad_accum": tc.grad_accum,
        "compile_s": compile_s, "step_ms": 1000 * step_s, "step_ms_min": 1000 * min(times),
        "tokens_per_s": tokens_per_s, "flops_per_token": flops,
        "achieved_flops": flops * tokens_per_s, "matmul_peak_flops": peak, "mfu": mfu,
        "device_peak_bytes": stats.get("peak_bytes_in_use"), "program_bytes": program_bytes,
        "host_max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "loss": float(metrics["loss"]), "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
    if args.json:
        print(json.dumps(result))
        return 0
    mib = 2 ** 20
    active = "" if result["active_params"] == result["params"] else \
        f", {result['active_params']:,} active per token"
    print(f"train benchmark: {args.config} on {jax.device_count()} x {device.platform} "
          f"device(s) ({result['params']:,} params{active}, "
          f"B={tc.batch_size} T={tc.seq_len} grad_accum={tc.grad_accum}, {model.dtype})")
    print(f"  compile      {compile_s:.2f} s")
    print(f"  step         {result['step_ms']:.1f} ms (median of {args.steps}; "
          f"min {result['step_ms_min']:.1f} ms)")
    print(f"  throughput   {tokens_per_s:,.0f} tokens/s")
    print(f"  FLOPs        {flops / 1e6:.2f} MFLOP/token -> {flops * tokens_per_s / 1e9:.1f} "
          f"GFLOP/s; matmul peak {peak / 1e9:.1f} GFLOP/s")
    print(f"  MFU          {100 * mfu:.1f}%")
    memory = []
    if result["device_peak_bytes"]:
        memory.append(f"device peak {result['device_peak_bytes'] / mib:.1f} MiB")
    if program_bytes is not None:
        memory.append(f"step program {program_bytes / mib:.1f} MiB (args + temps)")
    memory.append(f"host max RSS {result['host_max_rss_bytes'] / mib:.0f} MiB")
    print(f"  memory       {', '.join(memory)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
