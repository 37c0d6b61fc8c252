"""``transformer-jax compile --serve``: ``generate`` compiled for a TPU pod on this host.

The jitted decode (``decode.loop.generate_padded``: prefill, then the decode loop) is lowered on
abstract inputs, the TPU target's prepared weights placed over a decode mesh (``tensor`` over
the chips, optionally ``expert``), and compiled by the TPU compiler for the topology's devices.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from transformer_jax.bench.args import timed
from transformer_jax.cli.common import gib, peak_of
from transformer_jax.decode import loop as decode
from transformer_jax.decode.prompts import validate_capacity
from transformer_jax.model.kv_cache import cache_bytes
from transformer_jax.parallel import collectives, pod
from transformer_jax.parallel.mesh import MeshConfig
from transformer_jax.train.config import build_configs


def serve_report(config: str, overrides: list[str], topology: str, *, tensor: int | None = None,
                 expert: int = 1, batch: int = 8, prompt_len: int = 128, new_tokens: int = 128,
                 cache_size: int | None = None, hlo: bool = False) -> dict[str, Any]:
    """Compiles ``generate`` for ``topology`` over a decode mesh and returns the per-chip report.

    Args:
      config, overrides: the run's config (preset or TOML) and its overrides (the model's).
      topology: a TPU topology (``"v5e:2x2"``).
      tensor: T, the tensor axis (default: every chip over ``expert``); divides the kv heads.
      expert: X, a mixture's expert axis (1: none). The mesh takes the first T x X devices.
      batch, prompt_len, new_tokens: B, T and N of the compiled program.
      cache_size: S, the KV cache's slots (default T + N).
      hlo: include the compiled program's text.

    Returns:
      A JSON-ready dict: ``fits`` False (with ``error``) when the compiler ran out of memory;
      else ``memory`` per chip in bytes, ``compile_s``, ``collectives`` and
      ``cache_bytes_per_chip`` (``cache_bytes`` over the T shards of the kv heads).

    Raises:
      ConfigError / ValueError: a bad config, override, mesh size or B, T, N, S.
      TopologyError: no libtpu, or a topology libtpu does not know.
    """
    model, _, _ = build_configs(config, overrides)
    for name, value in (("--batch", batch), ("--prompt-len", prompt_len),
                        ("--new-tokens", new_tokens), ("--expert", expert)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    cache_size = prompt_len + new_tokens if cache_size is None else cache_size
    validate_capacity(model, [prompt_len], new_tokens, cache_size)
    devices, mesh, hbm, weights = decode_setup(model, topology, tensor, expert)
    tensor = mesh.shape["tensor"]
    cache = cache_bytes(model, batch, cache_size)
    report: dict[str, Any] = {
        "program": "generate", "config": config, "overrides": overrides, "topology": topology,
        "device_kind": devices[0].device_kind, "devices": tensor * expert,
        "topology_devices": len(devices), "mesh": dict(mesh.shape), "dtype": model.dtype,
        "batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
        "cache_size": cache_size, "attention": model.attention_impl, "hbm_bytes": hbm,
        "cache_bytes": cache, "cache_bytes_per_chip": cache // tensor,
        "weight_bytes": weights.nbytes}
    rep = NamedSharding(mesh, P())
    inputs = (jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32, sharding=rep),
              jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=rep),
              jax.ShapeDtypeStruct((batch, 2), jnp.uint32, sharding=rep))
    report["lower_s"], lowered = timed(lambda: decode._generate_jit.lower(
        model, weights, *inputs, max_new_tokens=new_tokens, cache_size=cache_size, mesh=mesh))
    return compiled_report(report, lowered, mesh, hlo)


def decode_setup(model: Any, topology: str, tensor: int | None, expert: int
                 ) -> tuple[list[Any], Any, int | None, Any]:
    """The topology's devices, the decode mesh (T x X of them), a chip's HBM per device, and
    ``prepare``'s TPU weights as ``ShapeDtypeStruct``s placed over the mesh (``DecodeWeights``).

    Raises:
      ValueError: a mesh the topology or the model cannot take. TopologyError: no libtpu.
    """
    if expert < 1:
        raise ValueError(f"--expert must be >= 1, got {expert}")
    devices = pod.topology_devices(topology)
    if tensor is None:
        tensor = max(1, len(devices) // expert)
    if tensor < 1 or tensor * expert > len(devices):
        raise ValueError(f"--tensor {tensor} x --expert {expert} devices: {topology} has "
                         f"{len(devices)}")
    decode.check_tensor_parallel(model, tensor, expert)
    mesh = pod.pod_mesh(MeshConfig(data=1, fsdp=1, tensor=tensor, expert=expert),
                        devices[:tensor * expert])
    hbm = pod.hbm_bytes(devices[0])
    hbm = hbm // pod.devices_per_chip(devices) if hbm else None
    aw = decode.abstract_weights(model, platform="tpu")
    shardings = decode.weight_shardings(model, mesh, aw.out_first, aw.quant, aw.experts_split)
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          aw.params, shardings)
    weights = decode.DecodeWeights(params, model, mesh, aw.out_first, aw.quant, aw.experts_split)
    return devices, mesh, hbm, weights


def compiled_report(report: dict[str, Any], lowered: Any, mesh: Any, hlo: bool) -> dict[str, Any]:
    """``report`` with the compile of ``lowered`` added: ``compile_s`` and ``memory`` per
    chip, then ``program_report``'s fields (or ``fits`` False and the compiler's ``error``)."""
    compiled, fields = pod.compile_memory(lowered)
    report.update(fields)
    return report if compiled is None else program_report(report, compiled, mesh, hlo)


def program_report(report: dict[str, Any], compiled: Any, mesh: Any, hlo: bool) -> dict[str, Any]:
    """``report`` (with ``memory`` and ``hbm_bytes``) with ``fits``, the ``collectives`` of
    ``compiled`` by kind and mesh axis, ``mosaic_calls`` (the Pallas TPU kernels' custom calls)
    and, with ``hlo``, the program's text."""
    hbm = report["hbm_bytes"]
    report["fits"] = hbm is None or report["memory"]["peak"] <= hbm
    ids, axes = pod.slice_mesh(mesh)
    text = compiled.as_text()
    report["collectives"] = collectives.summarize(collectives.collectives(
        text, ids, axes, pod.dcn_axes(mesh) or "data"))
    report["mosaic_calls"] = text.count('custom_call_target="tpu_custom_call"')
    if hlo:
        report["hlo"] = text
    return report


def format_serve_report(r: dict[str, Any]) -> str:
    """``serve_report``'s result as the lines the command prints."""
    mesh = " x ".join(f"{k}={v}" for k, v in r["mesh"].items() if v > 1 or k == "tensor")
    m = r["memory"]
    lines = [f"generate of {r['config']} on {r['topology']} ({r['devices']} of "
             f"{r['topology_devices']} x {r['device_kind']}, {gib(r['hbm_bytes'])} HBM each)",
             f"  mesh {mesh}; B={r['batch']} T={r['prompt_len']} N={r['new_tokens']} "
             f"S={r['cache_size']} dtype={r['dtype']} attention={r['attention']}",
             f"  lower {r['lower_s']:.1f} s, compile {r['compile_s']:.1f} s",
             "  per chip",
             f"    arguments    {gib(m['argument'])} (the weights {gib(r['weight_bytes'])} "
             "over the mesh, and the inputs)",
             f"    output       {gib(m['output'])}",
             f"    temporaries  {gib(m['temp'])} (the KV cache, "
             f"{gib(r['cache_bytes_per_chip'])} a chip, is here unless it fits VMEM)",
             f"    peak         {peak_of(m['peak'], r['hbm_bytes'], r['fits'])}",
             f"  Mosaic kernel calls in the program: {r['mosaic_calls']}",
             "  collectives of one generate (count, bytes per chip; the decode loop's body "
             "counted once)"]
    c = r["collectives"]
    lines += collectives.table_lines(c)
    return "\n".join(lines)
