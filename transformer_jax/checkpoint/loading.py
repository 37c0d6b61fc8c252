"""Opening checkpoints: what a path is (``locate``), then its model, weights and tokenizer
(``load``), for ``generate``, ``hf export`` and ``train.init_from``.

A path is a HF directory (``config.json`` + safetensors), a run's directory or ``checkpoints/``
(the newest intact step), or one step's directory. ``locate`` reads files only (no JAX device,
so it may run before ``jax.distributed.initialize``); reading never writes, so a read-only mount
or a run still training loads.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax import storage
from transformer_jax.checkpoint.files import META_ITEM, STATE_ITEM, CheckpointError, read_meta
from transformer_jax.checkpoint.read import check_finite
from transformer_jax.decode.weights import (
    check_tensor_parallel,
    decode_rules,
    expert_shards,
    tensor_shards,
)
from transformer_jax.model import lora
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.transformer import Params
from transformer_jax.parallel import sharding as sharding_lib
from transformer_jax.storage.files import read_json

logger = logging.getLogger(__name__)

#: The kinds of ``Source``: a HF directory or a training run's orbax checkpoints.
HF, RUN = "hf", "run"
CHECKPOINTS = "checkpoints"
HF_CONFIG = "config.json"
HF_INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
#: Where a run keeps its copy of the tokenizer, relative to its directory (training writes it).
RUN_TOKENIZER_DIR = "tokenizer"
#: What training writes in a run directory; nothing else (an export) may write over them.
RUN_ENTRIES = frozenset({CHECKPOINTS, RUN_TOKENIZER_DIR, "tb", "profile", "config.json",
                         "metrics.jsonl", "summary.json", "loss.png"})


@dataclasses.dataclass(frozen=True)
class Source:
    """A checkpoint as found on disk, before any weight is read.

    Attributes:
      path: the directory given (an ``epath.Path`` for a URL; a remote HF one's local copy).
      kind: ``HF`` or ``RUN``.
      model: its model config (a HF ``config.json``, float32; a run's ``meta["model"]``).
      run_dir: the run directory (kind ``RUN``; a local copy for a run on object storage).
      checkpoints: the run's checkpoints directory (kind ``RUN``; remote ones read in place).
      step: the step the path names; None for the newest intact one.
      meta: the meta of that step, or of the newest readable one (kind ``RUN``).
      tokenizer: the tokenizer found with the checkpoint (a directory or file), or None.
      hf_model_type: the HF ``model_type`` the weights came from, else None (export's default).
    """

    path: Path
    kind: str
    model: ModelConfig
    run_dir: Path | None = None
    checkpoints: Path | None = None
    step: int | None = None
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    tokenizer: Path | None = None
    hf_model_type: str | None = None


@dataclasses.dataclass(frozen=True)
class Loaded:
    """A loaded checkpoint.

    Attributes:
      source: where it came from.
      config: the model of ``params`` (the layout and dtype asked for).
      params: the param tree (``blocks`` [L, ...] if scanned; ``{"base", "adapters"}`` with
        ``merge_lora=False``).
      step: the step read (kind ``RUN``), else None.
      meta: that step's meta (kind ``RUN``), else empty.
      tokenizer: the ``TextTokenizer``, or None (none found, or not asked for).
      tokenizer_path: where it was found, or None.
    """

    source: Source
    config: ModelConfig
    params: Params
    step: int | None = None
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    tokenizer: Any = None
    tokenizer_path: Path | None = None


def is_hf_dir(path: Path) -> bool:
    """A HF checkpoint: ``config.json`` and weights (a run directory has a config.json too)."""
    return (path / HF_CONFIG).is_file() and (
        any(path.glob("*.safetensors")) or (path / HF_INDEX).is_file())


def is_step_dir(path: Path) -> bool:
    """One step's directory of a run's checkpoints (``<step>/state``, ``<step>/meta``)."""
    return path.name.isdigit() and ((path / STATE_ITEM).is_dir() or (path / META_ITEM).is_dir())


def is_checkpoints_dir(path: Path) -> bool:
    """A directory of step directories (a run's ``checkpoints/``, whatever its name)."""
    try:
        return any(is_step_dir(p) for p in path.iterdir())
    except OSError:
        return False


def is_run_dir(path: Path) -> bool:
    """A training run's directory: it holds ``checkpoints/`` or training's ``config.json``."""
    if (path / CHECKPOINTS).is_dir():
        return True
    try:
        configs = read_json(path / HF_CONFIG)
    except (OSError, ValueError):
        return False
    return isinstance(configs, dict) and {"model", "train", "data"} <= configs.keys()


def locate(path: str | Path, *, where: str | None = None) -> Source:
    """Says what a checkpoint path is, reading files only (no weights, no JAX devices).

    Args:
      path: a HF directory, a run directory, its ``checkpoints/`` or one step's directory.
      where: how the errors name the path (e.g. ``"train.init_from=DIR"``); default the path.

    Returns:
      The ``Source``.

    Raises:
      FileNotFoundError: no such directory, a file, or nothing loadable in it.
      ValueError: a HF config this library cannot represent exactly, or a run without its model.
      CheckpointError: no checkpoint of the run has a readable meta.
    """
    if storage.is_remote(path):
        return _locate_remote(str(path).rstrip("/"), where or str(path))
    root = Path(path).expanduser()
    where = where or str(root)
    if root.is_file():
        raise FileNotFoundError(f"{where} is a file; give a directory: a HF checkpoint "
                                "(config.json + *.safetensors) or a training run (its run "
                                "directory, checkpoints/ or one step's directory)")
    if not root.is_dir():
        raise FileNotFoundError(f"{where}: {root} does not exist")
    step = None
    if (root / CHECKPOINTS).is_dir():
        checkpoints, run_dir = root / CHECKPOINTS, root
    elif is_hf_dir(root):
        model, model_type = _hf_model(root, where)
        return Source(root, HF, model, tokenizer=_tokenizer_dir(root), hf_model_type=model_type)
    elif is_step_dir(root):
        checkpoints, step, run_dir = root.parent, int(root.name), root.parent.parent
    elif (root / HF_CONFIG).is_file() and not is_run_dir(root):
        raise FileNotFoundError(f"{where}: {root} has a config.json but no weights "
                                "(model.safetensors or model-*.safetensors)")
    elif is_checkpoints_dir(root):
        checkpoints, run_dir = root, root.parent
    else:
        raise FileNotFoundError(f"{where}: {root} holds neither a HF checkpoint (config.json + "
                                "safetensors) nor a training run's checkpoints")
    return _run_source(root, checkpoints, step, run_dir, where)


def _run_source(root: Any, checkpoints: Any, step: int | None, run_dir: Path, where: str
                ) -> Source:
    """The ``Source`` of a run's checkpoints (``run_dir`` holds its other files)."""
    try:
        meta = read_meta(checkpoints, step)
    except FileNotFoundError:
        raise FileNotFoundError(f"{where}: no checkpoint (weights) in {checkpoints}") from None
    except CheckpointError as e:
        raise CheckpointError(f"{where}: {e}") from None
    if not isinstance(meta.get("model"), dict):
        raise ValueError(f"{where}: the checkpoint in {checkpoints} has no meta['model']; was "
                         "it saved by transformer_jax training?")
    model_type = meta.get("hf_model_type")
    return Source(root, RUN, ModelConfig.from_dict(meta["model"]), run_dir, checkpoints, step, meta,
                  _run_tokenizer(run_dir, meta),
                  model_type if isinstance(model_type, str) else None)


def _locate_remote(url: str, where: str) -> Source:
    """``locate`` for a URL: checkpoints read in place, other files from a local copy."""
    root = storage.as_path(url)
    if not root.is_dir():
        raise FileNotFoundError(f"{where}: {url} does not exist")
    if (root / CHECKPOINTS).is_dir():
        checkpoints, step, run = root / CHECKPOINTS, None, url
    elif root.name.isdigit() and is_step_dir(root):
        checkpoints, step, run = root.parent, int(root.name), str(root.parent.parent)
    elif is_checkpoints_dir(root):
        checkpoints, step, run = root, None, str(root.parent)
    else:  # a HF checkpoint (or nothing loadable, which locate names)
        return locate(storage.local_copy(url), where=where)
    run_dir = storage.local_copy(run, exclude=(CHECKPOINTS,))
    return _run_source(root, checkpoints, step, run_dir, where)


def _hf_model(root: Path, where: str) -> tuple[ModelConfig, str]:
    """A HF checkpoint's model config and its ``model_type``."""
    from transformer_jax.hf.convert import config_from_hf
    from transformer_jax.hf.llama4 import text_model

    hf_config = read_json(root / HF_CONFIG, "config")
    if not isinstance(hf_config, dict):
        raise ValueError(f"{where}: {root / HF_CONFIG} is not a JSON object")
    try:
        hf_config = text_model(hf_config)  # a Llama 4 with vision: its text model
        model = config_from_hf(hf_config)
        if model.mtp_depth:  # as ``hf.load`` reads it: none where the weights hold none
            from transformer_jax.hf import stored_mtp_modules

            model = stored_mtp_modules(root, model)
        return model, hf_config["model_type"]
    except ValueError as e:
        raise ValueError(f"{where}: the checkpoint cannot be represented exactly: {e}") from None


def _tokenizer_dir(directory: Path) -> Path | None:
    """``directory`` if it holds a tokenizer file, else None."""
    return directory if any((directory / n).is_file() for n in TOKENIZER_FILES) else None


def _run_tokenizer(run_dir: Path, meta: dict[str, Any]) -> Path | None:
    """A run's tokenizer: its copy in the run directory (relative, so a copied run keeps it),
    one in the run directory itself, else the file it recorded if that still exists."""
    copy = meta.get("tokenizer_dir") or RUN_TOKENIZER_DIR
    for directory in (run_dir / str(copy), run_dir):
        if _tokenizer_dir(directory) is not None:
            return directory
    recorded = meta.get("tokenizer")
    if isinstance(recorded, str) and recorded:
        file = Path(recorded).expanduser()
        if file.is_file() or (file.is_dir() and _tokenizer_dir(file) is not None):
            return file
    return None


def open_tokenizer(source: Source, path: str | Path | None = None, *, where: str | None = None,
                   missing: str | None = None) -> Any:
    """Loads the tokenizer of a checkpoint, checked against the model's vocabulary.

    Args:
      source: the checkpoint.
      path: a tokenizer file or directory to use instead of the one found with it.
      where: how the errors name the checkpoint; default its path.
      missing: the hint of the error raised when there is none; None returns None instead.

    Returns:
      The ``TextTokenizer``, or None.

    Raises:
      FileNotFoundError: no tokenizer while ``missing`` is given, or a missing file.
      ValueError: the tokenizer has more tokens than the model's vocabulary.
    """
    from transformer_jax.tokenizer import load_tokenizer

    where = where or str(source.path)
    location = Path(path).expanduser() if path is not None else source.tokenizer
    if location is None:
        if missing is None:
            return None
        raise FileNotFoundError(f"{where}: no tokenizer found (looked for {RUN_TOKENIZER_DIR}/, "
                                f"{', '.join(TOKENIZER_FILES)} and the file a run recorded); "
                                f"{missing}")
    tokenizer = load_tokenizer(location)
    if tokenizer.vocab_size > source.model.vocab_size:
        raise ValueError(f"the tokenizer {location} has {tokenizer.vocab_size} tokens, more than "
                         f"the vocab_size={source.model.vocab_size} of {where}: its ids would "
                         "index past the embedding; use the checkpoint's own tokenizer")
    return tokenizer


def load(source: Source | str | Path, mesh: Any = None, *, merge_lora: bool = True,
         step: int | None = None, scan_layers: bool | None = None, dtype: str | None = None,
         rules: Sequence[tuple[str, Any]] | None = None, tokenizer: str | Path | None = None,
         with_tokenizer: bool = True, mtp_depth: int | None = None) -> Loaded:
    """Reads a checkpoint's weights (read-only) and its tokenizer.

    Args:
      source: a ``Source`` from ``locate``, or a path for it.
      mesh: if given, every param is created sharded over it by
        ``sharding.param_shardings(config, mesh, rules)``; None: on the first device.
      merge_lora: fold a LoRA run's adapters into its base; False returns its
        ``{"base", "adapters"}`` tree as saved (not with a mesh).
      step: a run's step to read (default: the one the path names, else the newest intact).
      scan_layers: the layer layout of the result (True: ``blocks`` [L, ...]); None keeps the
        checkpoint's (a HF checkpoint's is unrolled).
      dtype: the result's ``param_dtype`` and compute ``dtype``; None keeps a run's
        ``param_dtype`` (every tensor cast to it) and a HF checkpoint's stored dtype.
      rules: the logical -> mesh axis rules of the placement; default the training's.
      tokenizer: a tokenizer file or directory to use instead of the one found.
      with_tokenizer: load the tokenizer (``Loaded.tokenizer``; None if there is none).
      mtp_depth: 0 drops the multi-token prediction modules; None keeps them.

    Returns:
      The ``Loaded`` checkpoint.

    Raises:
      FileNotFoundError: no checkpoint of that step (and the errors of ``locate``).
      CheckpointError: no intact checkpoint.
      ValueError: inconsistent LoRA entries, weights holding NaN or inf, a tokenizer larger
        than the vocabulary, a mesh that cannot split a param evenly.
    """
    if not isinstance(source, Source):
        source = locate(source)
    if mesh is not None and not merge_lora:
        raise ValueError("load(merge_lora=False) returns a LoRA run's tree as saved; it cannot "
                         "be placed on a mesh")
    if rules is None:
        rules = sharding_lib.LOGICAL_RULES if mesh is None else sharding_lib.rules_for(mesh)
    if source.kind == HF:
        from transformer_jax import hf

        config, params = hf.load(source.path, mesh=mesh, scan_layers=scan_layers, dtype=dtype,
                                 rules=rules, mtp_depth=mtp_depth)
        loaded = Loaded(source, config, params)
    else:
        loaded = _load_run(source, mesh, merge_lora=merge_lora, step=step,
                           scan_layers=scan_layers, dtype=dtype, rules=rules)
        if mtp_depth == 0 and loaded.config.mtp_depth:
            loaded = dataclasses.replace(
                loaded, config=loaded.config.replace(mtp_depth=0),
                params={k: v for k, v in loaded.params.items() if not k.startswith("mtp_")})
    # Every leaf placed before the one program that spans the mesh runs (see _all_finite).
    jax.block_until_ready(loaded.params)
    check_finite(loaded.params, source.path)
    if with_tokenizer:
        found = open_tokenizer(source, tokenizer)
        location = Path(tokenizer).expanduser() if tokenizer is not None else source.tokenizer
        loaded = dataclasses.replace(loaded, tokenizer=found,
                                     tokenizer_path=location if found is not None else None)
    return loaded


def _load_run(source: Source, mesh: Any, *, merge_lora: bool, step: int | None,
              scan_layers: bool | None, dtype: str | None, rules: Sequence[tuple[str, Any]]
              ) -> Loaded:
    """A run step's params: restored sharded when only a cast changes, else read whole on
    each host, merged / re-laid out and then placed."""
    from transformer_jax.checkpoint.manager import CheckpointManager
    from transformer_jax.model.transformer import abstract_params, stack_blocks, unstack_blocks

    step = source.step if step is None else step
    saved = source.model
    config = saved if scan_layers is None else saved.replace(scan_layers=scan_layers)
    if dtype is not None:
        config = config.replace(param_dtype=dtype, dtype=dtype)
    shardings = None if mesh is None else sharding_lib.param_shardings(config, mesh, rules)
    direct = (shardings is not None and not source.meta.get("lora")
              and saved.scan_layers == config.scan_layers)
    with CheckpointManager(source.checkpoints, read_only=True) as reader:
        if direct:
            abstract = sharding_lib.with_shardings(
                abstract_params(saved), sharding_lib.param_shardings(saved, mesh, rules))
            params, meta = reader.restore_params(abstract, step)
        else:  # as saved (nested dicts, this process's first device)
            params, meta = reader.restore_params(None, step)
    read_step = meta.get("step", step)
    logger.info("loaded step %s of %s", read_step, source.checkpoints)
    if not merge_lora:  # as training held it (a QLoRA base's weights rebuilt from dicts)
        params = lora.checkpoint_tree(params, meta, source.checkpoints)
        return Loaded(source, saved, params, read_step, meta)
    # A LoRA run merged (a QLoRA base dequantised first) into float weights.
    params = lora.merge_checkpoint_params(params, meta, source.checkpoints,
                                          dtype=config.param_dtype)
    if saved.scan_layers and not config.scan_layers:
        params = unstack_blocks(params)
    elif config.scan_layers and not saved.scan_layers:
        params = stack_blocks(params, saved)
    if shardings is not None and not direct:
        # Every process holds the whole merged tree; each places the shards of its devices.
        host = jax.tree.map(np.asarray, params)
        params = jax.tree.map(
            lambda x, s: jax.make_array_from_callback(x.shape, s, lambda i, x=x: x[i]),
            host, shardings)
    # One dtype for every tensor, the config's (a frozen LoRA base may be stored in bfloat16).
    want = jnp.dtype(config.param_dtype)
    params = jax.tree.map(lambda x: x if x.dtype == want else x.astype(want), params)
    return Loaded(source, config, params, read_step, meta)


def _tensor_mesh(tensor: int, expert: int = 1) -> Any:
    """The mesh for ``--tensor T --expert X`` (None for one device; T = 0: all devices left)."""
    devices = jax.devices()
    if expert < 1:
        raise ValueError(f"--expert must be >= 1, got {expert}")
    tensor = tensor or max(1, len(devices) // expert)
    if tensor * expert > len(devices):
        raise ValueError(f"--tensor {tensor} --expert {expert} needs {tensor * expert} devices, "
                         f"{len(devices)} are available (XLA_FLAGS may fix the CPU device count)")
    if tensor * expert == 1:
        return None
    return sharding_lib.make_mesh(
        sharding_lib.MeshConfig(data=1, fsdp=1, tensor=tensor, expert=expert),
        devices[:tensor * expert])


def load_for_decode(checkpoint: str, tensor: int, tokenizer: str | None = None,
                    expert: int = 1) -> tuple[Loaded, Any]:
    """Opens ``--checkpoint`` for decoding over ``--tensor T --expert X`` devices: the
    ``Loaded`` checkpoint, placed as the decode splits it, and the mesh (None for one device).
    Raises ValueError (a mesh the model cannot be split over), OSError, CheckpointError."""
    mesh = _tensor_mesh(tensor, expert)
    source = locate(checkpoint, where=f"--checkpoint {checkpoint!r}")
    rules = None
    if mesh is not None:  # before any weight is read
        check_tensor_parallel(source.model, tensor_shards(mesh), expert_shards(mesh))
        # By the decode's rules, so ``decode.prepare`` finds the weights where it wants them.
        rules = decode_rules(source.model, mesh)
    return load(source, mesh, rules=rules, tokenizer=tokenizer), mesh


def load_draft(path: str) -> Any:
    """The ``DraftModel`` of speculative decoding from a checkpoint ``load`` opens: its config,
    prepared weights on one device and tokenizer path (compared with the target's)."""
    from transformer_jax.decode.speculative_loop import DraftModel
    from transformer_jax.decode.weights import prepare

    loaded = load(path)
    tok = None if loaded.tokenizer_path is None else str(loaded.tokenizer_path)
    return DraftModel(loaded.config, prepare(loaded.config, loaded.params), tok)


__all__ = ["HF", "RUN", "RUN_ENTRIES", "Loaded", "Source", "check_finite", "is_checkpoints_dir",
           "is_hf_dir", "is_run_dir", "is_step_dir", "load", "load_draft", "load_for_decode",
           "locate", "open_tokenizer"]
