"""``transformer-jax compile --serve``: the serving engine's step programs compiled for a TPU pod.

The programs ``Engine.compile`` warms up (``serving.step.step_jit``): the decode rows (one token
for each of the B slots) and a prefill chunk of C tokens, at the widest page table (W pages of
``max_seq_len``) over a pool of P pages, their inputs placed over the decode mesh as the engine
places them (the pages split by kv head over the tensor axis, and donated).
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from transformer_jax.cli.common import gib, peak_of
from transformer_jax.cli.compile_serve import compiled_report, decode_setup
from transformer_jax.model.ops import paged_attention, target
from transformer_jax.parallel import collectives
from transformer_jax.serving import step as step_lib
from transformer_jax.serving.page_pool import pages_for
from transformer_jax.serving.paged_cache import PagedKVCache
from transformer_jax.serving.plan import row_sampling
from transformer_jax.train.config import build_configs


def engine_report(config: str, overrides: list[str], topology: str, *,
                  tensor: int | None = None, expert: int = 1, slots: int = 8,
                  pages: int | None = None, page_size: int = 16, chunk: int = 256,
                  hlo: bool = False) -> dict[str, Any]:
    """Compiles the engine's decode and prefill-chunk step programs for ``topology``.

    Args:
      config, overrides: the run's config and ``section.key=value`` overrides (the model's).
      topology: a TPU topology (``"v5e:2x2"``).
      tensor, expert: the decode mesh's axes (``compile_serve.serve_report``'s).
      slots: B, the engine's slots (decode rows).
      pages: P, pages in the pool, the null page included (default: every slot at the full
        context, as ``serve`` sizes it).
      page_size: positions per page.
      chunk: C, the prefill chunk's tokens (the token budget less the slots).
      hlo: include each compiled program's text.

    Returns:
      A JSON-ready dict: the shapes, ``pool_bytes(_per_chip)``, the paged ``kernels`` (None: the
      XLA views), ``programs`` {"decode", "prefill"} (``compiled_report``'s) and ``fits``.

    Raises:
      ConfigError / ValueError: a bad config, override, size or mesh.
      TopologyError: no libtpu, or a topology libtpu does not know.
    """
    model, _, _ = build_configs(config, overrides)
    for name, value in (("--batch", slots), ("--page-size", page_size), ("--chunk", chunk)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    width = pages_for(model.max_seq_len, page_size)
    pages = 1 + slots * width if pages is None else pages
    if pages < 2:
        raise ValueError(f"--pages must be >= 2 (page 0 is the null page), got {pages}")
    devices, mesh, hbm, weights = decode_setup(model, topology, tensor, expert)
    tensor = mesh.shape["tensor"]
    cache = jax.eval_shape(lambda: PagedKVCache.init(model, pages, page_size, slots=slots))
    rings = cache.ring is not None
    with target.targeting(target.of_mesh(mesh)):
        kernels = {name: paged_attention.plan(model.attention_impl, t, None, model.head_dim).kernel
                   for name, t in (("decode", 1), ("prefill", chunk))}
    report: dict[str, Any] = {
        "program": "engine step", "config": config, "overrides": overrides,
        "topology": topology, "device_kind": devices[0].device_kind,
        "devices": mesh.devices.size, "topology_devices": len(devices),
        "mesh": dict(mesh.shape), "dtype": model.dtype, "attention": model.attention_impl,
        "slots": slots, "pages": pages, "page_size": page_size, "chunk": chunk,
        "width": width, "hbm_bytes": hbm, "weight_bytes": weights.nbytes,
        "pool_bytes": cache.nbytes, "pool_bytes_per_chip": cache.nbytes // tensor,
        "kernels": kernels, "programs": {}}

    def placed(tree: Any, spec: P) -> Any:
        where = NamedSharding(mesh, spec)
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=where), tree)

    k_pages, v_pages = placed((cache.k, cache.v), step_lib.page_spec(model))
    ring_arrays = placed((cache.k_ring, cache.v_ring), step_lib.ring_spec(model)) if rings \
        else None

    def ints(*shape: int) -> jax.ShapeDtypeStruct:
        return placed(jax.ShapeDtypeStruct(shape, jnp.int32), P())

    programs = {
        "decode": (step_lib.DecodeRows(ints(slots), ints(slots), ints(slots, width)), None),
        "prefill": (None, step_lib.PrefillChunk(ints(1, chunk), ints(1), ints(1, width),
                                                ints(1), ints(1) if rings else None))}
    for name, (decode_rows, prefill) in programs.items():
        n = slots if prefill is None else 1
        sampling, sampler = row_sampling([None] * n, model.vocab_size)  # greedy, as compile()
        rows = placed(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), sampling), P())
        start = time.perf_counter()
        lowered = step_lib.step_jit.lower(
            model, weights.params, k_pages, v_pages, decode_rows, prefill, rows,
            sampler=sampler, view="auto", mesh=mesh, quant=weights.quant, rings=ring_arrays,
            adapters=None)
        program = {"rows": n, "tokens": 1 if prefill is None else chunk,
                   "lower_s": time.perf_counter() - start, "hbm_bytes": hbm}
        report["programs"][name] = compiled_report(program, lowered, mesh, hlo)
        if not program["fits"]:
            break
    report["fits"] = all(p["fits"] for p in report["programs"].values())
    return report


def format_engine_report(r: dict[str, Any]) -> str:
    """``engine_report``'s result as the lines the command prints."""
    kernels = ", ".join(f"{k} {v or 'XLA view'}" for k, v in r["kernels"].items())
    lines = [f"engine step of {r['config']} on {r['topology']} ({r['devices']} of "
             f"{r['topology_devices']} x {r['device_kind']}, {gib(r['hbm_bytes'])} HBM each)",
             f"  B={r['slots']} slots, P={r['pages']} pages of {r['page_size']}, chunk "
             f"C={r['chunk']}, page table W={r['width']}; dtype={r['dtype']} attention="
             f"{r['attention']} ({kernels})",
             f"  paged pool {gib(r['pool_bytes'])}, {gib(r['pool_bytes_per_chip'])} a chip "
             "(split by kv head; donated: in the arguments, aliased by the output)"]
    for name, p in r["programs"].items():
        m = p["memory"]
        lines += [f"  {name} [{p['rows']}, {p['tokens']}]: lower {p['lower_s']:.1f} s, "
                  f"compile {p['compile_s']:.1f} s, Mosaic kernel calls {p['mosaic_calls']}",
                  f"    arguments {gib(m['argument'])}, temporaries {gib(m['temp'])}, "
                  f"peak {peak_of(m['peak'], r['hbm_bytes'], p['fits'])}",
                  "    collectives of one step (count, bytes per chip)"]
        lines += ["  " + line for line in collectives.table_lines(p["collectives"])]
    return "\n".join(lines)
