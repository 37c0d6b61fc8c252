"""Export a training run (or re-export a HF directory) as a complete HuggingFace checkpoint.

    python -m transformer_jax.hf export --checkpoint RUN_DIR --out DIR

``--checkpoint`` is a run directory (its ``checkpoints/``, the newest intact step), a
``checkpoints/`` directory, one step's directory (``RUN_DIR/checkpoints/200``), or a HF
checkpoint directory (re-export). The result holds ``config.json``, the safetensors weights,
``generation_config.json`` and the tokenizer, which ``AutoModelForCausalLM`` /
``AutoTokenizer.from_pretrained``, ``python -m transformer_jax.generate --checkpoint DIR`` and
``hf.load`` read.

Checkpoint format read (what ``training.run`` saves): an orbax train state whose ``params``
entry is the model's param tree (unrolled ``blocks_{i}`` or scanned ``blocks``), with
``meta["model"]`` the ``ModelConfig`` as a dict. A LoRA run stores instead
``params = {"base": model params, "adapters": lora adapters}`` (``transformer_jax.lora``'s
layout, the same block layout as the base) and ``meta["lora"] = {"rank": R, "alpha": A,
"targets": [...]}``; the adapters are merged into the base (``lora.merge``, in float32) and every
tensor is cast to the model's ``param_dtype`` (a frozen base may be stored in bfloat16).

The tokenizer is, in this order: ``--tokenizer`` (a directory or file), ``RUN_DIR/tokenizer/``,
``tokenizer.json`` or ``tokenizer.model`` in the run directory (or next to the checkpoints
directory), then the file recorded in ``meta["tokenizer"]``. Without one the export fails unless
``--no-tokenizer`` is given.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from transformer_jax import hf, lora
from transformer_jax.config import DTYPES, ModelConfig
from transformer_jax.model import Params

logger = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
_TOKENIZER_NAMES = ("tokenizer", "tokenizer.json", "tokenizer.model")


def _is_hf_dir(path: Path) -> bool:
    # A training run's directory holds a config.json too, but no weights.
    return (path / hf.CONFIG_FILE).is_file() and (
        any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").is_file())


def _checkpoints_dir(path: Path) -> tuple[Path, int | None, Path]:
    """(checkpoints directory, step or None, run directory) for a run/checkpoints/step path."""
    if (path / CHECKPOINTS).is_dir():
        return path / CHECKPOINTS, None, path
    if path.name.isdigit() and path.parent.is_dir():
        return path.parent, int(path.name), path.parent.parent
    return path, None, path.parent


def load_run(path: str | Path, step: int | None = None
             ) -> tuple[ModelConfig, Params, dict[str, Any], Path]:
    """Reads a training run's params (LoRA adapters merged) and its config.

    Args:
      path: run directory, its ``checkpoints/`` directory or one step's directory.
      step: which step (default: the one the path names, else the newest intact one).

    Returns:
      ``(config, params, meta, run_dir)``; ``params`` are plain model params of ``config``.

    Raises:
      FileNotFoundError: no such directory or no checkpoint in it.
      ValueError: the checkpoint lacks ``meta["model"]``, or its LoRA entries are inconsistent.
    """
    from transformer_jax.checkpoint import CheckpointManager

    path = Path(path).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    directory, named_step, run_dir = _checkpoints_dir(path)
    params, meta = CheckpointManager(directory, async_save=False).restore_params(
        None, step if step is not None else named_step)
    if not isinstance(meta.get("model"), dict):
        raise ValueError(f"checkpoint in {directory} has no meta['model'] (the ModelConfig); "
                         "was it saved by transformer_jax training?")
    config = ModelConfig.from_dict(meta["model"])
    params = lora.merge_checkpoint_params(params, meta, directory, dtype=config.param_dtype)
    # One dtype for every tensor, the one config.json states (a frozen base may be bfloat16).
    params = jax.tree.map(lambda x: jnp.asarray(x, config.param_dtype), params)
    return config, params, meta, run_dir


def find_tokenizer(run_dir: Path, meta: dict[str, Any] | None = None) -> Path | None:
    """The tokenizer of a run: ``RUN/tokenizer/``, ``RUN/tokenizer.json|.model`` (or one level
    up), else ``meta["tokenizer"]``; None if there is none."""
    for directory in (run_dir, run_dir.parent):
        for name in _TOKENIZER_NAMES:
            candidate = directory / name
            if candidate.exists():
                return candidate
    recorded = (meta or {}).get("tokenizer")
    if isinstance(recorded, str) and recorded and Path(recorded).expanduser().exists():
        return Path(recorded).expanduser()
    return None


def _cast(config: ModelConfig, params: Params, dtype: str | None
          ) -> tuple[ModelConfig, Params]:
    if dtype is None or dtype == config.param_dtype:
        return config, params
    params = jax.tree.map(lambda x: jnp.asarray(x, dtype), params)
    return config.replace(param_dtype=dtype, dtype=dtype), params


def export(checkpoint: str | Path, out: str | Path, *, tokenizer: str | Path | None = None,
           use_tokenizer: bool = True, step: int | None = None, dtype: str | None = None,
           max_shard_bytes: int | None = None) -> Path:
    """Writes a HF checkpoint directory from a run or a HF directory.

    Args:
      checkpoint: run directory, checkpoints directory, step directory or HF directory.
      out: the HF directory to write (replaced only once complete).
      tokenizer: tokenizer directory or file; default: found next to the checkpoint.
      use_tokenizer: False exports the model only.
      step: the run's step to export (default: the newest intact one).
      dtype: cast the weights to this (``float32``, ``bfloat16``, ``float16``); default: the
        model's ``param_dtype``.
      max_shard_bytes: split the weights into shards of at most this many bytes.

    Returns:
      The output directory.

    Raises:
      FileNotFoundError: no checkpoint, or no tokenizer while ``use_tokenizer``.
      ValueError: a checkpoint that cannot be exported (the reason named).
    """
    from transformer_jax.tokenizer import load_tokenizer

    checkpoint = Path(checkpoint).expanduser()
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if _is_hf_dir(checkpoint):
        config, params = hf.load(checkpoint)
        meta: dict[str, Any] = {}
        found = checkpoint if any((checkpoint / n).is_file() for n in _TOKENIZER_NAMES[1:]) \
            else None
    else:
        config, params, meta, run_dir = load_run(checkpoint, step)
        found = find_tokenizer(run_dir, meta)
    tok = None
    if use_tokenizer:
        source = Path(tokenizer).expanduser() if tokenizer is not None else found
        if source is None:
            raise FileNotFoundError(f"no tokenizer found for {checkpoint} (looked for "
                                    f"{', '.join(_TOKENIZER_NAMES)} and meta['tokenizer']); "
                                    "pass --tokenizer PATH or --no-tokenizer")
        tok = load_tokenizer(source)
        if tok.vocab_size > config.vocab_size:
            raise ValueError(f"tokenizer {source} has {tok.vocab_size} tokens, more than the "
                             f"model's vocab_size {config.vocab_size}")
    config, params = _cast(config, params, dtype)
    hf.save(config, params, out, tokenizer=tok, max_shard_bytes=max_shard_bytes)
    return Path(out)


def build_parser() -> argparse.ArgumentParser:
    """``python -m transformer_jax.hf export ...``."""
    parser = argparse.ArgumentParser(prog="python -m transformer_jax.hf",
                                     description="HuggingFace checkpoint tools.")
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("export", help="write a run's checkpoint as a HF model directory",
                            description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True,
                   help="run dir, its checkpoints/ dir, one step's dir, or a HF dir")
    p.add_argument("--out", required=True, help="HF directory to write")
    p.add_argument("--tokenizer", help="tokenizer dir or file (default: found with the run)")
    p.add_argument("--no-tokenizer", action="store_true", help="export the model only")
    p.add_argument("--step", type=int, help="step to export (default: the newest intact)")
    p.add_argument("--dtype", choices=DTYPES, help="cast the weights (default: param_dtype)")
    p.add_argument("--max-shard-bytes", type=int, help="write shards of at most this size")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry; returns the exit status (0, or 1 with the error on stderr)."""
    from transformer_jax.checkpoint import CheckpointError

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        out = export(args.checkpoint, args.out, tokenizer=args.tokenizer,
                     use_tokenizer=not args.no_tokenizer, step=args.step, dtype=args.dtype,
                     max_shard_bytes=args.max_shard_bytes)
    except (FileNotFoundError, ValueError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"exported {args.checkpoint} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["build_parser", "export", "find_tokenizer", "load_run", "main"]
