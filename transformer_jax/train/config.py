"""The ``[train]`` and ``[data]`` tables of a run and ``build_configs`` (preset + overrides)."""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformer_jax.checkpoint.files import CheckpointError
from transformer_jax.checkpoint.loading import locate
from transformer_jax.data import corpus
from transformer_jax.data.eval_sets import parse_eval_sets
from transformer_jax.model.config import (
    DTYPES,
    ModelConfig,
    check_keys,
    load_toml,
    parse_override,
    plain,
    resolve_config_path,
)
from transformer_jax.model.lora import LoraConfig, check_base_quant
from transformer_jax.parallel import sharding as sharding_lib
from transformer_jax.tokenizer import MODEL_TYPES
from transformer_jax.train.config_docs import help_text
from transformer_jax.train.init_from import init_model_config
from transformer_jax.train.objective import ObjectiveConfig

logger = logging.getLogger(__name__)

#: ``train.quant``: float training (""), or quantised training (``train.quant``).
QUANT_SCHEMES = ("", "int8", "fp8")


def auto_warmup_steps(decay_length: int) -> int:
    """The warmup of ``warmup_steps=-1``: ``min(100, decay_length // 10)``."""
    return min(100, decay_length // 10)


@dataclasses.dataclass(frozen=True)
class TrainConfig(ObjectiveConfig):
    """Optimisation, evaluation, logging and checkpointing of a run (the ``[train]`` table).

    Attributes:
      steps: optimizer steps of the whole run (a resumed run continues up to this).
      batch_size: sequences per optimizer step (global, all devices and micro-batches); DPO
        and ORPO: packed rows of pairs (see ``pairs_per_step``), GRPO: completions.
      seq_len: T, tokens per sequence; at most the model's ``max_seq_len``.
      grad_accum: micro-batches per step, their gradients summed before one update.
      lr: peak learning rate, reached after ``warmup_steps``.
      min_lr: learning rate at the end of the cosine decay.
      warmup_steps: linear warmup from ``lr / warmup_steps`` to ``lr``; -1 (the default) means
        ``min(100, decay length // 10)``, so the warmup follows the run's length.
      decay_steps: step at which the cosine decay reaches ``min_lr``; 0 means ``steps``.
      weight_decay: decoupled (AdamW) weight decay of the matrices.
      b1: Adam's first-moment decay.
      b2: Adam's second-moment decay.
      eps: Adam's epsilon.
      grad_clip: clip the gradient's global norm to this; 0 disables clipping.
      z_loss: weight of the ``log(Z)^2`` auxiliary loss (0 disables it).
      moe_balance_loss: weight of a mixture of experts' load-balancing loss (Switch's
        ``E * sum_e f_e P_e``, mean over the sparse layers; ignored by a dense model).
      moe_z_loss: weight of the router z-loss (ST-MoE's mean ``logsumexp(router logits)^2``).
      moe_bias_update_rate: after each sft step, ``moe.correction_bias += rate * sign(mean
        load - load)`` per sparse layer (DeepSeek-V3's loss-free balancing); 0: off.
      loss_chunk: 0 computes the LM head and the loss over all [B, T, V] logits at once; N > 0
        over [B, N] chunks, recomputed in the backward pass (``ops.lm_loss``).
      seed: seeds the parameters, the data order and the RNG.
      eval_every: evaluate every this many steps and at the end (0: only at the end).
      eval_batches: validation batches per evaluation; 0 means the whole validation split.
      eval_sets: held-out sets scored at every evaluation, ``"name=PATH,..."`` (text, or
        ``.jsonl`` of ``"text"``): loss and bits per byte (``data.eval_sets``); empty: none.
      log_every: write train metrics every this many steps.
      ckpt_every: save a checkpoint every this many steps (and at the end / on SIGTERM).
      keep_ckpts: how many recent checkpoints to keep.
      run_dir: where checkpoints, ``metrics.jsonl``, TensorBoard events and the summary go.
      mesh: device mesh sizes ``"data,fsdp,tensor"`` (one may be -1: the rest), a fourth for
        an expert axis, or named (``"expert=4,data=-1"``); over all slices of a pod (docs/pods.md).
      dcn_mesh: on several TPU slices, how many slices each mesh axis spans (``mesh``'s syntax,
        ``"fsdp=2"``; product: the slice count); S/D devices per slice. Default: all on data.
      sample_tokens: tokens generated at each evaluation (0 disables samples).
      sample_prompt: text the samples start from.
      sample_temperature: sampling temperature of the samples (0 is greedy).
      profile_steps: ``"START,STOP"`` writes a ``jax.profiler`` trace of steps START to STOP
        (1-based, inclusive) into ``run_dir/profile/``; empty (the default) profiles nothing.
      peak_flops: one device's peak FLOP/s behind MFU; 0 measures a matmul on CPU (the whole
        host, shared by its devices) and takes the published dense bf16 peak on GPU/TPU.
      allow_new_data: resume on another corpus (with the same tokenizer, always required).
      init_from: fine-tune: start from the weights of a HF checkpoint directory (config.json +
        safetensors) or of another run (its directory, ``checkpoints/`` or one step). The model
        comes from it; ``model.*`` may only change how it runs (``config.Execution``) and lower
        max_seq_len. The tokenizer is the checkpoint's unless data.tokenizer is a file. The
        optimizer starts fresh; a run directory with checkpoints resumes from them instead.
      lora_rank: rank R of LoRA adapters on a frozen base (``model.lora``); 0 trains every weight.
      lora_alpha: LoRA scale numerator (the update is ``alpha / R * A @ B``); 0 means ``2 R``.
      lora_targets: comma-separated LoRA target matrices among q,k,v,o,gate,up,down.
      lora_base_dtype: dtype the frozen LoRA base is stored in (e.g. ``bfloat16``); empty
        means the model's param_dtype.
      lora_base_quant: store the frozen LoRA base quantised (QLoRA): ``int8``, ``int4``, ``nf4``
        (or ``int4:G`` / ``nf4:G``), dequantised in each step; empty: not quantised.
      quant: quantised training through qwix (``train.quant``): ``int8`` or ``fp8`` (GPU/TPU)
        weight products; empty trains in float. Parameters and checkpoints stay in param_dtype.
      compiled_step: load the train step ``transformer-jax compile --save PATH`` wrote.
    """

    steps: int = 1000
    batch_size: int = 16
    seq_len: int = 128
    grad_accum: int = 1
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = -1
    decay_steps: int = 0
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    z_loss: float = 0.0
    moe_balance_loss: float = 0.01
    moe_z_loss: float = 0.0
    moe_bias_update_rate: float = 0.0
    loss_chunk: int = 0
    seed: int = 0
    eval_every: int = 250
    eval_batches: int = 20
    eval_sets: str = ""
    log_every: int = 10
    ckpt_every: int = 250
    keep_ckpts: int = 3
    run_dir: str = "runs/default"
    mesh: str = "-1,1,1"
    dcn_mesh: str = "-1,1,1"
    sample_tokens: int = 64
    sample_prompt: str = "\n"
    sample_temperature: float = 0.8
    profile_steps: str = ""
    peak_flops: float = 0.0
    allow_new_data: bool = False
    init_from: str = ""
    lora_rank: int = 0
    lora_alpha: float = 0.0
    lora_targets: str = "q,k,v,o,gate,up,down"
    lora_base_dtype: str = ""
    lora_base_quant: str = ""
    quant: str = ""
    compiled_step: str = ""

    def __post_init__(self) -> None:
        self.check_objective()
        for name in ("steps", "batch_size", "seq_len", "grad_accum", "log_every", "ckpt_every",
                     "keep_ckpts"):
            _check_int(name, getattr(self, name), minimum=1)
        for name in ("lr", "min_lr", "weight_decay", "b1", "b2", "eps", "grad_clip", "z_loss",
                     "sample_temperature", "peak_flops", "lora_alpha", "moe_balance_loss",
                     "moe_z_loss", "moe_bias_update_rate"):
            if isinstance(value := getattr(self, name), int | float) and not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {plain(value)!r}")
        _check_int("decay_steps", self.decay_steps, minimum=0)
        if self.warmup_steps == -1:
            object.__setattr__(self, "warmup_steps", auto_warmup_steps(self.total_decay_steps))
        for name in ("warmup_steps", "seed", "eval_every", "eval_batches",
                     "sample_tokens", "loss_chunk", "lora_rank"):
            _check_int(name, getattr(self, name), minimum=0)
        if self.batch_size % self.grad_accum and not self.pairs_per_step:  # else derived
            raise ValueError(f"batch_size ({self.batch_size}) must be divisible by grad_accum "
                             f"({self.grad_accum})")
        if self.warmup_steps >= self.total_decay_steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be smaller than the decay "
                             f"length ({self.total_decay_steps})")
        if not self.lr > 0 or not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"need lr > 0 and 0 <= min_lr <= lr, got lr={self.lr}, "
                             f"min_lr={self.min_lr}")
        for name in ("weight_decay", "grad_clip", "z_loss", "sample_temperature", "peak_flops",
                     "moe_balance_loss", "moe_z_loss", "lora_alpha", "moe_bias_update_rate"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("b1", "b2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if not self.eps > 0 or not self.run_dir:
            raise ValueError(f"need eps > 0 and a run_dir, got {self.eps}, {self.run_dir!r}")
        for mesh in (self.mesh, self.dcn_mesh):  # raises ValueError naming a bad mesh
            sharding_lib.MeshConfig.parse(mesh)
        if self.lora_base_dtype and self.lora_base_dtype not in DTYPES:
            raise ValueError(f"lora_base_dtype must be one of {DTYPES} or empty, got "
                             f"{self.lora_base_dtype!r}")
        check_base_quant(self.lora_base_quant, self.lora_rank, self.lora_base_dtype)
        if self.quant not in QUANT_SCHEMES:
            raise ValueError(f"quant must be one of {QUANT_SCHEMES[1:]} or empty, got "
                             f"{self.quant!r}")
        try:  # the targets are checked even while lora_rank=0 leaves them unused
            LoraConfig(rank=1, alpha=1.0, targets=self.lora_targets)
        except ValueError as e:
            raise ValueError(f"lora_targets={self.lora_targets!r}: {e}") from None
        parse_eval_sets(self.eval_sets)  # the syntax; the files are read with the tokenizer
        profile = self.profile_range  # raises ValueError naming a bad range
        if profile is not None and profile[1] > self.steps:
            raise ValueError(f"profile_steps={self.profile_steps!r} ends after the last step "
                             f"({self.steps})")

    @property
    def profile_range(self) -> tuple[int, int] | None:
        """``(START, STOP)`` of ``profile_steps`` (1-based, inclusive), or None when off."""
        if not self.profile_steps.strip():
            return None
        try:
            start, stop = (int(p) for p in self.profile_steps.split(","))
        except ValueError:
            raise ValueError(f"profile_steps must be 'START,STOP' (two step numbers), got "
                             f"{self.profile_steps!r}") from None
        if not 1 <= start <= stop:
            raise ValueError(f"profile_steps needs 1 <= START <= STOP, got "
                             f"{self.profile_steps!r}")
        return start, stop

    @property
    def lora_config(self) -> LoraConfig | None:
        """The ``LoraConfig`` of ``lora_rank``/``lora_alpha``/``lora_targets``; None when 0."""
        if not self.lora_rank:
            return None
        return LoraConfig(rank=self.lora_rank, alpha=self.lora_alpha or 2.0 * self.lora_rank,
                          targets=self.lora_targets)

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
        corpus, the Python standard library's sources. Only ``.jsonl`` files: instruction data
        (``data.instruct``), the loss on the completions only. ``.jsonl`` and text files
        together are an error.
      tokenizer: ``"bpe"``, ``"unigram"`` or ``"char"`` to train a SentencePiece model on the
        corpus (cached), or a tokenizer file to load (which overrides ``train.init_from``'s).
      vocab_size: size of a trained bpe/unigram vocabulary; 0 means the model's ``vocab_size``.
        The model's ``vocab_size`` is always set to the tokenizer's.
      val_fraction: the fraction held out for validation: the last tokens, or (``.jsonl``)
        packed rows chosen by a fixed permutation.
      cache_dir: where trained tokenizers and token files are cached.
      max_bytes: cap on the size of the default corpus.
      packing: how shard builds (``python -m transformer_jax.data build``) become rows: ``pack``
        (documents packed with segment ids) or ``concat`` (random windows across documents);
        ``auto`` is ``pack`` for shards and ``concat`` otherwise.
      mixture: ``name=DIR:weight,...`` shard builds sampled by relative weight (``DIR1+DIR2``
        joins builds into one source); the validation loss is the sources' weighted mean.
        Excludes ``path``.
    """

    path: str = ""
    tokenizer: str = "bpe"
    vocab_size: int = 0
    val_fraction: float = 0.05
    cache_dir: str = "~/.cache/transformer_jax"
    max_bytes: int = corpus.DEFAULT_CORPUS_MAX_BYTES
    packing: str = "auto"
    mixture: str = ""

    def __post_init__(self) -> None:
        if self.packing not in ("auto", "pack", "concat"):
            raise ValueError(f"packing must be one of auto, pack, concat, got {self.packing!r}")
        if self.mixture and self.path:
            raise ValueError(f"data.mixture={self.mixture!r} and data.path={self.path!r}: give "
                             "one (a mixture names its own builds)")
        if self.mixture:  # its syntax and weights, now (no file is read)
            from transformer_jax.data.shards import Mixture

            Mixture.parse("", self.mixture)
        _check_int("vocab_size", self.vocab_size, minimum=0)
        _check_int("max_bytes", self.max_bytes, minimum=1)
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"val_fraction must be in [0, 1), got {self.val_fraction}")
        if not self.tokenizer:
            raise ValueError(f"tokenizer must be one of {MODEL_TYPES} or a .model path")

    @property
    def patterns(self) -> list[str]:
        return [p.strip() for p in self.path.split(",") if p.strip()]

    @property
    def is_shards(self) -> bool:
        """Whether the data are shard builds: ``mixture``, or ``path`` naming only builds."""
        from transformer_jax.data.shards import is_build

        return bool(self.mixture) or bool(self.patterns) and all(map(is_build, self.patterns))

    @property
    def is_instruct(self) -> bool:
        """Whether ``path`` names instruction data: ``.jsonl`` files only."""
        return bool(self.instruction_files())

    def instruction_files(self) -> list[Path]:
        """The ``.jsonl`` files of ``path`` (resolved, sorted), or ``[]`` for text or shards.

        Raises:
          FileNotFoundError: a path or pattern that matches no file.
          ValueError: ``.jsonl`` and other files together (one of each named).
        """
        if not self.patterns or self.is_shards:
            return []
        files = corpus.resolve_corpus(self.patterns)
        jsonl = [f for f in files if f.suffix.lower() == ".jsonl"]
        text = [f for f in files if f.suffix.lower() != ".jsonl"]
        if jsonl and text:
            raise ValueError(f"data.path={self.path!r} mixes instruction data ({jsonl[0]}"
                             f"{' and more' if len(jsonl) > 1 else ''}) with text "
                             f"({text[0]}{' and more' if len(text) > 1 else ''}); "
                             "give .jsonl files only, or text files only")
        return jsonl


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
      overrides: ``SECTION.KEY=VALUE`` strings, each value parsed as the field's type.

    Returns:
      ``(model_config, train_config, data_config)``.

    Raises:
      ConfigError: an unknown table, section or key (with close matches), a malformed override,
        a wrong type, or a model key that changes ``train.init_from``'s architecture.
      FileNotFoundError: no such config, or ``train.init_from`` checkpoint or weights.

    A preset's ``warmup_steps`` too long for the run, and with ``train.init_from`` a preset's
    ``seq_len`` above the checkpoint's ``max_seq_len``, are fitted (logged).
    """
    try:
        tables = load_toml(config)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {resolve_config_path(config)} is not valid TOML: {e}"
                          ) from None
    if unknown := sorted(set(tables) - set(SECTIONS)):
        raise ConfigError(f"config {config!r} has unknown tables {unknown}; expected "
                          f"{sorted(SECTIONS)}")
    values: dict[str, dict[str, Any]] = {s: dict(tables.get(s, {})) for s in SECTIONS}
    preset = {s: dict(values[s]) for s in SECTIONS}  # the keys the config file alone sets
    given: set[str] = set()  # SECTION.KEY set on the command line
    for item in overrides:
        section, key, text = _split_override(item)
        preset[section].pop(key, None)
        given.add(f"{section}.{key}")
        try:
            check_keys({key: None}, SECTIONS[section], section)
            values[section][key] = parse_override(SECTIONS[section], key, text)
        except ValueError as e:
            raise ConfigError(f"override {item!r}: {e}") from None
    _fit_preset_warmup(config, preset["train"], values["train"])
    try:
        train = config_from_dict(TrainConfig, values["train"], "train")
        data = config_from_dict(DataConfig, values["data"], "data")
        if train.init_from:
            source = locate(train.init_from, where=f"train.init_from={train.init_from}")
            model = init_model_config(source, values["model"],
                                      preset_keys=frozenset(preset["model"]))
            train = _fit_seq_len(config, train, model, given="train.seq_len" in given)
        else:
            model = ModelConfig.from_dict(values["model"])
    except (TypeError, ValueError, CheckpointError) as e:
        raise ConfigError(f"config {config!r}: {e}") from None
    return model, train, data


def _fit_seq_len(config: str, train: TrainConfig, model: ModelConfig, given: bool) -> TrainConfig:
    """``train`` with a seq_len the checkpoint's model can take (see ``build_configs``)."""
    if train.seq_len <= model.max_seq_len:
        return train
    if given:
        raise ValueError(f"train.seq_len={train.seq_len} is above the model's max_seq_len="
                         f"{model.max_seq_len} (train.init_from={train.init_from})")
    logger.info("config %r: its seq_len=%d is above the max_seq_len=%d of train.init_from=%s; "
                "training on %d tokens per sequence instead (train.seq_len= sets it)", config,
                train.seq_len, model.max_seq_len, train.init_from, model.max_seq_len)
    return dataclasses.replace(train, seq_len=model.max_seq_len)


def _fit_preset_warmup(config: str, preset: dict[str, Any], train: dict[str, Any]) -> None:
    warmup = preset.get("warmup_steps")
    steps, decay = train.get("steps", TrainConfig.steps), train.get("decay_steps", 0)
    if not all(isinstance(v, int) for v in (warmup, steps, decay)) or warmup < 0:
        return  # not from the preset (overridden), or TrainConfig names the bad value
    length = decay or steps
    if warmup >= length:
        logger.info("config %r: its warmup_steps=%d does not fit a decay length of %d; warming "
                    "up for %d steps instead (train.warmup_steps= sets it)", config, warmup,
                    length, auto_warmup_steps(length))
        train["warmup_steps"] = -1


def config_help(width: int = 100) -> str:
    """Every ``model.``, ``train.`` and ``data.`` key with its type, default and meaning."""
    return help_text(SECTIONS, width)


def _split_override(item: str) -> tuple[str, str, str]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form section.key=value")
    name, text = (part.strip() for part in item.split("=", 1))
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
    return section, key, text


def _check_int(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {plain(value)!r}")
