"""Compile a run's train step for a TPU pod on this host: ``transformer-jax compile``.

  transformer-jax compile --config llama3_8b --topology v5p:2x2x2 train.batch_size=8 \\
      train.seq_len=8192 model.dtype=bfloat16 model.remat=full
  transformer-jax compile --config tiny --topology v5e:2x2 --slices 2 --json
  transformer-jax compile --config llama3_8b --topology v5p:2x2x2 --find-batch --remat full
  transformer-jax compile --config decode_25m --topology v5e:2x2 --serve --tensor 4 --batch 8

The config and overrides are ``train``'s; the mesh is ``train.mesh``, else every chip an FSDP
device (``--slices N``: data=N over the slices). Nothing runs: the step is compiled by libtpu
(the ``tpu`` extra) for the topology's devices, and the memory per chip, whether it fits, the
compile time and the collectives of one step are printed (exit 1 when it does not fit).
``--serve`` compiles ``generate`` and the serving engine's step programs instead; ``--save
PATH`` writes the compiled step for ``train.compiled_step=PATH``; without ``--topology`` (or
``cpu``) the step is compiled for this host's devices.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from typing import Any

import jax

from transformer_jax.cli.common import PROG, fail, gib, peak_of
from transformer_jax.model.config import REMATS, load_toml
from transformer_jax.model.ops import target
from transformer_jax.parallel import collectives, pod
from transformer_jax.parallel.mesh import MeshConfig, make_mesh
from transformer_jax.parallel.sharding import configure_cpu_devices
from transformer_jax.train import executable
from transformer_jax.train.perf import enable_cpu_fast_math

EXIT_DOES_NOT_FIT = 1


def _mesh_config(config: str, overrides: list[str], train: Any, slices: int
                 ) -> tuple[Any, Any, str]:
    """The mesh the run asks for, or FSDP over every chip, and its DCN mesh
    (``train.dcn_mesh``); with a line saying which."""
    dcn = MeshConfig.parse(train.dcn_mesh)
    given = any(o.split("=", 1)[0].strip() == "train.mesh" for o in overrides) or \
        "mesh" in load_toml(config).get("train", {})
    if given:
        return MeshConfig.parse(train.mesh), dcn, f"train.mesh={train.mesh}"
    mesh = pod.default_mesh(slices, dcn)
    return mesh, dcn, "train.mesh unset: every chip an FSDP device" + (
        f", data={mesh.data} over the slices" if mesh.data > 1 else "")


def compile_report(config: str, overrides: list[str], topology: str | None, slices: int = 1, *,
                   hlo: bool = False, save: str | None = None) -> dict[str, Any]:
    """Compiles the run's train step for ``topology`` and returns the per-chip report.

    ``topology`` None (or ``"cpu"``) compiles for this process's devices over ``train.mesh``.
    ``save`` writes the compiled step to that file (``train.executable``; the report's ``saved``).

    Returns:
      A JSON-ready dict: ``fits`` False (with ``error``, the compiler's line) when the compiler
      ran out of memory; else memory per chip in bytes, ``compile_s``, ``collectives``,
      ``mosaic_calls`` and, with ``hlo``, the compiled program's text.

    Raises:
      ConfigError / ValueError: a bad config, override, mesh or batch split.
      TopologyError: no libtpu, or a topology libtpu does not know.
    """
    from transformer_jax.bench.memory import lower_train_step
    from transformer_jax.cli.compile_serve import program_report
    from transformer_jax.train.config import build_configs

    model, train, _ = build_configs(config, overrides)
    if topology in (None, "cpu"):
        devices = jax.devices(topology)
        mesh = make_mesh(MeshConfig.parse(train.mesh), devices, MeshConfig.parse(train.dcn_mesh))
        mesh_note, per_chip, topology = f"train.mesh={train.mesh}", 1, topology or "local"
    else:
        devices = pod.topology_devices(topology, slices)
        mesh_config, dcn_config, mesh_note = _mesh_config(config, overrides, train, slices)
        mesh = pod.pod_mesh(mesh_config, devices, slices, dcn_config)
        per_chip = pod.devices_per_chip(devices)
    hbm = pod.hbm_bytes(devices[0])
    hbm = hbm // per_chip if hbm else None
    report: dict[str, Any] = {
        "config": config, "overrides": overrides, "topology": topology, "slices": slices,
        "device_kind": devices[0].device_kind, "devices": len(devices),
        "mesh": dict(mesh.shape), "mesh_from": mesh_note,
        "dcn_mesh": dict(zip(mesh.axis_names, pod.dcn_sizes(mesh), strict=True)),
        "target": target.of_mesh(mesh),
        "batch_size": train.batch_size, "seq_len": train.seq_len, "dtype": model.dtype,
        "remat": model.remat, "attention": model.attention_impl, "hbm_bytes": hbm}
    lowered, report["lower_s"] = lower_train_step(model, train, mesh)
    with executable.uncached() if save else contextlib.nullcontext():
        compiled, fields = pod.compile_memory(lowered)
    report.update(fields)
    if compiled is None:
        return report
    if save:
        header = executable.describe(compiled, model, train, mesh, config=config,
                                     overrides=overrides, topology=topology, slices=slices)
        report["saved"] = {"path": save, "bytes": executable.save(save, compiled, header)}
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    # XLA counts a while body (the scanned layer stack) once, not once per layer.
    report["flops_hlo"] = float((cost or {}).get("flops", 0.0))
    return program_report(report, compiled, mesh, hlo)


def find_batch(config: str, overrides: list[str], topology: str, slices: int = 1,
               remats: tuple[str, ...] = ("none", "full"), most: int = 4096
               ) -> dict[str, Any]:
    """For each remat policy, the largest per-chip batch whose train step fits a chip.

    The per-chip batch is the micro-batch over data x fsdp x expert. Each probe is a compile;
    the search doubles from 1, then bisects.

    Returns:
      ``{remat: {"per_chip", "batch_size", "peak" and "host" (bytes in HBM and in host memory of
      the largest that fits, or None), "probes" [[per_chip, fits], ...], "seconds"}}``, with
      ``"hbm_bytes"`` and the mesh.
    """
    from transformer_jax.train.config import build_configs

    _, train, _ = build_configs(config, overrides)
    devices = pod.topology_devices(topology, slices)
    mesh_config, _, _ = _mesh_config(config, overrides, train, slices)
    sizes = dict(zip(mesh_config.axes, mesh_config.resolve(len(devices)), strict=True))
    split = sizes["data"] * sizes["fsdp"] * sizes.get("expert", 1)
    out: dict[str, Any] = {"mesh": sizes, "batch_devices": split, "policies": {}}
    for remat in remats:
        fitted: dict[int, tuple[int, int]] = {}  # per_chip -> (peak, host) bytes

        def fits(per_chip: int, remat: str = remat, fitted: dict = fitted) -> bool:
            batch = per_chip * split * train.grad_accum
            r = compile_report(config, [*overrides, f"model.remat={remat}",
                                        f"train.batch_size={batch}"], topology, slices)
            out["hbm_bytes"] = r["hbm_bytes"]
            if r["fits"]:
                fitted[per_chip] = r["memory"]["peak"], r["memory"].get("host_temp", 0)
            return r["fits"]

        start = time.perf_counter()
        best, probes = pod.largest_fitting(fits, most)
        peak, host = fitted.get(best, (None, None))
        out["policies"][remat] = {
            "per_chip": best, "batch_size": best * split * train.grad_accum, "peak": peak,
            "host": host, "probes": [list(p) for p in probes],
            "seconds": time.perf_counter() - start}
    return out


def format_batches(found: dict[str, Any], topology: str) -> str:
    """``find_batch``'s result as the lines the command prints."""
    mesh = " x ".join(f"{k}={v}" for k, v in found["mesh"].items())
    lines = [f"largest per-chip batch on {topology} (mesh {mesh}; the batch splits over "
             f"{found['batch_devices']} devices; {gib(found.get('hbm_bytes'))} HBM a chip)"]
    for remat, row in found["policies"].items():
        probes = " ".join(f"{n}{'' if ok else 'x'}" for n, ok in row["probes"])
        fit = (f"{row['per_chip']} (train.batch_size={row['batch_size']}, peak "
               f"{gib(row['peak'])})" if row["per_chip"] else "none fits")
        host = f", {gib(row['host'])} on the host" if row.get("host") else ""
        lines.append(f"  remat={remat:<24} {fit}{host}; probes {probes} ({row['seconds']:.0f} s)")
    return "\n".join(lines)


def format_report(r: dict[str, Any]) -> str:
    """The report as the lines the command prints."""
    mesh = " x ".join(f"{k}={v}" for k, v in r["mesh"].items())
    lines = [f"{r['config']} on {r['topology']}" + (f" x {r['slices']} slices"
                                                    if r["slices"] > 1 else "") +
             f" ({r['devices']} x {r['device_kind']}, {gib(r['hbm_bytes'])} HBM each), "
             f"target {r['target']}",
             f"  mesh {mesh} ({r['mesh_from']}" + ("; over DCN " + " x ".join(
                 f"{k}={v}" for k, v in r["dcn_mesh"].items() if v > 1) if r["slices"] > 1
                 else "") + f"); B={r['batch_size']} T={r['seq_len']} "
             f"dtype={r['dtype']} remat={r['remat']} attention={r['attention']}",
             f"  lower {r['lower_s']:.1f} s, compile {r['compile_s']:.1f} s"]
    m = r["memory"]
    lines += ["  per chip", f"    arguments    {gib(m['argument'])}",
              f"    output       {gib(m['output'])} ({gib(m['alias'])} of it aliased to the "
              "donated arguments)", f"    temporaries  {gib(m['temp'])}",
              f"    peak         {peak_of(m['peak'], r['hbm_bytes'], r['fits'])}",
              *([f"    host memory  {gib(m['host_temp'])} of temporaries (offloaded "
                 "activations)"] if m.get("host_temp") else []),
              f"  flops per chip (HLO; a scanned layer body counted once): {r['flops_hlo']:.3e}",
              f"  Mosaic kernel calls in the program: {r['mosaic_calls']}",
              "  collectives of one step (count, bytes per chip)"]
    c = r["collectives"]
    lines += collectives.table_lines(c)
    if r["slices"] > 1:
        crossing = ", ".join(f"{k} x{v['count']} ({v['bytes'] / 2**20:.2f} MiB)"
                             for k, v in c["cross_slice"].items()) or "none"
        lines.append(f"  crossing slices (DCN): {crossing}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"{PROG} compile", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="tiny", help="preset name or TOML path")
    parser.add_argument("--topology", help="TPU topology, e.g. v5e:2x2, v5p:4x4x4, v6e:16x16; "
                        "default (or cpu): this host's devices, over the run's train.mesh")
    parser.add_argument("--slices", type=int, default=1, help="slices joined by DCN")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--save", metavar="PATH", help="write the compiled train step to PATH, "
                        "for train.compiled_step=PATH (loads on the devices it was compiled for)")
    parser.add_argument("--cpu-devices", type=int, default=0, metavar="N",
                        help="compiling for this host's CPU: as train's --cpu-devices")
    parser.add_argument("--no-fast-math", action="store_true",
                        help="compiling for this host's CPU: as train's --no-fast-math")
    parser.add_argument("--find-batch", action="store_true",
                        help="find the largest per-chip batch that fits, for each remat policy "
                        "(one compile a probe)")
    parser.add_argument("--remat", action="append",
                        help="with --find-batch: the policies to search (repeatable; default all)")
    serve = parser.add_argument_group(
        "--serve", "compile generate (prefill and the decode loop) instead of the train step")
    serve.add_argument("--serve", action="store_true", help="compile generate")
    serve.add_argument("--tensor", type=int, help="tensor axis of the decode mesh (default: "
                       "every chip); must divide the kv heads")
    serve.add_argument("--expert", type=int, default=1, help="expert axis (a mixture's)")
    serve.add_argument("--batch", type=int, default=8, help="B, sequences (default 8)")
    serve.add_argument("--prompt-len", type=int, default=128, help="T, prompt length (128)")
    serve.add_argument("--new-tokens", type=int, default=128, help="N, new tokens (128)")
    serve.add_argument("--cache-size", type=int, help="S, KV cache slots (default T + N)")
    serve.add_argument("--only", choices=("generate", "engine"),
                       help="compile only generate, or only the engine's step programs")
    serve.add_argument("--pages", type=int, help="the engine's pool: P pages (default: every "
                       "slot, --batch, at the full context)")
    serve.add_argument("--page-size", type=int, default=16, help="positions per page (16)")
    serve.add_argument("--chunk", type=int, default=256, help="C, the engine's prefill chunk "
                       "(its token budget less the slots; 256)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="override one field of the config, as for train")
    args = parser.parse_intermixed_args(argv)
    if args.slices < 1:
        parser.error(f"--slices must be >= 1, got {args.slices}")
    # It only compiles, never claims a chip: two compiles at once need not exclude each other.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    given = [f"--{k.replace('_', '-')}" for k in (
        "tensor", "expert", "batch", "prompt_len", "new_tokens", "cache_size", "only", "pages",
        "page_size", "chunk") if getattr(args, k) != parser.get_default(k)]
    if given and not args.serve:
        parser.error(f"{', '.join(given)} go with --serve")
    if args.serve and (args.find_batch or args.slices != 1):
        parser.error("--serve compiles generate on one slice; not with --find-batch or --slices")
    if args.remat and not args.find_batch:
        parser.error("--remat goes with --find-batch")
    if args.save and (args.serve or args.find_batch):
        parser.error("--save saves the train step; not with --serve or --find-batch")
    if args.topology in (None, "cpu") and (args.serve or args.find_batch or args.slices != 1):
        parser.error("--serve, --find-batch and --slices need a TPU --topology")
    if args.topology not in (None, "cpu") and (args.cpu_devices or args.no_fast_math):
        parser.error("--cpu-devices and --no-fast-math are for this host's CPU (no --topology)")
    from transformer_jax.cli.compile_engine import engine_report, format_engine_report
    from transformer_jax.cli.compile_serve import format_serve_report, serve_report
    from transformer_jax.train.config import ConfigError, build_configs  # (slow: after the flags)

    if args.topology in (None, "cpu"):  # train's CPU devices and fast math, before JAX starts
        try:  # (a saved step loads only where both match)
            _, train, _ = build_configs(args.config, args.overrides)
            if not args.no_fast_math:
                enable_cpu_fast_math()
            configure_cpu_devices(train.micro_batch_size, args.cpu_devices)
        except (ConfigError, ValueError, FileNotFoundError) as e:
            return fail(str(e).splitlines()[0])
    for remat in args.remat or ():
        if remat not in REMATS:
            parser.error(f"--remat must be one of {', '.join(REMATS)}, got {remat!r}")
    try:
        if args.find_batch:
            found = find_batch(args.config, args.overrides, args.topology, args.slices,
                               tuple(args.remat or REMATS))
            print(json.dumps(found) if args.json else format_batches(found, args.topology))
            return 0
        if args.serve:
            report = {"fits": True}
            if args.only != "engine":
                report = serve_report(args.config, args.overrides, args.topology,
                                      tensor=args.tensor, expert=args.expert, batch=args.batch,
                                      prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                                      cache_size=args.cache_size)
            if report["fits"] and args.only != "generate":  # fits: both's
                report["engine"] = engine = engine_report(
                    args.config, args.overrides, args.topology, tensor=args.tensor,
                    expert=args.expert, slots=args.batch, pages=args.pages,
                    page_size=args.page_size, chunk=args.chunk)
                report.setdefault("device_kind", engine["device_kind"])
                report["fits"] = engine["fits"]
                for name, program in engine["programs"].items():
                    if "error" in program:
                        report["error"] = f"the engine's {name} step: {program['error']}"
        else:
            report = compile_report(args.config, args.overrides, args.topology, args.slices,
                                    save=args.save)
    except (ConfigError, ValueError, FileNotFoundError, ModuleNotFoundError,
            NotImplementedError) as e:
        # ModuleNotFoundError: a kernel's library (tokamax: attention auto/mosaic on TPU);
        # NotImplementedError: a kernel XLA cannot partition over this mesh.
        hint = (" (model.attention_impl=chunked or xla avoids the TPU kernels)"
                if isinstance(e, ModuleNotFoundError | NotImplementedError) else "")
        return fail(f"{str(e).splitlines()[0]}{hint}")
    if not report["fits"] and "error" in report:  # generate's, or an engine program's
        print(f"error: does not fit on {args.topology} ({report['device_kind']}): "
              f"{report['error']}", file=sys.stderr)
        if args.json:
            print(json.dumps(report))
        return EXIT_DOES_NOT_FIT
    if args.json:
        print(json.dumps(report))
    elif args.serve:
        print("\n".join(([format_serve_report(report)] if "program" in report else [])
                        + ([format_engine_report(report["engine"])] if "engine" in report
                           else [])))
    else:
        print(format_report(report))
        if "saved" in report:
            print(f"  saved the compiled train step to {args.save} "
                  f"({report['saved']['bytes'] / 2**20:.1f} MiB): train.compiled_step={args.save}")
    return 0 if report["fits"] else EXIT_DOES_NOT_FIT
