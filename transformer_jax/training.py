"""Training: configs, loss, AdamW, the pure jitted train step, and the ``run`` loop.

The pieces, from the bottom up:

* ``cross_entropy`` -- mean next-token cross-entropy over the target tokens (masked), with an
  optional z-loss that keeps ``log Z`` near 0.
* ``make_optimizer`` -- AdamW with linear warmup then cosine decay, global-norm clipping, and no
  weight decay on norms, biases or the token embedding (``decay_mask``).
* ``TrainState`` -- everything a run needs to continue: step, params, optimizer state, RNG.
* ``make_init_fn`` / ``make_train_step`` / ``make_eval_step`` -- pure functions, to be jitted
  once (with shardings, donation, ... as the caller likes). ``train_step(state, batch) ->
  (state, metrics)`` accumulates gradients over ``grad_accum`` micro-batches with ``lax.scan``.
* ``run`` -- the loop: data -> init or restore -> steps with progress, evaluation, samples,
  logs and checkpoints -> summary. Reads top to bottom. The state is created directly sharded over
  the mesh of ``train.mesh`` (data x fsdp x tensor, see ``sharding``) and each process loads
  only its rows of the batch; on CPU, ``sharding.configure_cpu_devices`` makes one device per core,
  which is what lets a small model's step use every core.
* ``build_configs`` -- a TOML preset plus type-checked ``model.x=`` / ``train.x=`` / ``data.x=``
  overrides, as used by ``train.py`` and the training benchmark.

Decisions: parameters (and so Adam's moments) stay float32; ``ModelConfig.dtype="bfloat16"``
only changes the compute. Weight decay skips the token embedding too: with a large vocabulary
most rows get no gradient in a step, so decay alone would pull rare tokens' vectors to zero.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import json
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from transformer_jax import data as data_lib
from transformer_jax import distributed
from transformer_jax import sharding as sharding_lib
from transformer_jax.checkpoint import CheckpointManager, ensure_writable_dir
from transformer_jax.config import ModelConfig, check_keys, load_toml, parse_override
from transformer_jax.model import Transformer, abstract_params
from transformer_jax.tokenizer import MODEL_TYPES, Tokenizer

logger = logging.getLogger(__name__)

Params = dict[str, Any]
Batch = dict[str, jax.Array]
Metrics = dict[str, jax.Array]

# Parameter names that never get weight decay (norm gains/shifts, biases, the token table).
_NO_DECAY_NAMES = ("scale", "bias", "embedding")


# Configs -----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimisation, evaluation, logging and checkpointing of a run (the ``[train]`` table).

    Attributes:
      steps: optimizer steps of the whole run (a resumed run continues up to this).
      batch_size: sequences per optimizer step (global, all devices and micro-batches).
      seq_len: T, tokens per sequence; at most the model's ``max_seq_len``.
      grad_accum: split each step's batch into this many micro-batches whose gradients are
        summed before one update (same result as one big batch, less memory).
      lr: peak learning rate, reached after ``warmup_steps``.
      min_lr: learning rate at the end of the cosine decay.
      warmup_steps: linear warmup from ``lr / warmup_steps`` to ``lr``.
      decay_steps: step at which the cosine decay reaches ``min_lr``; 0 means ``steps``.
      weight_decay: decoupled (AdamW) weight decay of the matrices.
      b1: Adam's first-moment decay.
      b2: Adam's second-moment decay.
      eps: Adam's epsilon.
      grad_clip: clip the gradient's global norm to this; 0 disables clipping.
      z_loss: weight of the ``log(Z)^2`` auxiliary loss (0 disables it).
      seed: seeds the parameters, the data order and the RNG.
      eval_every: evaluate the validation loss every this many steps (and at the end); 0
        evaluates only at the end.
      eval_batches: validation batches per evaluation; 0 means the whole validation split.
      log_every: write train metrics every this many steps.
      ckpt_every: save a checkpoint every this many steps (and at the end / on SIGTERM).
      keep_ckpts: how many recent checkpoints to keep.
      run_dir: where checkpoints, ``metrics.jsonl``, TensorBoard events and the summary go.
      mesh: device mesh sizes ``"data,fsdp,tensor"`` (one may be -1: the rest of the
        devices); the default is data parallelism over every device.
      sample_tokens: tokens generated at each evaluation (0 disables samples).
      sample_prompt: text the samples start from.
      sample_temperature: sampling temperature of the samples (0 is greedy).
    """

    steps: int = 1000
    batch_size: int = 16
    seq_len: int = 128
    grad_accum: int = 1
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 100
    decay_steps: int = 0
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    z_loss: float = 0.0
    seed: int = 0
    eval_every: int = 250
    eval_batches: int = 20
    log_every: int = 10
    ckpt_every: int = 250
    keep_ckpts: int = 3
    run_dir: str = "runs/default"
    mesh: str = "-1,1,1"
    sample_tokens: int = 64
    sample_prompt: str = "\n"
    sample_temperature: float = 0.8

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "grad_accum", "log_every", "ckpt_every",
                     "keep_ckpts"):
            _check_int(name, getattr(self, name), minimum=1)
        for name in ("warmup_steps", "decay_steps", "seed", "eval_every", "eval_batches",
                     "sample_tokens"):
            _check_int(name, getattr(self, name), minimum=0)
        if self.batch_size % self.grad_accum:
            raise ValueError(f"batch_size ({self.batch_size}) must be divisible by grad_accum "
                             f"({self.grad_accum})")
        if self.warmup_steps >= self.total_decay_steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be smaller than the decay "
                             f"length ({self.total_decay_steps})")
        if not self.lr > 0 or not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"need lr > 0 and 0 <= min_lr <= lr, got lr={self.lr}, "
                             f"min_lr={self.min_lr}")
        for name in ("weight_decay", "grad_clip", "z_loss", "sample_temperature"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("b1", "b2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")
        if not self.run_dir:
            raise ValueError("run_dir must not be empty")
        sharding_lib.MeshConfig.parse(self.mesh)  # raises ValueError naming a bad mesh

    @property
    def total_decay_steps(self) -> int:
        return self.decay_steps or self.steps

    @property
    def micro_batch_size(self) -> int:
        return self.batch_size // self.grad_accum

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Corpus and tokenizer of a run (the ``[data]`` table).

    Attributes:
      path: comma-separated files, directories or globs of UTF-8 text; empty means the default
        corpus, the Python standard library's sources (works offline).
      tokenizer: ``"bpe"``, ``"unigram"`` or ``"char"`` to train a SentencePiece model on the
        corpus (cached), or the path of a ``.model`` file to load.
      vocab_size: size of a trained bpe/unigram vocabulary; 0 means the model's ``vocab_size``.
        The model's ``vocab_size`` is always set to the tokenizer's.
      val_fraction: the last this fraction of the tokens is the validation split.
      cache_dir: where trained tokenizers and token files are cached.
      max_bytes: cap on the size of the default corpus.
    """

    path: str = ""
    tokenizer: str = "bpe"
    vocab_size: int = 0
    val_fraction: float = 0.05
    cache_dir: str = "~/.cache/transformer_jax"
    max_bytes: int = data_lib.DEFAULT_CORPUS_MAX_BYTES

    def __post_init__(self) -> None:
        _check_int("vocab_size", self.vocab_size, minimum=0)
        _check_int("max_bytes", self.max_bytes, minimum=1)
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"val_fraction must be in [0, 1), got {self.val_fraction}")
        if not self.tokenizer:
            raise ValueError(f"tokenizer must be one of {MODEL_TYPES} or a .model path")

    @property
    def patterns(self) -> list[str]:
        return [p.strip() for p in self.path.split(",") if p.strip()]


def config_from_dict(cls: type, values: dict[str, Any], section: str) -> Any:
    """Builds a ``TrainConfig`` / ``DataConfig`` from a TOML table, rejecting unknown keys."""
    check_keys(values, cls, section)
    return cls(**values)


SECTIONS: dict[str, type] = {"model": ModelConfig, "train": TrainConfig, "data": DataConfig}


class ConfigError(ValueError):
    """A config file or override that cannot be used."""


def build_configs(config: str, overrides: Sequence[str] = ()
                  ) -> tuple[ModelConfig, TrainConfig, DataConfig]:
    """Reads a TOML config and applies ``section.key=value`` overrides.

    Args:
      config: a preset name (``configs/NAME.toml``) or a path to a TOML file with ``[model]``,
        ``[train]`` and ``[data]`` tables (each optional).
      overrides: ``model.x=v``, ``train.x=v`` or ``data.x=v`` strings; values are parsed as
        the field's type.

    Returns:
      ``(model_config, train_config, data_config)``.

    Raises:
      ConfigError: for an unknown table, section or key (listing close matches), a malformed
        override or a value of the wrong type.
      FileNotFoundError: if the config does not exist.
    """
    tables = load_toml(config)
    unknown = sorted(set(tables) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"config {config!r} has unknown tables {unknown}; expected "
                          f"{sorted(SECTIONS)}")
    values: dict[str, dict[str, Any]] = {s: dict(tables.get(s, {})) for s in SECTIONS}
    for item in overrides:
        section, key, text = _split_override(item)
        try:
            check_keys({key: None}, SECTIONS[section], section)
            values[section][key] = parse_override(SECTIONS[section], key, text)
        except ValueError as e:
            raise ConfigError(f"override {item!r}: {e}") from None
    try:
        model = ModelConfig.from_dict(values["model"])
        train = config_from_dict(TrainConfig, values["train"], "train")
        data = config_from_dict(DataConfig, values["data"], "data")
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config {config!r}: {e}") from None
    return model, train, data


def _split_override(item: str) -> tuple[str, str, str]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form section.key=value")
    name, text = item.split("=", 1)
    name = name.strip()
    if "." not in name:
        owners = [f"{s}.{name}" for s, cls in SECTIONS.items()
                  if name in cls.__dataclass_fields__]
        hint = f"; did you mean {' or '.join(owners)}?" if owners else ""
        raise ConfigError(f"override {item!r} needs a section prefix (model., train. or "
                          f"data.){hint}")
    section, key = name.split(".", 1)
    if section not in SECTIONS:
        close = difflib.get_close_matches(section, list(SECTIONS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"override {item!r}: unknown section {section!r}, expected one of "
                          f"{sorted(SECTIONS)}{hint}")
    return section, key, text.strip()


# Loss --------------------------------------------------------------------------------------------

def cross_entropy_sums(logits: jax.Array, targets: jax.Array, mask: jax.Array | None = None,
                       z_loss: float = 0.0) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Summed next-token cross-entropy and z-loss, and the number of target tokens.

    Sums (not means) so that micro-batches can be added up and divided once.

    Args:
      logits: [B, T, V] float32 logits.
      targets: [B, T] int target ids.
      mask: optional [B, T] weights (1 = target counts, 0 = padding).
      z_loss: weight of ``logsumexp(logits)^2``.

    Returns:
      ``(ce_sum, z_sum, count)``: float32 scalars.
    """
    logits = logits.astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)  # [B, T]
    weights = jnp.ones_like(ce) if mask is None else mask.astype(jnp.float32)
    z_sum = jnp.zeros((), jnp.float32)
    if z_loss:
        z_sum = z_loss * jnp.sum(weights * jnp.square(jax.nn.logsumexp(logits, axis=-1)))
    return jnp.sum(weights * ce), z_sum, jnp.sum(weights)


def cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array | None = None,
                  z_loss: float = 0.0) -> jax.Array:
    """Mean cross-entropy (plus z-loss) over the target tokens that ``mask`` keeps.

    Args:
      logits: [B, T, V] logits.
      targets: [B, T] int target ids.
      mask: optional [B, T] weights.
      z_loss: weight of ``logsumexp(logits)^2``.

    Returns:
      float32 scalar in nats per token.
    """
    ce_sum, z_sum, count = cross_entropy_sums(logits, targets, mask, z_loss)
    return (ce_sum + z_sum) / jnp.maximum(count, 1.0)


# Optimizer ---------------------------------------------------------------------------------------

def lr_schedule(config: TrainConfig) -> optax.Schedule:
    """Linear warmup to ``lr`` over ``warmup_steps``, then cosine decay to ``min_lr``.

    Update i (0-based) uses ``schedule(i)``: the first update already has ``lr / warmup_steps``
    (not 0) and update ``decay_steps - 1`` has ``min_lr``.
    """
    base = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=config.lr, warmup_steps=config.warmup_steps,
        decay_steps=config.total_decay_steps, end_value=config.min_lr)
    return lambda count: base(count + 1)


def decay_mask(params: Params) -> Params:
    """True for the parameters that get weight decay: every matrix except the token embedding.

    Norm scales/biases, projection biases (``q_bias`` ...) and ``embed/embedding`` are excluded
    by name, so the mask is the same in the unrolled and the scanned (stacked) layouts.
    """
    def decays(path, _) -> bool:
        name = str(getattr(path[-1], "key", path[-1]))
        return not any(name == n or name.endswith("_" + n) for n in _NO_DECAY_NAMES)

    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW with the warmup-cosine schedule and ``decay_mask``."""
    adamw = optax.adamw(lr_schedule(config), b1=config.b1, b2=config.b2, eps=config.eps,
                        weight_decay=config.weight_decay, mask=decay_mask)
    if config.grad_clip:
        return optax.chain(optax.clip_by_global_norm(config.grad_clip), adamw)
    return adamw


# Train state and steps ---------------------------------------------------------------------------

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


# CPU math --------------------------------------------------------------------------------------

# Measured on a 2-core CPU (shakespeare_char step, process CPU time): about 15-20% less time per
# train step, mostly from vectorised approximations of exp/logistic in SwiGLU and the softmax.
# NaN/inf semantics and exact division are kept, so non-finite losses are still detected.
CPU_FAST_MATH_FLAGS = (
    "--xla_cpu_enable_fast_math=true",
    "--xla_cpu_fast_math_honor_nans=true",
    "--xla_cpu_fast_math_honor_infs=true",
    "--xla_cpu_fast_math_honor_division=true",
)


def enable_cpu_fast_math() -> bool:
    """Adds ``CPU_FAST_MATH_FLAGS`` to ``XLA_FLAGS`` unless the user set any ``xla_cpu_``
    fast-math flag. Only effective before JAX creates its CPU backend (call it first thing).

    Returns:
      Whether the flags were added.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_enable_fast_math" in flags:
        return False
    os.environ["XLA_FLAGS"] = " ".join([flags, *CPU_FAST_MATH_FLAGS]).strip()
    return True


# FLOPs and peak ----------------------------------------------------------------------------------

def flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: ``6 N`` plus attention, ``12 L T N H`` (PaLM's convention).

    N counts the weights that take part in matmuls: every parameter except norms and biases,
    and the embedding only when it is also the (tied) LM head (a lookup is not a matmul).
    Attention counts the full T x T score and value matmuls, forward and backward.
    """
    params = abstract_params(config)
    n = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = str(getattr(path[-1], "key", path[-1]))
        if name == "embedding" and not config.tie_embeddings:
            continue
        if name in ("scale", "bias") or name.endswith("_bias"):
            continue
        n += int(np.prod(leaf.shape))
    attention = 12 * config.n_layers * seq_len * config.n_heads * config.head_dim
    return 6.0 * n + attention


def measure_matmul_peak(size: int = 1024, dtype: str = "float32", repeats: int = 10,
                        device: jax.Device | None = None) -> float:
    """Dense-matmul FLOP/s measured on ``device``: the best of ``repeats`` timed matmuls.

    Args:
      size: n of the [n, n] x [n, n] matmul (2 n^3 FLOPs).
      dtype: the operands' dtype.
      repeats: timed runs; the fastest counts (the others suffer from noise).
      device: where to run; the default device if None.

    Returns:
      FLOP/s.
    """
    device = device or jax.devices()[0]
    a = jax.device_put(jnp.ones((size, size), dtype), device)
    matmul = jax.jit(lambda x: x @ x)
    jax.block_until_ready(matmul(a))
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(matmul(a))
        best = min(best, time.perf_counter() - start)
    return 2 * size ** 3 / best


# Data --------------------------------------------------------------------------------------------

def prepare_data(data_config: DataConfig, vocab_size: int
                 ) -> tuple[Tokenizer, np.ndarray, np.ndarray]:
    """Loads or trains the tokenizer and tokenizes the corpus (both cached), then splits it.

    Args:
      data_config: the corpus and tokenizer settings.
      vocab_size: vocabulary size to train a bpe/unigram tokenizer with if the data config
        does not give one.

    Returns:
      ``(tokenizer, train_tokens [N_train], val_tokens [N_val])``.

    Raises:
      FileNotFoundError: for a missing corpus or tokenizer file.
      ValueError: for an empty corpus or a tokenizer file that does not load.
    """
    dc = data_config
    cache_dir = Path(dc.cache_dir).expanduser()
    if dc.patterns:
        files = data_lib.resolve_corpus(dc.patterns)
    else:
        files = data_lib.default_corpus(dc.max_bytes)
    ensure_writable_dir(cache_dir, "data cache directory")
    if dc.tokenizer in MODEL_TYPES:
        tokenizer = Tokenizer.train_or_load(files, cache_dir, dc.vocab_size or vocab_size,
                                            dc.tokenizer)
    else:
        tokenizer = Tokenizer.load(Path(dc.tokenizer).expanduser())
    tokens = data_lib.tokenize_corpus(files, tokenizer, cache_dir)
    train_tokens, val_tokens = data_lib.split(tokens, dc.val_fraction)
    logger.info("data: %d files, %d train / %d val tokens, tokenizer %s", len(files),
                len(train_tokens), len(val_tokens), tokenizer)
    return tokenizer, train_tokens, val_tokens


def check_run(model_config: ModelConfig, train_config: TrainConfig, num_train_tokens: int,
              num_devices: int | None = None) -> None:
    """Raises a clear ValueError for a run that cannot work, before anything is compiled.

    Args:
      model_config: the model (with its final vocab size).
      train_config: the run.
      num_train_tokens: size of the train split.
      num_devices: devices the batch is split over; ``jax.device_count()`` by default.
    """
    tc = train_config
    if tc.seq_len > model_config.max_seq_len:
        raise ValueError(f"train.seq_len={tc.seq_len} is above the model's max_seq_len="
                         f"{model_config.max_seq_len}")
    num_devices = jax.device_count() if num_devices is None else num_devices
    if tc.micro_batch_size % num_devices:
        raise ValueError(f"train.batch_size={tc.batch_size} (micro-batch "
                         f"{tc.micro_batch_size} with grad_accum={tc.grad_accum}) is not "
                         f"divisible by the number of devices ({num_devices})")
    if num_train_tokens <= tc.seq_len:
        raise ValueError(f"the train split has {num_train_tokens} tokens, not more than "
                         f"train.seq_len={tc.seq_len}; use more data or a shorter seq_len")
    if model_config.param_dtype != "float32":
        logger.warning("param_dtype=%s: training keeps its master weights in this dtype",
                       model_config.param_dtype)


# The run -----------------------------------------------------------------------------------------

class NonFiniteLossError(FloatingPointError):
    """The loss or gradient became NaN/inf; the run stopped without saving."""


@dataclasses.dataclass
class RunSummary:
    """What a run did (also written to ``run_dir/summary.json``)."""

    run_dir: str
    start_step: int
    final_step: int
    train_loss: float | None
    val_loss: float | None
    val_ppl: float | None
    loss_unit: str
    tokens_seen: int
    wall_time_s: float
    train_time_s: float
    compile_time_s: float
    tokens_per_s: float | None
    step_time_ms: float | None
    mfu: float | None
    checkpoint: str | None
    interrupted: str | None = None


def run(model_config: ModelConfig, train_config: TrainConfig, data_config: DataConfig, *,
        progress: bool = True) -> RunSummary:
    """Trains (or resumes) a model; the whole loop, top to bottom.

    Resumes from the latest complete checkpoint in ``run_dir/checkpoints`` if there is one, and
    then gives exactly the losses and parameters of an uninterrupted run. SIGTERM/SIGINT save a
    checkpoint of the current step and stop; a non-finite loss stops without saving.

    Args:
      model_config: the model; its ``vocab_size`` is replaced by the tokenizer's.
      train_config: optimisation, evaluation, logging and checkpoint settings.
      data_config: corpus and tokenizer.
      progress: show a tqdm progress bar (loss, tokens/s, MFU, ETA).

    Returns:
      The run's summary.

    Raises:
      NonFiniteLossError: the loss became NaN/inf (earlier checkpoints are kept).
      ValueError, FileNotFoundError, PermissionError: bad input, before any training.
    """
    tc = train_config
    wall_start = time.perf_counter()

    # 1. Where things go, checked before any expensive work.
    run_dir = ensure_writable_dir(tc.run_dir, "run directory")
    ckpt = CheckpointManager(run_dir / "checkpoints", keep=tc.keep_ckpts)

    # 2. Data: tokenizer, token file, splits.
    tokenizer, train_tokens, val_tokens = prepare_data(data_config, model_config.vocab_size)
    if tokenizer.vocab_size != model_config.vocab_size:
        logger.info("model vocab_size %d -> %d (the tokenizer's)", model_config.vocab_size,
                    tokenizer.vocab_size)
        model_config = model_config.replace(vocab_size=tokenizer.vocab_size)
    mesh = sharding_lib.make_mesh(sharding_lib.MeshConfig.parse(tc.mesh))
    batch_sharding = sharding_lib.batch_sharding(mesh)
    check_run(model_config, tc, len(train_tokens),
              num_devices=mesh.shape["data"] * mesh.shape["fsdp"])
    main_process = distributed.is_main_process()
    eval_kw = dict(batch_size=tc.micro_batch_size, seq_len=tc.seq_len,
                   max_batches=tc.eval_batches or None)
    if len(val_tokens):
        data_lib.eval_batches(val_tokens, **eval_kw)  # raises now if val cannot fill a batch
    configs = {"model": dataclasses.asdict(model_config), "train": dataclasses.asdict(tc),
               "data": dataclasses.asdict(data_config), "tokenizer": str(tokenizer.path)}

    # 3. State: restore the latest checkpoint, or initialise directly sharded over the mesh
    # (parameters and optimizer state by the logical-axis rules; batches over data x fsdp).
    key = jax.random.key(tc.seed)
    init = make_init_fn(model_config, tc)
    state_shardings = sharding_lib.state_shardings(
        jax.eval_shape(init, key), sharding_lib.param_shardings(model_config, mesh))
    init_fn = sharding_lib.shard_init(init, state_shardings)
    latest = ckpt.latest_step()
    if latest is not None:
        abstract = sharding_lib.with_shardings(jax.eval_shape(init, key), state_shardings)
        state, meta = ckpt.restore(abstract, latest)
        _check_same_model(meta.get("model"), configs["model"], ckpt.step_path(latest))
        logger.info("resumed from %s (step %d)", ckpt.step_path(latest), latest)
    else:
        state = init_fn(key)
    start_step = int(state.step)
    if main_process:
        (run_dir / "config.json").write_text(json.dumps(configs, indent=2))

    # 4. Compile the step once (ahead of time, so its cost is reported separately).
    compile_start = time.perf_counter()
    part, parts = distributed.process_batch_shard(batch_sharding, tc.batch_size)

    def get_batch(step: int) -> Batch:
        rows = data_lib.get_batch(train_tokens, tc.seed, step, tc.batch_size, tc.seq_len,
                                  process_index=part, process_count=parts)
        return distributed.global_batch(rows, batch_sharding, tc.batch_size)

    batch = get_batch(start_step)
    train_step = sharding_lib.jit_train_step(make_train_step(model_config, tc), state_shardings,
                                             batch_sharding)
    train_step = train_step.lower(state, batch).compile()
    compile_time = time.perf_counter() - compile_start
    eval_step = sharding_lib.jit_sharded(
        make_eval_step(model_config), mesh, (state_shardings.params, batch_sharding),
        sharding_lib.replicated(mesh))
    eval_part, eval_parts = distributed.process_batch_shard(batch_sharding, tc.micro_batch_size)
    eval_kw.update(process_index=eval_part, process_count=eval_parts)
    eval_step = _placing(eval_step, functools.partial(
        distributed.global_batch, sharding=batch_sharding, global_batch_size=tc.micro_batch_size))
    flops = flops_per_token(model_config, tc.seq_len)
    peak = measure_matmul_peak()
    logger.info("compiled train step in %.1f s; %.3g FLOPs/token; matmul peak %.3g FLOP/s; "
                "mesh %s", compile_time, flops, peak, dict(mesh.shape))

    progress = progress and main_process
    log = _RunLog(run_dir, start_step, tc, flops, peak, log_train=not progress,
                  write=main_process)
    last_val: float | None = None
    interrupted: str | None = None
    step = start_step
    bar = _progress_bar(progress, start_step, tc.steps)
    try:
        with _StopOnSignal() as stop:
            log.start_timer()
            # 5. The loop: one jitted step per batch; the host reads each step's metrics one
            # step late, so it never waits for the device while there is work to queue.
            while step < tc.steps:
                state, metrics = train_step(state, batch)
                step += 1
                log.push(step, metrics)
                if step < tc.steps:
                    batch = get_batch(step)
                log.flush(keep_last=1)
                bar.update(1)
                bar.set_postfix_str(log.postfix(), refresh=False)
                last = step == tc.steps
                if stop.signal is not None or last or step % tc.ckpt_every == 0 or (
                        tc.eval_every and step % tc.eval_every == 0):
                    log.flush()  # checks every pending loss before anything is saved
                    log.stop_timer()
                    if (tc.eval_every and step % tc.eval_every == 0) or last:
                        last_val = _evaluate_and_sample(state, step, eval_step, val_tokens,
                                                        eval_kw, tokenizer, model_config, tc,
                                                        log)
                    if stop.signal is not None or last or step % tc.ckpt_every == 0:
                        ckpt.save(step, state, meta=dict(configs, step=step,
                                                         train_loss=log.last_loss))
                    log.start_timer()
                if stop.signal is not None:
                    interrupted = stop.signal
                    logger.warning("%s: saved a checkpoint of step %d and stopped",
                                   interrupted, step)
                    break
        log.flush()
    except NonFiniteLossError:
        latest_good = ckpt.latest_step()
        logger.error("stopped without saving; the last good checkpoint is %s",
                     ckpt.step_path(latest_good) if latest_good is not None else "none")
        raise
    finally:
        bar.close()
        ckpt.close()
        log.close()

    # 6. Summary.
    latest = ckpt.latest_step()
    train_time = log.train_time
    summary = RunSummary(
        run_dir=str(run_dir), start_step=start_step, final_step=step,
        train_loss=log.last_loss, val_loss=last_val,
        val_ppl=math.exp(last_val) if last_val is not None and last_val < 700 else None,
        loss_unit="nats/char" if data_config.tokenizer == "char" else "nats/token",
        tokens_seen=step * tc.tokens_per_step, wall_time_s=time.perf_counter() - wall_start,
        train_time_s=train_time, compile_time_s=compile_time,
        tokens_per_s=log.tokens_per_s(overall=True), mfu=log.mfu(overall=True),
        step_time_ms=1000 * train_time / log.timed_steps if log.timed_steps else None,
        checkpoint=str(ckpt.step_path(latest)) if latest is not None else None,
        interrupted=interrupted)
    if main_process:
        (run_dir / "summary.json").write_text(json.dumps(dataclasses.asdict(summary),
                                                         indent=2))
    return summary


def evaluate(eval_step: Callable[[Params, Batch], Metrics], params: Params,
             batches: Iterator[dict[str, np.ndarray]]) -> float:
    """Mean cross-entropy over all target tokens of ``batches`` (nats per token)."""
    loss_sum = tokens = 0.0
    for batch in batches:
        # One batch in flight at a time: queueing them all makes XLA:CPU's multi-device
        # collectives wait on each other until its rendezvous times out (seen with 2 devices).
        sums = jax.device_get(eval_step(params, batch))
        loss_sum += float(sums["loss_sum"])
        tokens += float(sums["tokens"])
    return loss_sum / max(tokens, 1.0)


def sample_text(model_config: ModelConfig, params: Params, tokenizer: Tokenizer, prompt: str,
                max_new_tokens: int, temperature: float, seed: int) -> str:
    """Generates a continuation of ``prompt`` (KV-cached decode) and returns prompt + it."""
    from transformer_jax.decode import generate

    ids = tokenizer.encode(prompt) or [max(tokenizer.bos_id, 0)]
    ids = ids[-(model_config.max_seq_len // 2):]
    max_new_tokens = min(max_new_tokens, model_config.max_seq_len - len(ids))
    if max_new_tokens <= 0:
        return prompt
    result = generate(model_config, params, [ids], max_new_tokens=max_new_tokens,
                      temperature=temperature, seed=seed)
    return tokenizer.decode(ids + list(result.tokens[0]))


# Helpers of run ----------------------------------------------------------------------------------

def _placing(step_fn: Callable[[Params, Batch], Metrics], place: Callable[[np.ndarray], Any]
             ) -> Callable[[Params, Batch], Metrics]:
    return lambda params, batch: step_fn(params, jax.tree.map(place, batch))


def _evaluate_and_sample(state: TrainState, step: int, eval_step, val_tokens: np.ndarray,
                         eval_kw: dict[str, Any], tokenizer: Tokenizer,
                         model_config: ModelConfig, tc: TrainConfig, log: _RunLog
                         ) -> float | None:
    val_loss = None
    if len(val_tokens):
        val_loss = evaluate(eval_step, state.params,
                            data_lib.eval_batches(val_tokens, **eval_kw))
        log.record_eval(step, val_loss)
    # The sample decodes on one host's devices, so it needs the params whole on each process.
    if tc.sample_tokens and jax.process_count() == 1:
        text = sample_text(model_config, state.params, tokenizer, tc.sample_prompt,
                           tc.sample_tokens, tc.sample_temperature, seed=step)
        log.record_sample(step, text)
    return val_loss


def _check_same_model(saved: dict[str, Any] | None, current: dict[str, Any], where: Path
                      ) -> None:
    if saved is None:
        return
    diffs = [f"{k}: {saved.get(k)!r} in the checkpoint, {v!r} now"
             for k, v in current.items() if saved.get(k) != v]
    if diffs:
        raise ValueError(f"checkpoint {where} was written for another model ("
                         + "; ".join(diffs) + "); use another train.run_dir")


class _RunLog:
    """Collects step metrics (one step late), checks them, and writes logs.

    Writes ``metrics.jsonl`` (one JSON object per line: train records every ``log_every``
    steps, val records and samples at evaluations) and TensorBoard events under ``tb/``. On a
    resumed run, records after the restored step (written by the killed run) are dropped, so
    the file reads as if the run had never stopped.
    """

    def __init__(self, run_dir: Path, start_step: int, tc: TrainConfig, flops: float,
                 peak: float, log_train: bool, write: bool = True) -> None:
        from tensorboardX import SummaryWriter

        self.tc, self.flops, self.peak = tc, flops, peak
        # Without a progress bar, train records are logged at INFO so that progress shows.
        self._train_level = logging.INFO if log_train else logging.DEBUG
        # Only one process of a multi-host run writes the logs; the others compute the same
        # (replicated) metrics and discard them.
        self.path = run_dir / "metrics.jsonl" if write else Path(os.devnull)
        if write:
            _truncate_jsonl(self.path, start_step)
        self._file = open(self.path, "a")  # noqa: SIM115 - closed in close()
        self._tb = SummaryWriter(str(run_dir / "tb"),
                                 purge_step=start_step + 1 if start_step else None,
                                 write_to_disk=write)
        self._pending: list[tuple[int, Metrics]] = []
        self.last_loss: float | None = None
        self.train_time = 0.0
        self._timer: float | None = None
        self._interval_time = 0.0
        self._interval_steps = 0
        self._rate: float | None = None
        self._warm = False
        self.timed_steps = 0

    def push(self, step: int, metrics: Metrics) -> None:
        self._pending.append((step, metrics))

    def flush(self, keep_last: int = 0) -> None:
        while len(self._pending) > keep_last:
            step, metrics = self._pending.pop(0)
            self._record(step, {k: float(v) for k, v in jax.device_get(metrics).items()})

    def _record(self, step: int, m: dict[str, float]) -> None:
        if not (math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])):
            raise NonFiniteLossError(f"non-finite loss {m['loss']} (grad norm {m['grad_norm']}) "
                                     f"at step {step}")
        self.last_loss = m["loss"]
        if not self._warm:
            # The first step of a process runs slower (allocations, thread start-up); time
            # from its end so the rate describes the steady state.
            self._warm = True
            self._interval_time, self._interval_steps = 0.0, 0
            if self._timer is not None:
                self._timer = time.perf_counter()
        else:
            self._interval_steps += 1
        if step % self.tc.log_every == 0 or step == self.tc.steps:
            self._update_rate()
            record = {"step": step, "split": "train", **m,
                      "tokens_per_s": self._rate, "mfu": self.mfu()}
            self._write(record)
            for k in ("loss", "lr", "grad_norm"):
                self._tb.add_scalar(f"train/{k}", m[k], step)
            if self._rate:
                self._tb.add_scalar("train/tokens_per_s", self._rate, step)
            logger.log(self._train_level, "step %d: %s, lr %.3g, grad norm %.3g",
                       step, self.postfix(), m["lr"], m["grad_norm"])

    def _update_rate(self) -> None:
        now = time.perf_counter()
        elapsed = self._interval_time + (now - self._timer if self._timer is not None else 0.0)
        if elapsed > 0 and self._interval_steps:
            self._rate = self._interval_steps * self.tc.tokens_per_step / elapsed
        self.train_time += elapsed
        self.timed_steps += self._interval_steps
        self._interval_time, self._interval_steps = 0.0, 0
        if self._timer is not None:
            self._timer = now

    def start_timer(self) -> None:
        self._timer = time.perf_counter()

    def stop_timer(self) -> None:
        if self._timer is not None:
            self._interval_time += time.perf_counter() - self._timer
            self._timer = None

    def tokens_per_s(self, overall: bool = False) -> float | None:
        """Training tokens/s over the last log interval, or over the whole run."""
        if overall:
            if not self.timed_steps or not self.train_time:
                return self._rate
            return self.timed_steps * self.tc.tokens_per_step / self.train_time
        return self._rate

    def mfu(self, overall: bool = False) -> float | None:
        rate = self.tokens_per_s(overall)
        return rate * self.flops / self.peak if rate else None

    def postfix(self) -> str:
        parts = []
        if self.last_loss is not None:
            parts.append(f"loss {self.last_loss:.4f}")
        if self._rate:
            parts.append(f"{self._rate:,.0f} tok/s")
            parts.append(f"MFU {100 * self.mfu():.1f}%")
        return ", ".join(parts)

    def record_eval(self, step: int, val_loss: float) -> None:
        ppl = math.exp(val_loss) if val_loss < 700 else math.inf
        self._write({"step": step, "split": "val", "loss": val_loss, "ppl": ppl})
        self._tb.add_scalar("val/loss", val_loss, step)
        self._tb.add_scalar("val/ppl", ppl, step)
        train = f"train loss {self.last_loss:.4f}, " if self.last_loss is not None else ""
        logger.info("step %d: %sval loss %.4f, ppl %.2f", step, train, val_loss, ppl)

    def record_sample(self, step: int, text: str) -> None:
        self._write({"step": step, "split": "sample", "text": text})
        self._tb.add_text("sample", text, step)
        logger.info("sample at step %d:\n%s", step, text)

    def _write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
        self._tb.close()


def _truncate_jsonl(path: Path, last_step: int) -> None:
    """Drops the records of ``path`` with a step after ``last_step`` (atomically)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= last_step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by a kill
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def set_postfix_str(self, s: str, refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass


def _progress_bar(enabled: bool, start: int, total: int) -> Any:
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True,
                smoothing=0.1)


class _StopOnSignal(contextlib.AbstractContextManager):
    """Turns SIGTERM/SIGINT into a request to checkpoint and stop (``.signal`` is its name).

    A second SIGINT raises KeyboardInterrupt at once. Only active in the main thread (signal
    handlers cannot be installed elsewhere).
    """

    def __init__(self) -> None:
        self.signal: str | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        logger.warning("received %s: saving a checkpoint and stopping after this step", name)
        self.signal = name

    def __enter__(self) -> _StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def _check_int(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
