"""Export a training run (or re-export a HF directory) as a complete HuggingFace checkpoint.

The result holds ``config.json``, the safetensors weights, ``generation_config.json`` and the
tokenizer. A LoRA run's adapters are merged into the base (in float32) and every tensor is cast
to the model's ``param_dtype``. The checkpoint is only read; ``--out`` is checked before any
weight is read (``check_out``).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from transformer_jax import hf, storage
from transformer_jax.checkpoint import loading
from transformer_jax.checkpoint.files import CheckpointError
from transformer_jax.cli.common import PROG, fail
from transformer_jax.model.config import DTYPES

#: The HF ``model_type`` values an export can write.
MODEL_TYPES = tuple(sorted(hf.convert.ARCHITECTURES))

logger = logging.getLogger(__name__)


def check_out(out: Path, overwrite: bool = False) -> None:
    """Refuses an export directory that would replace what is not an earlier export.

    ``out`` may not be a run directory, its checkpoints (or a step) or inside an entry training
    writes there (``loading.RUN_ENTRIES``; ``RUN_DIR/hf`` is fine). Other files than an earlier
    export's are replaced only with ``overwrite``.

    Raises:
      FileExistsError: naming what is there and what to do.
    """
    out = out.expanduser().resolve()
    for directory in (out, *out.parents):
        inside = out.relative_to(directory).parts
        if loading.is_step_dir(directory) or loading.is_checkpoints_dir(directory):
            raise FileExistsError(f"--out {out} is in the checkpoints of a training run "
                                  f"({directory}); export somewhere else")
        if loading.is_run_dir(directory) and (not inside or inside[0] in loading.RUN_ENTRIES):
            what = "is the directory" if not inside else f"is inside {inside[0]} of the directory"
            raise FileExistsError(f"--out {out} {what} of the training run {directory}, whose "
                                  "files an export never replaces; use e.g. --out "
                                  f"{directory / 'hf'}")
    if out.is_file():
        raise FileExistsError(f"--out {out} is a file, not a directory")
    _check_only_an_export(out, overwrite)


def _check_only_an_export(out: Any, overwrite: bool) -> None:
    """Refuses an existing ``out`` (local or remote) that holds other files than an earlier
    export's, unless ``overwrite``."""
    if not out.is_dir() or overwrite:
        return
    others = sorted(p.name for p in out.iterdir() if not hf.is_saved_file(p.name))
    if others:
        shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        raise FileExistsError(f"--out {out} holds files that are not an earlier export "
                              f"({shown}); pass --overwrite to replace it")


def export(checkpoint: str | Path, out: str | Path, *, tokenizer: str | Path | None = None,
           use_tokenizer: bool = True, step: int | None = None, dtype: str | None = None,
           max_shard_bytes: int | None = None, overwrite: bool = False,
           model_type: str | None = None, mxfp4: bool = False, fp8: bool = False) -> Path:
    """Writes a HF checkpoint directory from a run or a HF directory (read-only).

    Args:
      checkpoint: run directory, checkpoints directory, step directory or HF directory.
      out: the HF directory to write (replaced only once complete; see ``check_out``).
      tokenizer: tokenizer directory or file; default: found next to the checkpoint.
      use_tokenizer: False exports the model only.
      step: the run's step to export (default: the newest intact one).
      dtype: cast the weights to this; default: the model's ``param_dtype``.
      max_shard_bytes: split the weights into shards of at most this many bytes.
      overwrite: replace an ``out`` that holds other files than an earlier export's.
      model_type: the HF ``model_type`` to write (e.g. ``"phi3"``); default: the family the
        checkpoint was loaded as, else its architecture's.
      mxfp4: store GPT-OSS's experts in MXFP4, as its published checkpoints do.
      fp8: store the projection weights in FP8 e4m3, a float32 scale per 128 x 128 block.

    Returns:
      The output directory.

    Raises:
      FileNotFoundError: no checkpoint, or no tokenizer while ``use_tokenizer``.
      FileExistsError: an ``out`` that ``check_out`` refuses.
      ValueError: a checkpoint that cannot be exported (the reason named).
      OSError: ``out`` cannot be written (named in one line).
    """
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if model_type is not None and model_type not in MODEL_TYPES:
        raise ValueError(f"model_type must be one of {MODEL_TYPES}, got {model_type!r}")
    if tokenizer is not None and not use_tokenizer:
        raise ValueError(f"--tokenizer {tokenizer} and --no-tokenizer contradict each other: "
                         "give one")
    remote = storage.is_remote(out)
    if remote:  # written locally, then uploaded (HF's files are written whole)
        url = str(out).rstrip("/")
        check_remote_out(url, overwrite)  # before any work: a missing bucket, say
        out = storage.staging_dir(url, "export")
    where = f"--checkpoint {checkpoint}"
    source = loading.locate(checkpoint, where=where)
    out = Path(out).expanduser()
    if not remote:
        check_out(out, overwrite)
    loaded = loading.load(source, step=step, with_tokenizer=False)
    tok = loading.open_tokenizer(source, tokenizer, where=where, missing="pass --tokenizer PATH "
                                 "or --no-tokenizer") if use_tokenizer else None
    config, params = loaded.config, loaded.params
    if dtype is not None and dtype != config.param_dtype:
        params = jax.tree.map(lambda x: jnp.asarray(x, dtype), params)
        config = config.replace(param_dtype=dtype, dtype=dtype)
    if model_type is None and source.hf_model_type is not None:
        model_type = source.hf_model_type
        logger.info("exporting as HF %s, the family %s was loaded as (--model-type sets "
                    "another)", model_type, checkpoint)
    try:
        hf.save(config, params, out, tokenizer=tok, max_shard_bytes=max_shard_bytes,
                model_type=model_type, mxfp4_experts=mxfp4,
                fp8_block=hf.fp8.DEFAULT_BLOCK if fp8 else None)
    except OSError as e:
        raise type(e)(f"could not write the export {out}: {e.strerror or e}") from None
    return _upload_export(out, url) if remote else out


def check_remote_out(url: str, overwrite: bool = False) -> None:
    """``check_out`` for an export into a bucket.

    Raises:
      FileNotFoundError: the bucket does not exist (named).
      FileExistsError: naming what is there and what to do.
    """
    storage.check_writable(url, "--out")
    out = storage.as_path(url)
    if (loading.is_run_dir(out) or loading.is_step_dir(out)
            or out.parent.name == loading.CHECKPOINTS):
        raise FileExistsError(f"--out {url} is a training run's directory or inside its "
                              f"checkpoints; use e.g. --out {url}/hf")
    _check_only_an_export(out, overwrite)


def _upload_export(local: Path, url: str) -> Any:
    """Uploads a finished export and removes what an earlier export left there (e.g. more
    shards); ``config.json`` goes last, so a reader never finds weights without it."""
    storage.push(local, url, exclude=("config.json",))
    storage.push(local, url)
    ours = {p.name for p in local.iterdir()}
    for old in storage.as_path(url).iterdir():
        if old.name not in ours:
            storage.rmtree(old)
    logger.info("exported to %s (staged in %s)", url, local)
    return storage.as_path(url)


def build_parser() -> argparse.ArgumentParser:
    """``transformer-jax export ...``."""
    p = argparse.ArgumentParser(prog=f"{PROG} export", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True,
                   help="run dir, its checkpoints/ dir, one step's dir, or a HF dir")
    p.add_argument("--out", required=True, help="HF directory to write")
    tok = p.add_mutually_exclusive_group()
    tok.add_argument("--tokenizer", help="tokenizer dir or file (default: found with the run)")
    tok.add_argument("--no-tokenizer", action="store_true", help="export the model only")
    p.add_argument("--step", type=int, help="step to export (default: the newest intact)")
    p.add_argument("--dtype", choices=DTYPES, help="cast the weights (default: param_dtype)")
    p.add_argument("--max-shard-bytes", type=int, help="write shards of at most this size")
    p.add_argument("--overwrite", action="store_true", help="replace an --out that holds other "
                   "files than an earlier export (never a training run's own files)")
    p.add_argument("--model-type", choices=MODEL_TYPES, default=None,
                   help="HF model_type to write (default: the family the checkpoint was "
                   "loaded as, a run started from a HF checkpoint records it; else the first "
                   "the architecture matches; phi3 writes Phi-3's fused q/k/v and gate/up)")
    quant = p.add_mutually_exclusive_group()
    quant.add_argument("--mxfp4", action="store_true", help="store GPT-OSS's experts in MXFP4, "
                       "as its published checkpoints (rounds values MXFP4 does not hold; "
                       "default: unquantised, in the weights' dtype)")
    quant.add_argument("--fp8", action="store_true", help="store the layers' projection weights in "
                       "FP8 e4m3 with a float32 scale per 128x128 block, as DeepSeek-V3's "
                       "published checkpoints (rounds to e4m3; not for gpt_oss or llama4)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry; returns the exit status (0, or 1 with the error on stderr)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        out = export(args.checkpoint, args.out, tokenizer=args.tokenizer,
                     use_tokenizer=not args.no_tokenizer, step=args.step, dtype=args.dtype,
                     max_shard_bytes=args.max_shard_bytes, overwrite=args.overwrite,
                     model_type=args.model_type, mxfp4=args.mxfp4, fp8=args.fp8)
    except (OSError, ValueError, CheckpointError) as e:
        return fail(str(e), 1)
    print(f"exported {args.checkpoint} -> {out}")
    return 0


__all__ = ["build_parser", "check_out", "export", "main"]
