"""One mixture-of-experts layer against a dense FFN of the same active FLOPs:
``transformer-jax bench train --moe-layer [--impls dense,ragged,gather,tiled]``.

Forward + backward of the model's ``SparseFFN`` (E experts of width F, top k) per ``moe_impl``
against an ``MLP`` of width ``k F`` on the same tokens; then the layer's lowering + compile
time at two expert counts (a dropless implementation's should not grow with E).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.bench.args import positive_float, positive_int, timed
from transformer_jax.model.fields import MoE
from transformer_jax.model.layers import MLP
from transformer_jax.model.moe import SparseFFN

GIB = 2.0 ** 30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--moe-layer`` options of ``bench train``."""
    g = parser.add_argument_group("--moe-layer")
    g.add_argument("--moe-layer", action="store_true",
                   help="time one MoE layer against a dense FFN of the same active FLOPs")
    g.add_argument("--impls", default="dense,ragged,gather,tiled",
                   help="moe_impl values to time, comma-separated")
    g.add_argument("--tokens", type=positive_int, default=2048, help="N, tokens of the batch (B*T)")
    g.add_argument("--d-model", type=positive_int, default=512, help="D")
    g.add_argument("--expert-ff", type=positive_int, default=1024, help="F, one expert's width")
    g.add_argument("--experts", type=positive_int, default=8, help="E")
    g.add_argument("--top-k", type=positive_int, default=2, help="k (the dense FFN's width is k F)")
    g.add_argument("--compile-experts", default="8,64",
                   help="the two E of the compile-time comparison ('' skips it)")
    g.add_argument("--repeats", type=positive_int, default=5, help="timed runs (the median counts)")
    g.add_argument("--gather-max-gib", type=positive_float(allow_inf=True), default=2.0,
                   help="skip 'gather' when its [N, k, D, F] gathered weights exceed this")
    g.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))


def _layer(impl: str | None, n_experts: int, args: argparse.Namespace) -> tuple[Any, Any]:
    """(module, its params) of the MoE layer (``impl``) or, with ``impl=None``, the dense FFN."""
    k, f, dtype = args.top_k, args.expert_ff, jnp.dtype(args.dtype)
    kw = dict(dtype=dtype, param_dtype=jnp.float32)
    if impl is None:
        module = MLP(d_ff=k * f, kind="swiglu", **kw)
    else:
        module = SparseFFN(moe=MoE(n_experts=n_experts, top_k=k, d_ff=f), impl=impl, **kw)
    x = jnp.zeros((1, 8, args.d_model), dtype)
    return module, module.init(jax.random.key(0), x)["params"]


def _fwd_bwd(module: Any) -> Any:
    """A fresh (never cached) jitted ``(params, x) -> grads`` of ``sum(y * ct)``."""
    def loss(params, x, ct):
        y = module.apply({"params": params}, x)
        y = y[0] if isinstance(y, tuple) else y
        return jnp.sum(y.astype(jnp.float32) * ct)

    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def time_layer(impl: str | None, args: argparse.Namespace, n_experts: int) -> dict[str, float]:
    """Compile seconds and the median step seconds of one layer's forward + backward."""
    module, params = _layer(impl, n_experts, args)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1, args.tokens, args.d_model)), args.dtype)
    ct = jnp.asarray(rng.standard_normal((1, args.tokens, args.d_model)), jnp.float32)
    compile_s, compiled = timed(lambda: _fwd_bwd(module).lower(params, x, ct).compile())
    jax.block_until_ready(compiled(params, x, ct))
    times = [timed(lambda: jax.block_until_ready(compiled(params, x, ct)))[0]
             for _ in range(args.repeats)]
    return {"compile_s": compile_s, "step_s": float(np.median(times)), "min_s": min(times)}


def compile_seconds(impl: str, args: argparse.Namespace, counts: list[int], repeats: int = 3
                    ) -> dict[int, float]:
    """Lowering + compile seconds of the MoE layer's forward + backward at each expert count: the
    best of ``repeats``, interleaved, each a fresh function."""
    best = dict.fromkeys(counts, float("inf"))
    x = jax.ShapeDtypeStruct((1, args.tokens, args.d_model), jnp.dtype(args.dtype))
    ct = jax.ShapeDtypeStruct((1, args.tokens, args.d_model), jnp.float32)
    for _ in range(repeats):
        for e in counts:
            module, params = _layer(impl, e, args)
            best[e] = min(best[e], timed(  # lower + compile
                lambda m=module, p=params: _fwd_bwd(m).lower(p, x, ct).compile())[0])
    return best


def main(args: argparse.Namespace) -> int:
    """Runs the comparison and prints it (one JSON object with ``--json``)."""
    impls = [s.strip() for s in args.impls.split(",") if s.strip()]
    counts = [int(s) for s in args.compile_experts.split(",") if s.strip()]
    if args.top_k > min([args.experts, *counts]):
        raise ValueError(f"--top-k {args.top_k} is above an expert count "
                         f"(--experts {args.experts}, --compile-experts {args.compile_experts})")
    dense = time_layer(None, args, args.experts)
    result: dict[str, Any] = {
        "device": str(jax.devices()[0]), "tokens": args.tokens, "d_model": args.d_model,
        "expert_ff": args.expert_ff, "experts": args.experts, "top_k": args.top_k,
        "dtype": args.dtype, "dense": dense, "moe": {}, "compile": {}}
    gather_bytes = 3 * args.tokens * args.top_k * args.d_model * args.expert_ff * \
        jnp.dtype(args.dtype).itemsize
    for impl in impls:
        if impl == "gather" and gather_bytes > args.gather_max_gib * GIB:
            result["moe"][impl] = {"skipped": f"gathers {gather_bytes / GIB:.1f} GiB of expert "
                                              f"weights (--gather-max-gib {args.gather_max_gib})"}
            continue
        moe = time_layer(impl, args, args.experts)
        moe["ratio"] = moe["step_s"] / dense["step_s"]
        result["moe"][impl] = moe
    if len(counts) == 2:
        for impl in [i for i, r in result["moe"].items() if "skipped" not in r]:
            low, high = compile_seconds(impl, args, counts).values()
            result["compile"][impl] = {f"E={counts[0]}": low, f"E={counts[1]}": high,
                                       "ratio": high / low}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"MoE layer forward+backward on {result['device']}: N={args.tokens} tokens, "
          f"D={args.d_model}, E={args.experts}, k={args.top_k}, F={args.expert_ff} "
          f"(dense SwiGLU F={args.top_k * args.expert_ff}), {args.dtype}, median of {args.repeats}")
    print(f"  dense FFN    {1000 * dense['step_s']:8.1f} ms                 (min "
          f"{1000 * dense['min_s']:.1f} ms; compile {dense['compile_s']:.2f} s)")
    for impl, moe in result["moe"].items():
        if "skipped" in moe:
            print(f"  {impl:<12} skipped: {moe['skipped']}")
            continue
        print(f"  {impl:<12} {1000 * moe['step_s']:8.1f} ms   {moe['ratio']:5.2f}x dense   "
              f"(min {1000 * moe['min_s']:.1f} ms; compile {moe['compile_s']:.2f} s)")
    for impl, c in result["compile"].items():
        low, high = (c[f"E={e}"] for e in counts)
        print(f"  compile {impl:<8} E={counts[0]} {low:.2f} s, E={counts[1]} {high:.2f} s: "
              f"{c['ratio']:.2f}x")
    return 0
