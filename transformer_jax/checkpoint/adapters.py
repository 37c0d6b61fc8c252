"""A LoRA run's adapters, read to be served beside others over the base they were trained on
(checked: the same architecture, and the served weights up to a frozen base's storage).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import numpy as np

from transformer_jax.checkpoint.loading import RUN, load, locate
from transformer_jax.model import lora
from transformer_jax.model.config import Architecture, ModelConfig, field_names
from transformer_jax.model.ops.quantized import is_quantized
from transformer_jax.model.transformer import Params, unstack_blocks

logger = logging.getLogger(__name__)

#: The largest ``||base - served|| / ||served||`` of an adapter's base counted as the served
#: one: a bfloat16 copy differs by about 2**-9, an int4/nf4 one by < 0.15, another model by 1.4.
BASE_TOLERANCE = {"float": 0.02, "quantized": 0.3}


@dataclasses.dataclass(frozen=True)
class LoadedAdapter:
    """A run's adapters: the tree (``model.lora``'s layout), their ``LoraConfig``, the step
    read and the largest relative difference of its base from the served weights."""

    adapters: Params
    lora_config: lora.LoraConfig
    step: int | None
    base_difference: float


def _leaves(tree: Any) -> dict[str, Any]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {"/".join(str(getattr(k, "key", k)) for k in path): x for path, x in flat}


def base_difference(base: Params, served: Params) -> tuple[float, str]:
    """The largest relative difference ``||base - served|| / ||served||`` over the weights of
    two param trees of one architecture (either layer layout), and the weight it is at.

    Raises:
      ValueError: trees with different weights or shapes (naming the first).
    """
    mine, theirs = _leaves(unstack_blocks(base)), _leaves(unstack_blocks(served))
    if mine.keys() != theirs.keys():
        extra = sorted(set(mine) ^ set(theirs))[:3]
        raise ValueError(f"the adapter's base has other weights than the served model: {extra}")
    worst, where = 0.0, ""
    for key, y in theirs.items():
        x = mine[key]
        if tuple(x.shape) != tuple(y.shape):
            raise ValueError(f"the adapter's base has {key} of shape {tuple(x.shape)}, the "
                             f"served model {tuple(y.shape)}")
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        diff = float(np.linalg.norm(x - y) / max(float(np.linalg.norm(y)), 1e-12))
        if diff > worst:
            worst, where = diff, key
    return worst, where


def load_adapter(path: str, config: ModelConfig, served: Params, *, name: str) -> LoadedAdapter:
    """Reads the adapters of LoRA run ``path`` for serving over ``served``.

    Args:
      path: a LoRA training run (its directory, ``checkpoints/`` or one step's directory).
      config: the served model's config.
      served: the served weights as loaded (before ``decode.prepare``), either layout.
      name: the adapter's name, for errors (``--lora NAME=PATH``).

    Returns:
      The ``LoadedAdapter``.

    Raises:
      ValueError: not a LoRA run, another architecture, or another base (naming what differs).
      FileNotFoundError, CheckpointError: as ``loading.locate`` / ``load``.
    """
    where = f"--lora {name}={path}"
    source = locate(path, where=where)
    if source.kind != RUN:
        raise ValueError(f"{where}: a LoRA adapter is a training run with train.lora_rank > 0; "
                         f"{path} is a {source.kind} checkpoint")
    loaded = load(source, merge_lora=False, with_tokenizer=False)
    meta = loaded.meta
    if not meta.get("lora"):
        raise ValueError(f"{where}: the run has no LoRA adapters (it trained every weight, "
                         "train.lora_rank=0); serve it as --checkpoint instead")
    changes = [f"{key}={getattr(loaded.config, key)!r} (served: {getattr(config, key)!r})"
               for key in field_names(Architecture) if key != "max_seq_len"
               and getattr(loaded.config, key) != getattr(config, key)]
    if changes:
        raise ValueError(f"{where}: the adapter's model is another architecture: "
                         f"{', '.join(changes[:4])}")
    lora_config = lora.LoraConfig.from_dict(meta["lora"])
    tree = lora.checkpoint_tree(loaded.params, meta, source.checkpoints)
    base = tree[lora.BASE]
    quantized = any(is_quantized(x) for x in jax.tree.leaves(base, is_leaf=is_quantized))
    if quantized:
        from transformer_jax.model.quant import dequantize_params

        base = jax.jit(dequantize_params)(base)
    diff, at = base_difference(base, served)
    limit = BASE_TOLERANCE["quantized" if quantized else "float"]
    if diff > limit:
        raise ValueError(f"{where}: the adapter was trained on another base: its {at} differs "
                         f"from the served model's by {diff:.3g} (relative; at most {limit} "
                         f"for a {'quantised' if quantized else 'float'} base)")
    logger.info("adapter %s: rank %d, alpha %g, targets %s, step %s; its base within %.2g of "
                "the served weights", name, lora_config.rank, lora_config.alpha,
                ",".join(lora_config.targets), loaded.step, diff)
    return LoadedAdapter(tree[lora.ADAPTERS], lora_config, loaded.step, diff)


__all__ = ["BASE_TOLERANCE", "LoadedAdapter", "base_difference", "load_adapter"]
