"""The ``[train]`` and ``[data]`` tables of a run and ``build_configs``: a TOML preset plus
type-checked ``model.x=`` / ``train.x=`` / ``data.x=`` overrides (``train.py``, the training
benchmark)."""

from __future__ import annotations

import dataclasses
import difflib
import logging
from collections.abc import Sequence
from typing import Any

import jax

from transformer_jax import data as data_lib
from transformer_jax import sharding as sharding_lib
from transformer_jax.config import ModelConfig, check_keys, load_toml, parse_override
from transformer_jax.tokenizer import MODEL_TYPES

logger = logging.getLogger(__name__)

Params = dict[str, Any]
Batch = dict[str, jax.Array]
Metrics = dict[str, jax.Array]


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
      loss_chunk: 0 computes the LM head and the loss over all [B, T, V] logits at once; N > 0
        computes them over chunks of N tokens with a gradient that recomputes each chunk's
        logits, so the float32 [B, T, V] logits are never held whole (large vocabularies).
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
    loss_chunk: int = 0
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
                     "sample_tokens", "loss_chunk"):
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


def _check_int(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
