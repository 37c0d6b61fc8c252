"""The model of a run started from a checkpoint (``train.init_from``): the checkpoint's
architecture, with only how it runs (``config.Execution``) and a shorter context settable."""

from __future__ import annotations

import logging
from typing import Any

from transformer_jax.checkpoint.loading import Source
from transformer_jax.model.config import Architecture, Execution, ModelConfig, field_names

logger = logging.getLogger(__name__)


def _settable_with_init_from(key: str, value: Any, source: ModelConfig) -> bool:
    """Whether ``model.KEY=value`` keeps the checkpoint's function: every ``Execution`` field,
    a ``max_seq_len`` not above the checkpoint's, and ``mtp_depth`` 0 (its modules dropped)."""
    return (key in field_names(Execution) or key == "max_seq_len" and value <= source.max_seq_len
            or key == "mtp_depth" and value == 0)


def architecture_changes(source: ModelConfig, model: ModelConfig) -> list[str]:
    """``model.KEY=...`` descriptions of what ``model`` changes in the ``source`` architecture."""
    return [f"model.{key}={getattr(model, key)!r} (the checkpoint has {getattr(source, key)!r})"
            for key in field_names(Architecture)
            if getattr(model, key) != getattr(source, key)
            and not _settable_with_init_from(key, getattr(model, key), source)]


def init_model_config(source: Source, values: dict[str, Any],
                      preset_keys: frozenset[str] = frozenset()) -> ModelConfig:
    """The model of a run with ``train.init_from``: the checkpoint's architecture with ``values``
    (``[model]`` and ``model.*``) applied to its ``Execution`` fields and ``max_seq_len``.

    Args:
      source: the checkpoint (``loading.locate``).
      values: model keys set by the config file and the overrides.
      preset_keys: those of ``values`` from the config file (the checkpoint's win; logged).

    Raises:
      ValueError: naming each command-line key whose value would change the architecture.
    """
    yielded = sorted(key for key in preset_keys & values.keys()
                     if not _settable_with_init_from(key, values[key], source.model))
    if yielded:
        logger.info("train.init_from=%s: the model's %s come from the checkpoint, not the "
                    "config file", source.path, ", ".join(yielded))
    kept = {k: v for k, v in values.items() if k not in yielded}
    model = ModelConfig.from_dict({**source.model.to_dict(), **kept})
    if changes := architecture_changes(source.model, model):
        raise ValueError(
            f"train.init_from={source.path}: {'; '.join(changes)} would change the checkpoint's "
            f"architecture; with init_from only {', '.join(field_names(Execution))} and "
            "max_seq_len (not above the checkpoint's) may be set")
    return model
