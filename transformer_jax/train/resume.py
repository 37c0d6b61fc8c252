"""Resume checks: a run continues only with the model, optimizer structure, tokenizer and data
it was started with; the saved configs are compared before any array is read, and the
differences named in one line."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from transformer_jax.model.config import ModelConfig, resumable_keys

logger = logging.getLogger(__name__)


def data_fingerprint(*token_arrays: np.ndarray) -> str:
    """SHA-256 of the token ids of a run's corpus (train then validation split)."""
    digest = hashlib.sha256()
    for tokens in token_arrays:
        array = np.ascontiguousarray(tokens)
        digest.update(array.dtype.str.encode())
        digest.update(memoryview(array).cast("B"))
    return digest.hexdigest()


# Train keys that alter the optimizer state's structure (clipping adds an optax stage), compared
# as the structure they give (from the value and the train table): no restore across them.
_STATE_TRAIN_KEYS: dict[str, Callable[[Any, dict[str, Any]], Any]] = {
    "grad_clip": lambda v, train: bool(v), "lora_rank": lambda v, train: v,
    "lora_targets": lambda v, train: tuple(t.strip() for t in str(v).split(",") if t.strip())
    if train.get("lora_rank") else None,
    "lora_base_quant": lambda v, train: v if train.get("lora_rank") else None}
# Data keys that change the token ids a run sees (named when the data fingerprint differs).
_DATA_KEYS = {"path": "", "val_fraction": "another train/validation split",
              "max_bytes": "another cap on the default corpus",
              "packing": "other rows of the shards", "mixture": "other sources or weights"}
# Train keys that change the computation: a resume with other values continues, but is not the
# run an uninterrupted one would have been.
_TRAJECTORY_TRAIN_KEYS = ("batch_size", "seq_len", "lr", "min_lr", "warmup_steps",
                          "decay_steps", "weight_decay", "b1", "b2", "eps", "grad_clip",
                          "z_loss", "seed", "lora_alpha", "lora_base_dtype", "init_from",
                          "quant", "moe_balance_loss", "moe_z_loss", "pairs_per_step")


def check_resume(saved: dict[str, Any], current: dict[str, Any], where: Path) -> None:
    """Compares a checkpoint's saved configs with a run's before restoring it.

    Args:
      saved: the checkpoint's meta (``CheckpointManager.read_meta``).
      current: the run's configs (as saved with its checkpoints).
      where: the checkpoint directory, for the messages.

    Raises:
      ValueError: one line naming what differs: the tokenizer, model keys, a train key of the
        optimizer state's structure, or the corpus (unless ``train.allow_new_data``).
    """
    use = "; use another train.run_dir"
    saved_tok, tok = saved.get("tokenizer_fingerprint"), current["tokenizer_fingerprint"]
    if saved_tok and saved_tok != tok:
        raise ValueError(
            f"the checkpoints in {where} were trained with another tokenizer "
            f"({saved.get('tokenizer')}, fingerprint {saved_tok[:12]}) than this run's "
            f"({current['tokenizer']}, fingerprint {tok[:12]}); a run continues only with its "
            f"own tokenizer{use}")
    diffs = []
    if "model" in saved:
        try:  # the saved model config as this version writes it (as saved if unparsable)
            saved_model = ModelConfig.from_dict(saved["model"]).to_dict()
        except (TypeError, ValueError):
            saved_model = saved["model"]
        diffs = [f"model.{k}: {saved_model.get(k)!r} in the checkpoint, {v!r} now"
                 for k, v in current["model"].items()
                 if k not in resumable_keys() and saved_model.get(k) != v]
    saved_train = saved.get("train") or {}
    diffs += [f"train.{k}: {saved_train[k]!r} in the checkpoint, {current['train'][k]!r} now "
              "(changes the optimizer state)"
              for k, structure in _STATE_TRAIN_KEYS.items()
              if k in saved_train and structure(saved_train[k], saved_train)
              != structure(current["train"][k], current["train"])]
    if diffs:
        raise ValueError(f"the checkpoints in {where} were written for another run: "
                         + "; ".join(diffs) + use)
    saved_data, data = saved.get("data_fingerprint"), current["data_fingerprint"]
    if saved_data and saved_data != data:
        if not current["train"].get("allow_new_data"):
            saved_dc, dc = saved.get("data") or {}, current.get("data") or {}
            changed_data = [f"data.{k}: {saved_dc[k]!r} in the checkpoint, {dc.get(k)!r} now"
                            + (f" ({why})" if why else "")
                            for k, why in _DATA_KEYS.items()
                            if k in saved_dc and saved_dc[k] != dc.get(k)]
            what = ("other data (" + "; ".join(changed_data) + ", data fingerprint"
                    if changed_data else "another corpus (data fingerprint")
            raise ValueError(
                f"the checkpoints in {where} were trained on {what} "
                f"{saved_data[:12]}, now {data[:12]}); pass train.allow_new_data=true to continue "
                f"on this data with the same tokenizer{use.replace('; use', ', or')}")
        logger.warning("continuing the run of %s on a new corpus (train.allow_new_data)", where)
    changed = [f"{k} {saved_train[k]!r} -> {current['train'][k]!r}"
               for k in _TRAJECTORY_TRAIN_KEYS
               if k in saved_train and saved_train[k] != current["train"][k]]
    if changed:
        logger.warning("resuming with other train settings than the checkpoint's (%s): the "
                       "result is not that of an uninterrupted run", ", ".join(changed))
