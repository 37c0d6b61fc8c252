"""The optimizer: AdamW with linear warmup then cosine decay, global-norm clipping, and no weight
decay on norms, biases or the token embedding (``decay_mask``: with a large vocabulary most
rows get no gradient in a step, so decay alone would pull rare tokens' vectors to zero)."""

from __future__ import annotations

from typing import Any

import jax
import optax

from transformer_jax.model.layers import EMBEDDING_PARAM, is_vector_param
from transformer_jax.train.config import TrainConfig

Params = dict[str, Any]


def lr_schedule(config: TrainConfig) -> optax.Schedule:
    """Linear warmup to ``lr`` over ``warmup_steps``, then cosine decay to ``min_lr``.

    Update i (0-based) uses ``schedule(i)``: the first has ``lr / warmup_steps`` (not 0), update
    ``decay_steps - 1`` has ``min_lr``; without warmup and with ``min_lr = lr``, a constant.
    """
    if not config.warmup_steps and config.min_lr == config.lr:
        return optax.constant_schedule(config.lr)
    base = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=config.lr, warmup_steps=config.warmup_steps,
        decay_steps=config.total_decay_steps, end_value=config.min_lr)
    return lambda count: base(count + 1)


def decay_mask(params: Params) -> Params:
    """True for the parameters that get weight decay: every matrix except the token embedding
    (by name, so the mask is the same in the unrolled and the scanned layouts)."""
    def decays(path, _) -> bool:
        name = str(getattr(path[-1], "key", path[-1]))
        return not (is_vector_param(name) or name == EMBEDDING_PARAM)

    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW with the warmup-cosine schedule and ``decay_mask``."""
    adamw = optax.adamw(lr_schedule(config), b1=config.b1, b2=config.b2, eps=config.eps,
                        weight_decay=config.weight_decay, mask=decay_mask)
    if config.grad_clip:
        return optax.chain(optax.clip_by_global_norm(config.grad_clip), adamw)
    return adamw
