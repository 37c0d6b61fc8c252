"""``TrainState`` and the pure step functions: ``init(key) -> state``, ``train_step(state,
batch) -> (state, metrics)`` (gradient accumulation over micro-batches with ``lax.scan``) and
``eval_step(params, batch) -> sums``, each to be jitted once with the caller's shardings.

With ``train.lora_rank > 0`` the state's params are ``{"base": frozen, "adapters": trained}``
(``ParamsLayout``); the gradient and the optimizer cover the adapters only."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

from transformer_jax.model import lora
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.moe import balance_correction_bias
from transformer_jax.model.ops.lm_loss import lm_head_cross_entropy_sums
from transformer_jax.model.transformer import Transformer, init_params
from transformer_jax.parallel.context import balance_batch, per_part_loss
from transformer_jax.train.config import TrainConfig
from transformer_jax.train.loss import cross_entropy_sums, mtp_loss
from transformer_jax.train.optim import lr_schedule, make_optimizer

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
      rng: [2] uint32 raw key data of the run's PRNG key (no step draws from it).
    """

    step: jax.Array
    params: Params
    opt_state: optax.OptState
    rng: jax.Array


@dataclasses.dataclass(frozen=True)
class ParamsLayout:
    """How a train state's params relate to the model's, and which of them are trained.

    Attributes:
      lora_config: rank, alpha and targets; None for full training (the state's params are
        the model's). LoRA: they are ``{"base", "adapters"}`` and only the adapters train.
      base_dtype: dtype the frozen base is stored in; None keeps the param dtype.
      base_quant: how the frozen base is stored quantised (QLoRA, ``quant.parse_quant``), or None.
    """

    lora_config: lora.LoraConfig | None = None
    base_dtype: str | None = None
    base_quant: str | None = None

    @classmethod
    def of(cls, train_config: TrainConfig) -> ParamsLayout:
        """The layout of ``train.lora_rank`` / ``lora_base_dtype`` / ``lora_base_quant``."""
        return cls(train_config.lora_config, train_config.lora_base_dtype or None,
                   train_config.lora_base_quant or None)

    def model_params(self, params: Params) -> Params:
        """The params to run the model with (LoRA: ``W + alpha/R A B``, base without gradient;
        a quantised base dequantised first)."""
        if self.lora_config is None:
            return params
        if self.base_quant:
            from transformer_jax.model.quant import dequantize_params

            params = {**params, lora.BASE: dequantize_params(params[lora.BASE])}
        return lora.model_params(params, self.lora_config)

    def trainable(self, params: Params) -> Params:
        """The trained part of the state's params (differentiated, and the optimizer's)."""
        return params if self.lora_config is None else params[lora.ADAPTERS]

    def with_trainable(self, params: Params, trainable: Params) -> Params:
        """The state's params with their trained part replaced."""
        return trainable if self.lora_config is None else {**params, lora.ADAPTERS: trainable}

    def from_model_params(self, model_config: ModelConfig, params: Params,
                          key: jax.Array) -> Params:
        """The state's params for model params (LoRA: the base, cast, and fresh adapters)."""
        if self.lora_config is None:
            return params
        base = params if self.base_dtype is None else lora.freeze_base(params, self.base_dtype)
        if self.base_quant:
            from transformer_jax.model.quant import for_model, parse_quant, quantize_params

            quant = for_model(model_config, parse_quant(self.base_quant))
            base = quantize_params(params, quant)
        return {lora.BASE: base,
                lora.ADAPTERS: lora.init_adapters(model_config, self.lora_config, params, key)}


def make_init_fn(model_config: ModelConfig, train_config: TrainConfig
                 ) -> Callable[..., TrainState]:
    """A pure ``init(key, params=None) -> TrainState``; jit it (with ``out_shardings`` to shard).

    ``params`` are the model's starting weights (fine-tuning); None initialises them at random.
    The optimizer state is fresh; LoRA adapters start from ``key`` with B = 0.
    """
    tx = make_optimizer(train_config)
    layout = ParamsLayout.of(train_config)

    def init(key: jax.Array, params: Params | None = None) -> TrainState:
        param_key, rng_key = jax.random.split(key)
        if params is None:
            params = init_params(model_config, param_key)
        params = layout.from_model_params(model_config, params, jax.random.fold_in(param_key, 1))
        return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                          opt_state=tx.init(layout.trainable(params)),
                          rng=jax.random.key_data(rng_key))

    return init


def make_train_step(model_config: ModelConfig, train_config: TrainConfig,
                    loss_fn: Callable[[Params, Batch], tuple[jax.Array, tuple]] | None = None
                    ) -> Callable[[TrainState, Batch], tuple[TrainState, Metrics]]:
    """The pure ``train_step(state, batch) -> (state, metrics)``; jit it once.

    The batch is ``inputs`` and ``targets`` [B, T] int, optionally ``mask``, ``segment_ids`` and
    ``positions`` [B, T]. With ``grad_accum = A`` micro-batch a takes rows a, a + A, ...; the
    summed gradients are divided by the total target count: exactly one batch's gradient.
    Metrics (float32 scalars): ``loss``, ``z_loss``, ``grad_norm`` (before clipping), ``lr``,
    ``tokens``, plus ``moe_metrics``'s. ``train.moe_bias_update_rate`` > 0 then updates each
    sparse layer's ``moe.correction_bias`` from the step's expert loads. ``loss_fn`` replaces
    ``make_loss_fn``'s objective (same contract; its aux's dict of sums: ``stat_means``).
    """
    tx = make_optimizer(train_config)
    schedule = lr_schedule(train_config)
    accum = train_config.grad_accum
    layout = ParamsLayout.of(train_config)
    bias_rate = train_config.moe_bias_update_rate if loss_fn is None else 0.0
    loss_sums = loss_fn or make_loss_fn(model_config, train_config)
    extra = stat_means if loss_fn else (
        lambda sums, n: moe_metrics(sums, n, model_config.sparse_layers))
    # Differentiated with respect to the trained part only (LoRA: gradients adapter-sized).
    grad_fn = jax.grad(
        lambda trainable, params, batch: loss_sums(
            layout.with_trainable(params, trainable), batch), has_aux=True)

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        trainable = layout.trainable(state.params)
        if accum == 1:
            grads, (ce, z, count, *moe) = grad_fn(trainable, state.params, batch)
        else:
            micro = jax.tree.map(
                lambda x: x.reshape(x.shape[0] // accum, accum, *x.shape[1:]).swapaxes(0, 1), batch)

            def accumulate(carry, mb):
                g, aux = grad_fn(trainable, state.params, mb)
                return jax.tree.map(jnp.add, carry, (g, aux)), None

            shapes = jax.eval_shape(grad_fn, trainable, state.params,
                                    jax.tree.map(lambda x: x[0], micro))
            zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
            (grads, (ce, z, count, *moe)), _ = jax.lax.scan(accumulate, zeros, micro)
        denom = jnp.maximum(count, 1.0)
        grads = jax.tree.map(lambda g: g / denom, grads)
        updates, opt_state = tx.update(grads, state.opt_state, trainable)
        params = layout.with_trainable(state.params, optax.apply_updates(trainable, updates))
        if bias_rate and moe and "load" in moe[0]:
            params = balance_correction_bias(params, moe[0]["load"], bias_rate,
                                             model_config.sparse_layers)
        metrics = {"loss": ce / denom, "z_loss": z / denom, "grad_norm": optax.tree.norm(grads),
                   "lr": schedule(state.step), "tokens": count}
        if moe:
            metrics.update(extra(moe[0], denom))
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        return new_state, metrics

    return train_step


def make_loss_fn(model_config: ModelConfig, train_config: TrainConfig
                 ) -> Callable[[Params, Batch], tuple[jax.Array, tuple]]:
    """The training objective ``loss_sums(params, batch) -> (objective, (ce, z, count))``, and
    with a mixture of experts or ``train.mtp_weight`` ``(objective, (ce, z, count, sums))``.

    All are sums over the batch, divided once per step; ``batch["mask"]`` [B, T] weights each
    target (``count``: their weighted number). ``train.mtp_weight`` lambda adds ``lambda * count
    * loss.mtp_loss`` (``sums["mtp"]``); a mixture of experts adds ``count * (moe_balance_loss *
    balance + moe_z_loss * router_z)`` (``sums``: ``balance``, ``z``, ``load`` [L_sparse, E]).
    ``train.loss_chunk = C > 0`` runs the LM head and the loss over [B, C] chunks.
    """
    model = _training_model(model_config, train_config)
    z_weight, chunk = train_config.z_loss, train_config.loss_chunk
    balance_weight, router_z_weight = train_config.moe_balance_loss, train_config.moe_z_loss
    mtp_weight = train_config.mtp_weight
    layout = ParamsLayout.of(train_config)

    def loss_sums(params: Params, batch: Batch):
        params = layout.model_params(params)
        batch = balance_batch(batch)  # context parallelism: load-balanced order (else as is)
        kw = dict(positions=batch.get("positions"), segment_ids=batch.get("segment_ids"))
        if mtp_weight:
            kw["mtp"] = True
        if not chunk:
            out = model.apply({"params": params}, batch["inputs"], **kw)
            ce, z, count = cross_entropy_sums(out.logits, batch["targets"], batch.get("mask"),
                                              z_weight)
        else:
            out = model.apply({"params": params}, batch["inputs"], hidden_only=True, **kw)
            ce, z, count = per_part_loss(
                functools.partial(lm_head_cross_entropy_sums, chunk_size=chunk,
                                  z_loss=z_weight, logit_softcap=model_config.final_softcap),
                out.hidden, model.lm_head(params).astype(model_config.jnp_dtype),
                batch["targets"], batch.get("mask"))
        objective, sums = ce + z, {}
        if mtp_weight:  # count * the modules' mean CE: the step's division leaves the mean
            sums["mtp"] = count * mtp_loss(out.mtp, batch["targets"], batch.get("mask"),
                                           batch.get("segment_ids"))
            objective = objective + mtp_weight * sums["mtp"]
        if out.moe is None:
            return objective, (ce, z, count, sums) if sums else (ce, z, count)
        moe = {**sums, "balance": count * jnp.mean(out.moe["balance"]),
               "z": count * jnp.mean(out.moe["z"]), "load": out.moe["load"]}
        if balance_weight:
            objective = objective + balance_weight * moe["balance"]
        if router_z_weight:
            objective = objective + router_z_weight * moe["z"]
        return objective, (ce, z, count, moe)

    return loss_sums


#: The stats of a custom loss that stay counts (``stat_means``).
COUNT_STATS = ("tokens", "pairs")


def stat_means(stats: dict[str, jax.Array], count: jax.Array) -> Metrics:
    """A custom loss's summed ``stats`` over its ``count`` (``COUNT_STATS`` stay counts)."""
    return {k: v if k in COUNT_STATS else v / count for k, v in stats.items()}


def moe_metrics(moe: dict[str, jax.Array], count: jax.Array, sparse_layers: tuple[int, ...]
                ) -> Metrics:
    """The step's router metrics from ``make_loss_fn``'s summed ``moe_sums``: ``moe_balance``,
    ``moe_z`` and ``moe_load_max_mean/layer_I`` (max over mean of sparse layer I's [E] load)."""
    out = {} if "mtp" not in moe else {"mtp_loss": moe["mtp"] / count}
    if "load" not in moe:
        return out
    load = moe["load"]  # [L_sparse, E]
    ratio = jnp.max(load, axis=-1) / jnp.maximum(jnp.mean(load, axis=-1), 1e-9)
    return {**out, "moe_balance": moe["balance"] / count, "moe_z": moe["z"] / count,
            **{f"moe_load_max_mean/layer_{i}": ratio[j] for j, i in enumerate(sparse_layers)}}


def make_eval_step(model_config: ModelConfig, train_config: TrainConfig | None = None
                   ) -> Callable[[Params, Batch], Metrics]:
    """A pure ``eval_step(params, batch) -> {"loss_sum", "tokens"}`` (sums) of the train state's
    ``params`` (full training without ``train_config``)."""
    model = _training_model(model_config, train_config)
    layout = ParamsLayout() if train_config is None else ParamsLayout.of(train_config)

    def eval_step(params: Params, batch: Batch) -> Metrics:
        batch = balance_batch(batch)
        logits = model.apply({"params": layout.model_params(params)}, batch["inputs"],
                             positions=batch.get("positions"),
                             segment_ids=batch.get("segment_ids")).logits
        ce, _, count = cross_entropy_sums(logits, batch["targets"], batch.get("mask"))
        return {"loss_sum": ce, "tokens": count}

    return eval_step


def _training_model(model_config: ModelConfig, train_config: TrainConfig | None) -> Transformer:
    """The model the steps run, with ``train.quant`` quantised through qwix."""
    model = Transformer(model_config)
    if train_config is None or not train_config.quant:
        return model
    from transformer_jax.train.quant import training_model

    return training_model(model, train_config.quant)
