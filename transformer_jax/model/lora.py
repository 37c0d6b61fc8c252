"""LoRA: low-rank adapters on the attention and MLP matrices, as pure functions over param trees.

A target matrix W ([in..., out...]) gets A [in..., R] (random) and B [R, out...] (zero):
``W + (alpha / R) * A @ B``; adapters mirror the param tree
(``adapters["blocks_0"]["attn"]["q_proj"]["a"]``) and ``TARGETS`` names the matrices. Train on
``apply_adapters`` (or ``model_params`` and ``optimizer`` of a ``{"base", "adapters"}`` tree);
``merge`` folds the adapters in for export.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import string
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from transformer_jax.model.config import ModelConfig
from transformer_jax.model.fields import check_positive_int
from transformer_jax.model.layers import MATRIX_INPUT_AXES
from transformer_jax.model.ops.quantized import is_quantized
from transformer_jax.model.quant_spec import ACCEPTS, SCHEMES, is_saved_quantized, parse_quant
from transformer_jax.model.stack import block_paths, tree_get, tree_set

logger = logging.getLogger(__name__)

Params = dict[str, Any]
Adapters = dict[str, Any]

#: The training setting of a QLoRA run's base quantisation (in a checkpoint's meta["train"]).
BASE_QUANT_FIELD = "train.lora_base_quant"

#: Keys of a combined ``{"base": ..., "adapters": ...}`` tree.
BASE = "base"
ADAPTERS = "adapters"

#: Target name -> its path (modules, then the param) inside each block.
TARGETS: dict[str, tuple[str, ...]] = {
    "q": ("attn", "q_proj"), "k": ("attn", "k_proj"), "v": ("attn", "v_proj"),
    "o": ("attn", "o_proj"), "gate": ("mlp", "gate"), "up": ("mlp", "up"),
    "down": ("mlp", "down"), "experts.gate": ("moe", "gate"), "experts.up": ("moe", "up"),
    "experts.down": ("moe", "down"), "shared.gate": ("moe", "shared", "gate"),
    "shared.up": ("moe", "shared", "up"), "shared.down": ("moe", "shared", "down"),
    "q_a": ("attn", "q_a_proj"), "q_b": ("attn", "q_b_proj"), "kv_a": ("attn", "kv_a_proj"),
    "kv_b": ("attn", "kv_b_proj"),  # latent attention's (one input axis, unlisted below)
}

#: The targets of a dense model's matrices, the default.
DEFAULT_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


def _input_axes(target: str) -> int:
    """How many input axes the target's matrix has after its batch axes."""
    return MATRIX_INPUT_AXES.get(TARGETS[target][-1], 1)


def _batch_axes(target: str) -> int:
    """Leading axes the adapter keeps per entry: 1 (E) for the experts' stacks, else 0."""
    return int(target.startswith("experts."))


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Which matrices get adapters, and their rank and scale.

    Attributes:
      rank: R, the inner dimension of A [in, R] and B [R, out].
      alpha: the update is scaled by ``alpha / rank``.
      targets: names from ``TARGETS`` (or a comma-separated string); ``DEFAULT_TARGETS``.
    """

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = DEFAULT_TARGETS

    def __post_init__(self) -> None:
        check_positive_int("lora rank", self.rank)
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, int | float) or not (
                self.alpha > 0):
            raise ValueError(f"lora alpha must be a positive number, got {self.alpha!r}")
        targets = tuple([t.strip() for t in self.targets.split(",") if t.strip()]
                        if isinstance(self.targets, str) else self.targets)
        if not targets:
            raise ValueError(f"lora targets must name at least one of {list(TARGETS)}")
        for name in targets:
            if name not in TARGETS:
                close = difflib.get_close_matches(str(name), list(TARGETS), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ValueError(f"unknown lora target {name!r}{hint} (targets: "
                                 f"{', '.join(TARGETS)})")
        if len(set(targets)) != len(targets):
            raise ValueError(f"lora targets repeat a name: {list(targets)}")
        object.__setattr__(self, "targets", targets)

    @property
    def scale(self) -> float:
        """``alpha / rank``, the factor of ``A @ B``."""
        return self.alpha / self.rank

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (a checkpoint's ``meta["lora"]``)."""
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets)}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> LoraConfig:
        """From ``to_dict``'s output; unknown keys are an error."""
        if unknown := sorted(set(values) - {"rank", "alpha", "targets"}):
            raise ValueError(f"unknown lora settings {unknown}; expected rank, alpha, targets")
        return cls(**values)


Block = tuple[str, ...]  # a block's path in the tree (``stack.block_paths``)


def _blocks(params: Mapping[str, Any]) -> list[tuple[Block, bool]]:
    if not (keys := block_paths(params)):
        raise ValueError(f"params have no blocks: keys {sorted(params)}")
    return keys


def _target_param(params: Mapping[str, Any], block: Block, target: str) -> Any:
    node: Any = tree_get(params, block)
    for key in TARGETS[target]:
        try:
            node = node[key]
        except (KeyError, TypeError):
            raise ValueError(f"params lack {'/'.join((*block, *TARGETS[target]))} for lora target "
                             f"{target!r}") from None
    return node


def _applies(params: Mapping[str, Any], block: Block, target: str) -> bool:
    """Whether ``target`` adapts ``block``: the block has the target's module (mlp or moe)."""
    node = tree_get(params, block)
    return isinstance(node, Mapping) and TARGETS[target][0] in node


def _entries(params: Mapping[str, Any], lora_config: LoraConfig) -> list[tuple[Block, bool, str]]:
    """(block, stacked, target) of every adapted matrix.

    Raises:
      ValueError: a target whose module no block has, or a block lacking the target's matrix.
    """
    blocks = _blocks(params)
    entries = [(b, s, t) for b, s in blocks for t in lora_config.targets if _applies(params, b, t)]
    for target in [t for t in lora_config.targets if t not in {t for _, _, t in entries}]:
        if TARGETS[target][0] == "mlp" and any(_applies(params, b, "experts.gate")
                                               for b, _ in blocks):  # every layer sparse
            logger.info("lora target %r: no dense FFN (every layer is a mixture); skipped", target)
            continue
        raise ValueError(f"lora target {target!r} adapts {'/'.join(TARGETS[target])}, which no "
                         "block of the params has (block keys: "
                         f"{sorted(tree_get(params, blocks[0][0]))})")
    return entries


def init_adapters(config: ModelConfig, lora_config: LoraConfig, params: Params,
                  key: jax.Array, dtype: Any = jnp.float32) -> Adapters:
    """Adapters for every target matrix of ``params``: A ~ N(0, 1/fan_in), B = 0.

    Args:
      config: the model (checked against the params' layout).
      lora_config: rank and targets.
      params: the base params, unrolled or scanned (arrays or ``ShapeDtypeStruct``s).
      key: PRNG key for the A factors.
      dtype: dtype of A and B (float32 by default, whatever the base's dtype).

    Returns:
      The adapter tree (its shapes per target: docs/fine-tuning.md, LoRA).
    """
    blocks = _blocks(params)
    if config.scan_layers != blocks[0][1]:
        logger.info("params are %s while config.scan_layers=%s; following the params",
                    "scanned" if blocks[0][1] else "unrolled", config.scan_layers)
    r = lora_config.rank
    entries = _entries(params, lora_config)
    keys = jax.random.split(key, len(entries))
    adapters: Adapters = {}
    for (block, stacked, target), k in zip(entries, keys, strict=True):
        shape = tuple(_target_param(params, block, target).shape)
        lead = shape[:int(stacked) + _batch_axes(target)]
        matrix = shape[len(lead):]
        n_in = _input_axes(target)
        a = jax.random.normal(k, (*lead, *matrix[:n_in], r), dtype) * math.prod(
            matrix[:n_in]) ** -0.5
        b = jnp.zeros((*lead, r, *matrix[n_in:]), dtype)
        adapters = tree_set(adapters, (*block, *TARGETS[target]), {"a": a, "b": b})
    return adapters


def delta(a: jax.Array, b: jax.Array, target: str, stacked: bool, scale: float) -> jax.Array:
    """``scale * A @ B`` in float32, shaped like the target matrix.

    Args:
      a, b: [L?, E?, in..., R] and [L?, E?, R, out...] (E: an experts target's).
      target, stacked: the target name, whether a leading L axis is present.
      scale: ``alpha / rank``.

    Returns:
      [L?, E?, in..., out...] float32.
    """
    n_in = _input_axes(target)
    n_batch = _batch_axes(target)
    n_out = b.ndim - 1 - int(stacked) - n_batch
    letters = "".join(c for c in string.ascii_lowercase if c not in "rle")
    ins, outs = letters[:n_in], letters[n_in:n_in + n_out]
    lead = ("l" if stacked else "") + "e" * n_batch
    spec = f"{lead}{ins}r,{lead}r{outs}->{lead}{ins}{outs}"
    return scale * jnp.einsum(spec, a.astype(jnp.float32), b.astype(jnp.float32),
                              preferred_element_type=jnp.float32)


def _adapted(params: Params, adapters: Adapters, lora_config: LoraConfig, dtype_of: Any) -> Params:
    out = dict(params)
    for block, stacked, target in _entries(params, lora_config):
        path = TARGETS[target]
        where = "/".join((*block, *path))
        w = _target_param(params, block, target)
        try:
            ab = tree_get(adapters, (*block, *path))
        except (KeyError, TypeError):  # a missing block, module or matrix
            raise ValueError(f"adapters lack {where} (lora target {target!r}; they have "
                             f"{sorted(adapters)})") from None
        d = delta(ab["a"], ab["b"], target, stacked, lora_config.scale)
        if d.shape != w.shape:
            raise ValueError(f"adapter {where} gives shape {d.shape}, the param has {w.shape}")
        out = tree_set(out, (*block, *path), (w.astype(jnp.float32) + d).astype(dtype_of(w, ab)))
    return out


def apply_adapters(params: Params, adapters: Adapters, lora_config: LoraConfig) -> Params:
    """The params the model runs with: ``W + (alpha/R) * A @ B`` for every target (pure,
    differentiable in both); an adapted matrix in the wider of the base's and adapters' dtypes.

    Args:
      params, adapters, lora_config: the base params, ``init_adapters``' tree, rank and targets.

    Returns:
      A param tree for ``Transformer(config).apply({"params": ...})``.
    """
    return _adapted(params, adapters, lora_config,
                    lambda w, ab: jnp.promote_types(w.dtype, ab["a"].dtype))


def merge(params: Params, adapters: Adapters, lora_config: LoraConfig, dtype: Any = None) -> Params:
    """Folds the adapters into the weights, for export.

    Args:
      params, adapters, lora_config: as ``apply_adapters`` takes them.
      dtype: of the merged matrices; None keeps each base matrix's (the sum is float32).

    Returns:
      Plain params of the base's structure, ``apply_adapters``'s up to the cast.
    """
    return _adapted(params, adapters, lora_config,
                    lambda w, ab: w.dtype if dtype is None else jnp.dtype(dtype))


def check_base_quant(base_quant: str, rank: int, base_dtype: str) -> None:
    """Raises ValueError for a ``train.lora_base_quant`` (QLoRA) that cannot apply: without
    adapters, beside ``lora_base_dtype``, or not a ``quant_spec.parse_quant`` spelling."""
    if not base_quant:
        return
    if rank == 0:
        raise ValueError(f"lora_base_quant={base_quant!r} quantises a LoRA base: set "
                         "lora_rank > 0")
    if base_dtype:
        raise ValueError("lora_base_quant and lora_base_dtype both store the base: set one")
    if not isinstance(base_quant, str) or base_quant.partition(":")[0] not in SCHEMES:
        # The setting's own message: it also takes "" (no quantisation).
        raise ValueError(f"lora_base_quant must be int8, int4, nf4, int4:G or nf4:G (G an even "
                         f"integer >= 2) or empty, got {base_quant!r}")
    parse_quant(base_quant, field=BASE_QUANT_FIELD)


def freeze_base(params: Params, dtype: Any = jnp.bfloat16) -> Params:
    """The base params cast to ``dtype`` to store them smaller.

    Args:
      params, dtype: the base params, e.g. ``jnp.bfloat16``.

    Returns:
      The same tree with floating-point leaves in ``dtype``.
    """
    return jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)


def model_params(tree: Mapping[str, Any], lora_config: LoraConfig) -> Params:
    """``apply_adapters`` of a combined ``{"base", "adapters"}`` tree, the base not trained."""
    return apply_adapters(jax.lax.stop_gradient(tree[BASE]), tree[ADAPTERS], lora_config)


def trainable_mask(tree: Mapping[str, Any]) -> Any:
    """True for the leaves under ``"adapters"`` of a combined tree, False for the rest."""
    return {k: jax.tree.map(lambda _, k=k: k == ADAPTERS, v) for k, v in tree.items()}


def optimizer(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` on the adapters of a combined ``{"base", "adapters"}`` tree; the base never moves.

    Args:
      tx: the adapters' optimizer (``optax.set_to_zero`` for the base: no moments kept).

    Returns:
      A transformation to ``init`` on the combined tree.
    """
    def labels(tree: Mapping[str, Any]) -> Any:
        return jax.tree.map(lambda trainable: "train" if trainable else "frozen",
                            trainable_mask(tree))

    return optax.multi_transform({"train": tx, "frozen": optax.set_to_zero()}, labels)


def adapter_shardings(adapters: Adapters, params_shardings: Any) -> Any:
    """Shardings of the adapters following their target matrices': A takes the target's sharding
    of its input axes, B that of its output axes; R stays whole.

    Args:
      adapters, params_shardings: the adapters, ``sharding.param_shardings`` of the base params.

    Returns:
      A tree like ``adapters`` with a ``NamedSharding`` per leaf.
    """
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    out: dict[str, Any] = {}
    for block, stacked in _blocks(adapters):
        modules = tree_get(adapters, block)
        for target, path in TARGETS.items():
            try:
                ab = tree_get(modules, path)
            except (KeyError, TypeError):
                continue
            w = tree_get(params_shardings, (*block, *path))
            n_lead = int(stacked) + _batch_axes(target)
            ndim = ab["a"].ndim + ab["b"].ndim - 2 - n_lead  # the target's rank
            spec = tuple(w.spec) + (None,) * (ndim - len(w.spec))
            lead, matrix = spec[:n_lead], spec[n_lead:]
            n_in = _input_axes(target)
            out = tree_set(out, (*block, *path), {
                "a": NamedSharding(w.mesh, P(*lead, *matrix[:n_in], None)),
                "b": NamedSharding(w.mesh, P(*lead, None, *matrix[n_in:]))})
    return out


def adapter_count(adapters: Adapters) -> int:
    """Number of trainable adapter parameters."""
    return sum(int(x.size) for x in jax.tree.leaves(adapters))


__all__ = ["ADAPTERS", "BASE", "BASE_QUANT_FIELD", "DEFAULT_TARGETS", "TARGETS", "LoraConfig",
           "adapter_count", "adapter_shardings", "apply_adapters", "checkpoint_tree", "delta",
           "freeze_base", "init_adapters", "merge", "model_params", "optimizer", "trainable_mask"]


def checkpoint_tree(params: Any, meta: Mapping[str, Any], where: Any) -> Any:
    """A training checkpoint's params as restored without a target tree, with a QLoRA run's
    quantised base rebuilt (``quant.from_saved``) by its ``meta["train"]["lora_base_quant"]``.

    Raises:
      ValueError: a saved quantised base without that setting, or one that does not fit it
        (naming ``where``, the checkpoint directory).
    """
    if not (isinstance(params, Mapping) and set(params) == {BASE, ADAPTERS}):
        return params
    train = meta.get("train")
    spec = train.get("lora_base_quant") if isinstance(train, Mapping) else None
    base = params[BASE]
    if not any(map(is_saved_quantized, jax.tree.leaves(base, is_leaf=is_saved_quantized))):
        return params
    if not spec:
        raise ValueError(f"checkpoint in {where} holds a quantised LoRA base but its meta has "
                         f"no {BASE_QUANT_FIELD} to read it by ({ACCEPTS})")
    from transformer_jax.model.quant import from_saved

    parse_quant(spec, field=f"{BASE_QUANT_FIELD} of the checkpoint in {where}")
    # Training quantises the base as the model stores it: inputs first.
    return {**params, BASE: from_saved(base, spec, where=where)}


def merge_checkpoint_params(params: Any, meta: Mapping[str, Any], where: Any,
                            dtype: Any = None) -> Any:
    """The model's parameters from a training checkpoint's params: a LoRA run's ``{"base",
    "adapters"}`` with ``meta["lora"]`` merged (a quantised base dequantised first), others as
    they are.

    Raises:
      ValueError: ``meta["lora"]`` and the tree disagree, or a quantised base cannot be read.
    """
    is_lora_tree = isinstance(params, Mapping) and set(params) == {BASE, ADAPTERS}
    if not meta.get("lora"):
        if is_lora_tree:
            raise ValueError(f"checkpoint in {where} holds base and adapters but no "
                             "meta['lora'] (rank, alpha, targets) to merge them with")
        return params
    if not is_lora_tree:
        raise ValueError(f"checkpoint in {where} has meta['lora'] but its params are not "
                         f"{{'{BASE}', '{ADAPTERS}'}} (got {sorted(params)})")
    lora_config = LoraConfig.from_dict(meta["lora"])
    logger.info("merging LoRA adapters (rank %d, alpha %g, targets %s)", lora_config.rank,
                lora_config.alpha, ",".join(lora_config.targets))
    base = checkpoint_tree(params, meta, where)[BASE]
    if any(is_quantized(x) for x in jax.tree.leaves(base, is_leaf=is_quantized)):
        from transformer_jax.model.quant import dequantize_params  # a QLoRA run's quantised base

        base = jax.jit(dequantize_params)(base)  # one program, not an op at a time
    return merge(base, params[ADAPTERS], lora_config, dtype=dtype)
