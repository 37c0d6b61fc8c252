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
    [B, T]. With ``grad_accum = A`` the B rows are split into A micro-batches (micro-batch a
    takes rows a, a + A, ..., so a batch sharded over rows stays sharded) whose summed
    gradients are divided by the total number of target tokens: exactly one batch's gradient.

    Metrics (float32 scalars): ``loss`` (mean cross-entropy), ``z_loss``, ``grad_norm`` (before
    clipping), ``lr`` (of this update) and ``tokens`` (target tokens counted).
    """
    model = Transformer(model_config)
    tx = make_optimizer(train_config)
    schedule = lr_schedule(train_config)
    accum, z_weight = train_config.grad_accum, train_config.z_loss

    def loss_sums(params: Params, batch: Batch, rng: jax.Array):
        logits = model.apply({"params": params}, batch["inputs"], rngs={"dropout": rng})
        ce, z, count = cross_entropy_sums(logits, batch["targets"], batch.get("mask"), z_weight)
        return ce + z, (ce, z, count)

    grad_fn = jax.grad(loss_sums, has_aux=True)

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


def make_eval_step(model_config: ModelConfig) -> Callable[[Params, Batch], Metrics]:
    """A pure ``eval_step(params, batch) -> {"loss_sum", "tokens"}`` (sums, to be pooled)."""
    model = Transformer(model_config)

    def eval_step(params: Params, batch: Batch) -> Metrics:
        logits = model.apply({"params": params}, batch["inputs"])
        ce, _, count = cross_entropy_sums(logits, batch["targets"], batch.get("mask"))
        return {"loss_sum": ce, "tokens": count}

    return eval_step
