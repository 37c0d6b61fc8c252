"""Per-device training memory of a preset on a mesh, and compile time against depth.

Nothing is allocated: shapes come from ``jax.eval_shape``, shardings from the logical rules and
the compiled numbers from XLA's memory analysis of the real train step lowered on abstract
inputs. The devices are simulated CPU devices, so a 7B model on an 8-device mesh can be planned
on a laptop: ``transformer-jax bench memory --config llama2_7b --mesh 1,8,1 [--compile-time]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import sys
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType, NamedSharding

from transformer_jax.bench import args as args_lib
from transformer_jax.model.config import ModelConfig, load_toml
from transformer_jax.model.kv_cache import cache_bytes
from transformer_jax.model.ops.attention import choose_impl
from transformer_jax.model.ops.lm_loss import head_logits, lm_head_cross_entropy_sums
from transformer_jax.model.transformer import Transformer, abstract_params
from transformer_jax.parallel import sharding as sh
from transformer_jax.train.perf import param_counts

GIB = 2.0 ** 30


@dataclasses.dataclass
class MemoryReport:
    """Per-device bytes of one (model, mesh, batch) training set-up."""

    config: str
    mesh: tuple[int, int, int]
    batch: int
    seq: int
    remat: str
    dtype: str
    attention: str
    loss_chunk: int
    param_count: int
    params_bytes: int
    adam_bytes: int
    state_bytes: int
    compiled: dict[str, int] | None = None
    activations_bytes: int | None = None
    loss_head_bytes: int | None = None
    active_param_count: int | None = None
    experts_bytes: int = 0
    rough_activations_bytes: int | None = None


def state_memory(model_config: Any, mesh_sizes: tuple[int, int, int], train_config: Any
                 ) -> dict[str, int]:
    """Per-device bytes of the train state on a mesh, from shapes and shardings alone.

    Args:
      model_config: the ``ModelConfig``.
      mesh_sizes: concrete (data, fsdp, tensor) sizes (an abstract mesh: no devices needed).
      train_config: the ``TrainConfig`` (its optimizer decides the state).

    Returns:
      ``{"param_count", "params", "adam", "state", "experts"}``: the count, and bytes of the
      parameters, Adam's mu + nu, the whole state and the routed experts' part of it.
    """
    from transformer_jax.train.memory import expert_bytes
    from transformer_jax.train.step import make_init_fn

    axes = mesh_axes(mesh_sizes)
    mesh = AbstractMesh(tuple(mesh_sizes), axes, axis_types=(AxisType.Auto,) * len(axes))
    abstract = jax.eval_shape(make_init_fn(model_config, train_config), jax.random.key(0))
    shardings = sh.state_shardings(abstract, sh.param_shardings(model_config, mesh))
    adam = 0
    flat_s = dict(jax.tree_util.tree_flatten_with_path(shardings)[0])
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]:
        if {"mu", "nu"} & set(sh._path_keys(path)):
            adam += sh.per_device_bytes(leaf, flat_s[path])
    return {
        "param_count": sum(math.prod(x.shape) for x in jax.tree.leaves(abstract.params)),
        "params": sh.per_device_bytes(abstract.params, shardings.params), "adam": adam,
        "state": sh.per_device_bytes(abstract, shardings),
        "experts": expert_bytes(abstract, shardings),
    }


def mesh_axes(mesh_sizes: tuple[int, ...]) -> tuple[str, ...]:
    """The axis names of a mesh of these sizes (a fourth is the expert axis)."""
    return sh.MESH_AXES if len(mesh_sizes) == 3 else sh.EXPERT_MESH_AXES


def lower_train_step(model_config: Any, train_config: Any, mesh: Any) -> tuple[Any, float]:
    """The real train step lowered on abstract sharded inputs.

    Returns:
      ``(lowered, seconds)``: the ``jax.stages.Lowered`` and the time lowering took.
    """
    from transformer_jax.train.step import make_init_fn, make_train_step

    abstract = jax.eval_shape(make_init_fn(model_config, train_config), jax.random.key(0))
    s_shard = sh.state_shardings(abstract, sh.param_shardings(model_config, mesh))
    b_shard = sh.batch_sharding(mesh)
    tokens = jax.ShapeDtypeStruct((train_config.batch_size, train_config.seq_len), jnp.int32,
                                  sharding=b_shard)
    step = sh.jit_train_step(make_train_step(model_config, train_config), s_shard, b_shard)
    seconds, lowered = args_lib.timed(lambda: step.lower(sh.with_shardings(abstract, s_shard),
                                                         {"inputs": tokens, "targets": tokens}))
    return lowered, seconds


def compiled_memory(model_config: Any, train_config: Any, mesh: Any) -> dict[str, int]:
    """XLA's per-device memory analysis of the compiled train step (nothing is allocated)."""
    lowered, _ = lower_train_step(model_config, train_config, mesh)
    stats = lowered.compile().memory_analysis()
    names = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
             "temp_size_in_bytes", "generated_code_size_in_bytes")
    out = {n.removesuffix("_size_in_bytes"): int(getattr(stats, n, 0) or 0) for n in names}
    # Donated state is aliased to the output: live at once are arguments, the non-aliased
    # outputs and the temporaries.
    out["peak_estimate"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    return out


def compiled_activations(model_config: Any, train_config: Any, mesh: Any) -> int:
    """Per-device temporaries of the forward + backward pass alone (no optimizer update): what the
    remat policy keeps, gathered weights and XLA's scratch."""
    from transformer_jax.train.step import make_loss_fn

    loss_sums = make_loss_fn(model_config, train_config)  # the train step's own objective

    def grads_only(params, batch):
        grads, _ = jax.grad(loss_sums, has_aux=True)(params, batch)
        return grads, {}

    p_shard = sh.param_shardings(model_config, mesh)
    b_shard = sh.batch_sharding(mesh)
    params = sh.with_shardings(abstract_params(model_config), p_shard)
    tokens = jax.ShapeDtypeStruct((train_config.micro_batch_size, train_config.seq_len),
                                  jnp.int32, sharding=b_shard)
    step = sh.jit_train_step(grads_only, p_shard, b_shard, donate=False)
    stats = step.lower(params, {"inputs": tokens, "targets": tokens}).compile().memory_analysis()
    return int(stats.temp_size_in_bytes)


def compiled_loss_head(model_config: Any, train_config: Any, mesh: Any) -> int:
    """Per-device temporaries of the LM head + cross-entropy and their gradient, compiled alone on
    the step's shardings ([B, T, V] float32 logits, or chunks of ``train_config.loss_chunk``)."""
    from transformer_jax.train.loss import cross_entropy_sums

    c, chunk = model_config, train_config.loss_chunk
    model = Transformer(c)
    head = model.lm_head(abstract_params(c))
    head_shard = model.lm_head(sh.param_shardings(c, mesh))
    b, t = train_config.micro_batch_size, train_config.seq_len
    x_shard = NamedSharding(mesh, sh.logical_to_mesh_spec(("batch", "length", "act_embed")))
    x = jax.ShapeDtypeStruct((b, t, c.d_model), c.jnp_dtype, sharding=x_shard)
    t_shard = sh.batch_sharding(mesh)
    targets = jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=t_shard)

    def loss(x, head, targets):
        w = head.astype(c.jnp_dtype)
        if chunk:
            ce, z, _ = lm_head_cross_entropy_sums(x, w, targets, chunk_size=chunk,
                                                  z_loss=train_config.z_loss)
        else:
            logits = head_logits(x, w)
            ce, z, _ = cross_entropy_sums(logits, targets, None, train_config.z_loss)
        return ce + z

    grad = sh.jit_sharded(jax.grad(loss, argnums=(0, 1)), mesh, (x_shard, head_shard, t_shard),
                          (x_shard, head_shard))
    stats = grad.lower(x, sh.with_shardings(head, head_shard), targets).compile().memory_analysis()
    return int(stats.temp_size_in_bytes)


def memory_report(name: str, mesh_sizes: tuple[int, int, int], batch: int, seq: int, *,
                  remat: str | None = None, dtype: str | None = None, mesh: Any = None,
                  attention: str | None = None, loss_chunk: int = 0) -> MemoryReport:
    """The full report; with ``mesh`` (a real mesh of ``mesh_sizes``) also compiled numbers.

    Args:
      name: preset name or TOML path.
      mesh_sizes: concrete (data, fsdp, tensor).
      batch: global batch B.
      seq: sequence length T.
      remat, dtype, attention: overrides of the preset's remat, dtype and ``attention_impl``.
      mesh: a device mesh to compile on; None skips the compiled analysis.
      loss_chunk: ``train.loss_chunk`` (0: the full [B, T, V] logits).
    """
    from transformer_jax.train.memory import activation_bytes

    model_config, train_config = _configs(name, batch, seq, remat=remat, dtype=dtype,
                                          attention_impl=attention, loss_chunk=loss_chunk)
    state = state_memory(model_config, mesh_sizes, train_config)
    report = MemoryReport(config=name, mesh=tuple(mesh_sizes), batch=batch, seq=seq,
                          remat=model_config.remat, dtype=model_config.dtype,
                          attention=model_config.attention_impl, loss_chunk=loss_chunk,
                          param_count=state["param_count"], params_bytes=state["params"],
                          adam_bytes=state["adam"], state_bytes=state["state"],
                          active_param_count=param_counts(model_config)[1],
                          experts_bytes=state["experts"])
    report.rough_activations_bytes = activation_bytes(
        model_config, train_config, dict(zip(mesh_axes(mesh_sizes), mesh_sizes, strict=True)))
    if mesh is not None:
        report.compiled = compiled_memory(model_config, train_config, mesh)
        report.activations_bytes = compiled_activations(model_config, train_config, mesh)
        report.loss_head_bytes = compiled_loss_head(model_config, train_config, mesh)
    return report


def compile_times(name: str, mesh: Any, batch: int, seq: int, layers: tuple[int, ...] = (32, 4),
                  remat: str | None = None, dtype: str | None = None, repeats: int = 2
                  ) -> dict[int, dict[str, float]]:
    """Lowering and compile seconds of the scanned train step at each depth in ``layers``: the
    fastest of ``repeats`` runs, interleaved, each a fresh step function (no cache hit)."""
    out: dict[int, dict[str, float]] = {}
    for _ in range(repeats):
        for n_layers in layers:
            model_config, train_config = _configs(name, batch, seq, remat=remat, dtype=dtype,
                                                  n_layers=n_layers, scan_layers=True)
            lowered, lower_s = lower_train_step(model_config, train_config, mesh)
            run = {"lower_s": lower_s, "compile_s": args_lib.timed(lowered.compile)[0]}
            best = out.get(n_layers)
            if best is None or sum(run.values()) < sum(best.values()):
                out[n_layers] = run
    return out


def _configs(name: str, batch: int, seq: int, loss_chunk: int = 0,
             **model_changes: Any) -> tuple[Any, Any]:
    from transformer_jax.train.config import TrainConfig

    if not load_toml(name).get("model"):
        raise ValueError(f"--config {name}: the preset has no [model] table (its model comes "
                         "from train.init_from); give a preset or TOML file with a model, e.g. "
                         "llama2_7b")
    changes = {k: v for k, v in model_changes.items() if v is not None}
    model_config = ModelConfig.preset(name).replace(**changes)
    if seq > model_config.max_seq_len:
        print(f"(max_seq_len {model_config.max_seq_len} of {name} raised to --seq {seq} for "
              "this report)", file=sys.stderr)
        model_config = model_config.replace(max_seq_len=seq)
    train_config = TrainConfig(batch_size=batch, seq_len=seq, warmup_steps=0, loss_chunk=loss_chunk)
    return model_config, train_config


def kv_cache_report(name: str, batch: int, seq: int, dtype: str) -> dict[str, Any]:
    """Prints and returns the inference KV cache of B sequences of ``seq`` positions against every
    layer global and expanded."""
    c = ModelConfig.preset(name)
    held = cache_bytes(c, batch, seq, dtype)
    expanded = c if c.mla is None else c.replace(  # latent layers as N heads' K and V
        mla=None, head_dim=(c.mla.qk_head_dim + c.mla.v_head_dim) // 2)
    full = cache_bytes(expanded, batch, seq, dtype, window_rings=False)
    kinds = c.layer_kinds()
    kept = ", ".join(f"{kinds.count(k)} {k}" for k in dict.fromkeys(kinds))  # "22 local, 4 global"
    print(f"  KV cache    B={batch} S={seq} {dtype}: {_gib(held)} ({kept} layers; window "
          f"{c.sliding_window}, chunk {c.attention_chunk}); every layer global and expanded "
          f"{_gib(full)}: {held / full:.3f}x")
    return {"kv_cache_bytes": held, "kv_cache_all_global_bytes": full}


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / GIB:9.3f} GiB"


def main(argv: list[str]) -> int:
    parser = args_lib.parser("memory", __doc__)
    parser.add_argument("--config", default="llama2_7b", help="preset name or TOML path")
    parser.add_argument("--mesh", default="1,8,1", help="data,fsdp,tensor (one may be -1)")
    parser.add_argument("--devices", type=int, default=None,
                        help="simulated devices (default: the mesh's product, or 8 with -1)")
    parser.add_argument("--batch", type=int, default=8, help="global batch size B")
    parser.add_argument("--seq", type=int, default=2048, help="sequence length T")
    parser.add_argument("--remat", default=None, help="model.remat (default: the preset's)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="compute dtype (parameters and Adam state stay float32)")
    parser.add_argument("--attention", default=None,
                        choices=("auto", "xla", "chunked", "cudnn", "pallas", "mosaic"),
                        help="attention implementation (default: the preset's)")
    parser.add_argument("--loss-chunk", type=int, default=0,
                        help="positions a sequence per chunk of LM head + loss (0: all)")
    parser.add_argument("--no-compile", action="store_true",
                        help="only the eval_shape numbers (seconds instead of minutes)")
    parser.add_argument("--compile-time", action="store_true",
                        help="time lowering+compiling the scanned train step at 32 vs 4 layers")
    parser.add_argument("--layers", default="32,4", help="depths for --compile-time")
    parser.add_argument("--repeats", type=int, default=2,
                        help="--compile-time runs per depth (the fastest counts)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    layers = _check_args(parser, args)

    try:
        mesh_config = sh.MeshConfig.parse(args.mesh)
        n_devices = args.devices or (math.prod(mesh_config.sizes) if -1 not in mesh_config.sizes
                                     else 8)
        sizes = mesh_config.resolve(n_devices)
        if args.batch % (sizes[0] * sizes[1]):
            raise ValueError(f"--batch {args.batch} must be a multiple of data x fsdp = "
                             f"{sizes[0] * sizes[1]} (the batch is split over both; e.g. "
                             f"--batch {sizes[0] * sizes[1]} for one sequence per device)")
        configs = [_configs(args.config, args.batch, args.seq, remat=args.remat,
                            dtype=args.dtype, attention_impl=args.attention,
                            loss_chunk=args.loss_chunk, n_layers=n_layers)
                   for n_layers in (None, *(layers if args.compile_time else ()))]
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    # The simulated CPU devices, asked for before JAX's backend starts (if it has, see below).
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized():
        flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                       os.environ.get("XLA_FLAGS", ""))
        os.environ["XLA_FLAGS"] = (f"{flags} --xla_force_host_platform_device_count="
                                   f"{n_devices}").strip()
        jax.config.update("jax_platforms", "cpu")
    try:
        # The model against the mesh (divisibility), from shapes alone, before any device.
        state_memory(configs[0][0], sizes, configs[0][1])
        if len(jax.devices()) < n_devices:
            raise RuntimeError(f"the JAX backend started before the bench could ask for "
                               f"{n_devices} CPU devices (it has {len(jax.devices())}); run the "
                               "bench in a fresh process")
        return _run(args, mesh_config, sizes, n_devices, layers)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[int, ...]:
    """Exits with an argparse error for a value no report can use; returns the ``--layers``."""
    for flag, value, minimum in (("--seq", args.seq, 1), ("--batch", args.batch, 1),
                                 ("--loss-chunk", args.loss_chunk, 0),
                                 ("--repeats", args.repeats, 1),
                                 ("--devices", 1 if args.devices is None else args.devices, 1)):
        if value < minimum:
            parser.error(f"{flag} must be >= {minimum}, got {value}")
    if args.attention in ("cudnn", "pallas", "mosaic"):
        parser.error(f"--attention {args.attention} is a GPU/TPU kernel; this bench compiles on "
                     "simulated CPU devices: use auto, xla or chunked")
    try:
        layers = tuple(int(x) for x in args.layers.split(","))
    except ValueError:
        layers = ()
    if not layers or min(layers) < 1:
        parser.error(f"--layers must be positive depths such as 32,4, got {args.layers!r}")
    return layers


def _run(args: argparse.Namespace, mesh_config: Any, sizes: tuple[int, int, int],
         n_devices: int, layers: tuple[int, ...]) -> int:
    mesh = sh.make_mesh(mesh_config, jax.devices()[:n_devices])
    if args.compile_time:
        times = compile_times(args.config, mesh, args.batch, args.seq, layers, args.remat,
                              args.dtype, args.repeats)
        print(f"{args.config} train step, scanned, mesh {mesh_config.describe()}, "
              f"B={args.batch} T={args.seq}")
        for n, t in times.items():
            print(f"  {n:3d} layers: lower {t['lower_s']:6.2f} s, compile {t['compile_s']:6.2f} s,"
                  f" total {t['lower_s'] + t['compile_s']:6.2f} s (best of {args.repeats})")
        result: dict[str, Any] = {"compile_times": times}
        if len(layers) > 1:
            deep, shallow = (sum(times[n].values()) for n in layers[:2])  # lower + compile
            ratio = deep / shallow
            print(f"  ratio {layers[0]} / {layers[1]} layers (lower + compile): {ratio:.2f}")
            result["ratio"] = ratio
    else:
        report = memory_report(args.config, sizes, args.batch, args.seq, remat=args.remat,
                               dtype=args.dtype, mesh=None if args.no_compile else mesh,
                               attention=args.attention, loss_chunk=args.loss_chunk)
        picked = report.attention
        if picked == "auto":  # what "auto" runs for this shape here (q and k of one device)
            c = ModelConfig.preset(args.config)
            b = max(1, args.batch // (sizes[0] * sizes[1]))
            q = jax.ShapeDtypeStruct((b, args.seq, c.n_heads, c.head_dim), jnp.dtype(report.dtype))
            k = jax.ShapeDtypeStruct((b, c.n_kv_heads, args.seq, c.head_dim), q.dtype)
            picked = f"auto -> {choose_impl(q, k)}"
        loss = f"chunked by {report.loss_chunk} positions" if report.loss_chunk else "full"
        active = "" if report.active_param_count == report.param_count else \
            f" ({report.active_param_count:,} active per token)"
        print(f"{args.config}: {report.param_count:,} parameters{active}; mesh "
              f"{mesh_config.describe()} = {sizes}; B={args.batch} T={args.seq} "
              f"remat={report.remat} dtype={report.dtype} attention={picked} loss={loss}")
        print(f"  per device  parameters          {_gib(report.params_bytes)}")
        print(f"              Adam mu+nu (f32)    {_gib(report.adam_bytes)}")
        print(f"              train state total   {_gib(report.state_bytes)}")
        if report.experts_bytes:
            print(f"              of it experts       {_gib(report.experts_bytes)} "
                  "(parameters + Adam; their gradients as much again as the parameters)")
        print(f"  estimated   activations (rough) {_gib(report.rough_activations_bytes)} "
              "(train.memory, the run's memory check)")
        if report.compiled:
            c = report.compiled
            print(f"  compiled    arguments           {_gib(c['argument'])}")
            print(f"              temporaries         {_gib(c['temp'])}")
            print(f"              activations (est.)  {_gib(report.activations_bytes)}")
            print(f"              peak (est.)         {_gib(c['peak_estimate'])}")
            share = report.loss_head_bytes / c["peak_estimate"]
            print(f"              head + loss (est.)  {_gib(report.loss_head_bytes)}"
                  f" ({share:.1%} of the peak)")
        result = dataclasses.asdict(report)
        result.update(kv_cache_report(args.config, args.batch, args.seq, report.dtype))
    args_lib.write_json(args.json, result, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
