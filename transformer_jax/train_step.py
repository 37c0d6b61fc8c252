"""``TrainState`` and the pure step functions: ``init(key) -> state``, ``train_step(state,
batch) -> (state, metrics)`` (gradient accumulation over micro-batches with ``lax.scan``) and
``eval_step(params, batch) -> sums``, each to be jitted once with the caller's shardings.

Parameters (and so Adam's moments) stay float32; ``ModelConfig.dtype="bfloat16"`` only changes
the compute."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

from transformer_jax.config import ModelConfig
from transformer_jax.loss import cross_entropy_sums
from transformer_jax.model import Transformer
from transformer_jax.ops.lm_loss import lm_head_cross_entropy_sums
from transformer_jax.optim import lr_schedule, make_optimizer
from transformer_jax.train_config import TrainConfig

logger = logging.getLogger(__name__)

Params = dict[str, Any]
Batch = dict[str, jax.Array]
Metrics = dict[str, jax.Array]


@flax.struct.dataclass
class TrainState:
    """Everything needed to continue training exactly.

    Attributes:
      step: int32 scalar, number of updates applied so far (also the data position).
      params: the model's parameters (float32 master weights).
      opt_state: the optimizer's state.
      rng: [2] uint32 raw key data (kept raw so checkpoints need no typed-key support); the
        step's key is ``fold_in(rng, step)``.
    """

    step: jax.Array
    params: Params
    opt_state: optax.OptState
    rng: jax.Array


def make_init_fn(model_config: ModelConfig, train_config: TrainConfig
                 ) -> Callable[[jax.Array], TrainState]:
    """A pure ``init(key) -> TrainState``; jit it (with ``out_shardings`` to shard)."""
    model = Transformer(model_config)
    tx = make_optimizer(train_config)

    def init(key: jax.Array) -> TrainState:
        param_key, rng_key = jax.random.split(key)
        dummy = jnp.zeros((1, min(8, model_config.max_seq_len)), jnp.int32)
        params = flax.core.meta.unbox(model.init(param_key, dummy)["params"])
        return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                          opt_state=tx.init(params), rng=jax.random.key_data(rng_key))

    return init


def make_train_step(model_config: ModelConfig, train_config: TrainConfig
                    ) -> Callable[[TrainState, Batch], tuple[TrainState, Metrics]]:
    """The pure ``train_step(state, batch) -> (state, metrics)``; jit it once.

    The batch is ``{"inputs": [B, T] int, "targets": [B, T] int}`` and optionally ``"mask"``
    [B, T] (loss weights), and for packed sequences ``"segment_ids"`` and ``"positions"``
    [B, T] (see ``make_loss_fn``). With ``grad_accum = A`` the B rows are split into A
    micro-batches (micro-batch a takes rows a, a + A, ..., so a batch sharded over rows stays
    sharded) whose summed gradients are divided by the total number of target tokens: exactly
    one batch's gradient.

    Metrics (float32 scalars): ``loss`` (mean cross-entropy), ``z_loss``, ``grad_norm`` (before
    clipping), ``lr`` (of this update) and ``tokens`` (target tokens counted).
    """
    tx = make_optimizer(train_config)
    schedule = lr_schedule(train_config)
    accum = train_config.grad_accum
    grad_fn = jax.grad(make_loss_fn(model_config, train_config), has_aux=True)

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        if accum == 1:
            grads, (ce, z, count) = grad_fn(state.params, batch, rng)
        else:
            micro = jax.tree.map(
                lambda x: x.reshape(x.shape[0] // accum, accum, *x.shape[1:]).swapaxes(0, 1),
                batch)

            def accumulate(carry, xs):
                index, mb = xs
                g, aux = grad_fn(state.params, mb, jax.random.fold_in(rng, index))
                return jax.tree.map(jnp.add, carry, (g, aux)), None

            zeros = (jax.tree.map(jnp.zeros_like, state.params),
                     (jnp.zeros((), jnp.float32),) * 3)
            (grads, (ce, z, count)), _ = jax.lax.scan(
                accumulate, zeros, (jnp.arange(accum), micro))
        denom = jnp.maximum(count, 1.0)
        grads = jax.tree.map(lambda g: g / denom, grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": ce / denom, "z_loss": z / denom, "grad_norm": optax.tree.norm(grads),
                   "lr": schedule(state.step), "tokens": count}
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        return new_state, metrics

    return train_step


def make_loss_fn(model_config: ModelConfig, train_config: TrainConfig
                 ) -> Callable[[Params, Batch, jax.Array], tuple[jax.Array, tuple]]:
    """The training objective ``loss_sums(params, batch, rng) -> (ce + z, (ce, z, count))``.

    Sums over the batch's target tokens (``loss.cross_entropy_sums``), to be divided once per
    step. With ``train_config.loss_chunk = C > 0`` the model returns its final hidden states
    and the LM head and cross-entropy run over chunks of C tokens (``ops.lm_loss``): the same
    values and gradients without ever holding the [B, T, V] float32 logits. Packed batches pass
    ``segment_ids`` (attention stays within a segment) and ``positions`` (restarting per
    segment) to the model.
    """
    model = Transformer(model_config)
    z_weight, chunk = train_config.z_loss, train_config.loss_chunk
    tied = model_config.tie_embeddings

    def loss_sums(params: Params, batch: Batch, rng: jax.Array):
        kw = dict(positions=batch.get("positions"), segment_ids=batch.get("segment_ids"),
                  rngs={"dropout": rng})
        if not chunk:
            logits = model.apply({"params": params}, batch["inputs"], **kw)
            ce, z, count = cross_entropy_sums(logits, batch["targets"], batch.get("mask"),
                                              z_weight)
            return ce + z, (ce, z, count)
        hidden = model.apply({"params": params}, batch["inputs"], hidden_only=True, **kw)
        head = params["embed"]["embedding"] if tied else params["lm_head"]
        ce, z, count = lm_head_cross_entropy_sums(
            hidden, head.astype(model_config.jnp_dtype), batch["targets"], batch.get("mask"),
            chunk_size=chunk, z_loss=z_weight, head_layout="VD" if tied else "DV")
        return ce + z, (ce, z, count)

    return loss_sums


def make_eval_step(model_config: ModelConfig) -> Callable[[Params, Batch], Metrics]:
    """A pure ``eval_step(params, batch) -> {"loss_sum", "tokens"}`` (sums, to be pooled)."""
    model = Transformer(model_config)

    def eval_step(params: Params, batch: Batch) -> Metrics:
        logits = model.apply({"params": params}, batch["inputs"])
        ce, _, count = cross_entropy_sums(logits, batch["targets"], batch.get("mask"))
        return {"loss_sum": ce, "tokens": count}

    return eval_step
