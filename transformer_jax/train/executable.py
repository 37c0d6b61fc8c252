"""The compiled train step as a file (``transformer-jax compile --save PATH``), loaded by a run
with ``train.compiled_step=PATH``: a header line (``MAGIC``), a JSON line of what it was compiled
for (``describe``), then the serialized executable (a pickle: load only files you made).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax

logger = logging.getLogger(__name__)

MAGIC = b"transformer-jax compiled train step 1\n"

#: Train keys that leave the step's program as it is (a run may differ in them); the mesh is
#: compared by its sizes and devices instead of the text of ``train.mesh``.
RUN_ONLY_KEYS = ("seed", "eval_every", "eval_batches", "eval_sets", "log_every", "ckpt_every",
                 "keep_ckpts", "run_dir", "mesh", "dcn_mesh", "sample_tokens", "sample_prompt",
                 "sample_temperature", "profile_steps", "peak_flops", "allow_new_data",
                 "init_from", "compiled_step")


def _versions() -> dict[str, str]:
    import jaxlib

    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__}


def _train_keys(train_config: Any) -> dict[str, Any]:
    return {k: v for k, v in dataclasses.asdict(train_config).items() if k not in RUN_ONLY_KEYS}


def _inputs(args_tree: Any) -> dict[str, str]:
    """``{key path: "float32[4, 8]"}`` of each leaf of ``((state, batch), {})``."""
    leaves = jax.tree_util.tree_flatten_with_path(args_tree)[0]
    return {jax.tree_util.keystr(p): f"{jax.numpy.dtype(x.dtype).name}{list(x.shape)}"
            for p, x in leaves}


def _mesh_fields(mesh: Any) -> dict[str, Any]:
    device = mesh.devices.flat[0]
    # XLA:CPU compiles by the flags of the process (fast math: ``train.perf``); a TPU's are
    # the pod's, and the host that compiled for it may set its own.
    flags = os.environ.get("XLA_FLAGS", "") if device.platform == "cpu" else None
    return {"platform": device.platform, "device_kind": device.device_kind,
            "devices": int(mesh.devices.size), "mesh": {k: int(v) for k, v in mesh.shape.items()},
            "device_ids": [int(d.id) for d in mesh.devices.flat], "xla_flags": flags}


def describe(compiled: Any, model_config: Any, train_config: Any, mesh: Any,
             **extra: Any) -> dict[str, Any]:
    """The header of a compiled train step: what it was compiled for, and ``extra``."""
    return {**_versions(), **_mesh_fields(mesh), "model": dataclasses.asdict(model_config),
            "train": _train_keys(train_config), "inputs": _inputs(compiled.args_info), **extra}


@contextlib.contextmanager
def uncached() -> Iterator[None]:
    """Compiles inside skip JAX's persistent compilation cache (an XLA:CPU executable loaded
    from it serializes without its code)."""
    from jax.experimental.compilation_cache import compilation_cache

    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()  # jax decides once whether to use the cache: again
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", was)
        compilation_cache.reset_cache()


def save(path: str | Path, compiled: Any, header: dict[str, Any]) -> int:
    """Writes ``compiled`` (a ``jax.stages.Compiled`` train step) and its header to ``path``
    and returns the file's size in bytes (ValueError: the backend cannot serialize it)."""
    from jax.experimental import serialize_executable

    payload = pickle.dumps(serialize_executable.serialize(compiled))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(MAGIC + json.dumps(header).encode() + b"\n" + payload)
    tmp.replace(path)
    return path.stat().st_size


def _local(path: str | Path) -> Path:
    """``path``, or the local copy of a remote one (``gs://...``: ``storage.local_copy``)."""
    from transformer_jax import storage

    try:
        return storage.local_copy(path)
    except (FileNotFoundError, OSError) as e:
        raise ValueError(f"train.compiled_step={path}: cannot read it: {e.strerror or e}"
                         ) from None


def read_header(path: str | Path) -> dict[str, Any]:
    """The header of a file ``save`` wrote; ValueError (one line) for another file."""
    where = f"train.compiled_step={path}"
    try:
        with open(_local(path), "rb") as f:
            magic, line = f.readline(), f.readline()
    except OSError as e:
        raise ValueError(f"{where}: cannot read it: {e.strerror or e}") from None
    if magic != MAGIC:
        raise ValueError(f"{where} is not a train step written by `transformer-jax compile "
                         "--save` of this version")
    try:
        return json.loads(line)
    except ValueError:
        raise ValueError(f"{where}: its header is damaged") from None


def _differences(saved: dict[str, Any], here: dict[str, Any], prefix: str) -> list[str]:
    keys = sorted(set(saved) | set(here))
    return [f"{prefix}{k} {saved.get(k, 'absent')!r} there, {here.get(k, 'absent')!r} here"
            for k in keys if saved.get(k) != here.get(k)]


def check_header(path: str | Path, model_config: Any, train_config: Any, mesh: Any,
                 *, skip_model: tuple[str, ...] = ()) -> dict[str, Any]:
    """The header of ``path``, compared with this run: versions, devices, mesh and configs
    (``skip_model``: model keys not settled yet); ValueError names what differs."""
    saved = read_header(path)
    where = f"train.compiled_step={path} was compiled for"
    if train_config.objective != "sft":
        raise ValueError(f"train.compiled_step holds the sft train step; train.objective="
                         f"{train_config.objective} compiles its own")
    here = {**_versions(), **_mesh_fields(mesh)}
    for keys, what in ((("jax", "jaxlib"), "another JAX"),
                       (("platform", "device_kind", "devices"), "other devices"),
                       (("mesh",), "another mesh"), (("device_ids",), "another device order"),
                       (("xla_flags",), "other XLA flags (train --no-fast-math?)")):
        if diffs := _differences({k: saved.get(k) for k in keys}, {k: here[k] for k in keys}, ""):
            hint = ("; set train.mesh to the compile's" if what == "another mesh" else "")
            raise ValueError(f"{where} {what}: {'; '.join(diffs)}{hint}")
    model = {k: v for k, v in dataclasses.asdict(model_config).items() if k not in skip_model}
    diffs = _differences({k: v for k, v in saved["model"].items() if k not in skip_model},
                         json.loads(json.dumps(model)), "model.")
    diffs += _differences(saved["train"], json.loads(json.dumps(_train_keys(train_config))),
                          "train.")
    if diffs:
        hint = (" (a run takes its tokenizer's vocab_size: pass that model.vocab_size to "
                "compile)" if any(d.startswith("model.vocab_size ") for d in diffs) else "")
        raise ValueError(f"{where} another config: {'; '.join(diffs)}{hint}")
    return saved


def load(path: str | Path, model_config: Any, train_config: Any, mesh: Any, state: Any,
         batch: Any) -> Any:
    """The train step of ``path`` (a ``jax.stages.Compiled``) for this run's ``(state, batch)``,
    after checking it was compiled for them; ValueError names what differs."""
    from jax.experimental import serialize_executable

    saved = check_header(path, model_config, train_config, mesh)
    args = ((state, batch), {})
    if diffs := _differences(saved["inputs"], _inputs(args), "input "):
        more = f" (and {len(diffs) - 3} more)" if len(diffs) > 3 else ""
        raise ValueError(f"train.compiled_step={path} was compiled for other inputs: "
                         f"{'; '.join(diffs[:3])}{more}")
    with open(_local(path), "rb") as f:
        f.readline(), f.readline()
        serialized, in_tree, out_tree = pickle.loads(f.read())
    compiled = serialize_executable.deserialize_and_load(serialized, in_tree, out_tree,
                                                         backend=mesh.devices.flat[0].client)
    expected = jax.tree_util.tree_flatten_with_path(compiled.input_shardings)[0]
    for (p, sharding), x in zip(expected, jax.tree.leaves(args), strict=True):
        if not sharding.is_equivalent_to(x.sharding, x.ndim):
            raise ValueError(f"train.compiled_step={path} was compiled for another sharding of "
                             f"input {jax.tree_util.keystr(p)}: {sharding} there, "
                             f"{x.sharding} here")
    logger.info("loaded the compiled train step from %s (compiled for %s, %d x %s)", path,
                saved.get("topology") or "these devices", saved["devices"], saved["device_kind"])
    return compiled


__all__ = ["MAGIC", "RUN_ONLY_KEYS", "check_header", "describe", "load", "read_header", "save"]
