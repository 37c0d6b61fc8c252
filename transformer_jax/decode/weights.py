"""The weights of a decode, prepared once: ``prepare`` and the layouts and shardings behind it.

``prepare`` puts the blocks in the config's layer layout, casts the matrices to the compute
dtype, lays them out for the target platform (on CPU ``OutFirst`` matrices, and a mixture's
experts as ``ExpertList``s), optionally quantises them (``model.quant``) and places them on a
mesh by training's logical-axis rules (``weight_specs``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from transformer_jax.decode.prompts import is_int
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.layers import EMBEDDING_PARAM, MATRIX_INPUT_AXES, is_vector_param
from transformer_jax.model.moe import CORRECTION_BIAS
from transformer_jax.model.ops import target
from transformer_jax.model.ops.layouts import OutFirst, out_first_order
from transformer_jax.model.ops.moe import ExpertList
from transformer_jax.model.ops.quantized import is_quantized
from transformer_jax.model.quant_spec import is_expert_stack
from transformer_jax.model.stack import is_scanned_key
from transformer_jax.model.transformer import (
    abstract_params,
    is_scanned,
    stack_blocks,
    unstack_blocks,
)
from transformer_jax.parallel import sharding

Params = dict[str, Any]

#: The mesh axis a tensor-parallel decode splits the model over (as in training).
TENSOR_AXIS = "tensor"
#: The mesh axis an expert-parallel decode splits a mixture's experts over (as in training).
EXPERT_AXIS = "expert"


@flax.struct.dataclass
class DecodeWeights:
    """A model's weights prepared once for generation (``prepare``).

    Attributes:
      params: the parameters in the decode layout (``decode_params``), placed on the mesh.
      config: the config they were prepared for (static).
      mesh: the mesh they are placed on, or None (static).
      out_first: static; every matrix is an ``ops.layouts.OutFirst`` leaf (a CPU target).
      quant: static; how the matrices are quantised (``quant.WeightQuant``), or None (float).
      experts_split: static; a mixture's expert stacks are ``ExpertList``s (``split_experts``).
    """

    params: Params
    config: ModelConfig = flax.struct.field(pytree_node=False)
    mesh: Mesh | None = flax.struct.field(pytree_node=False, default=None)
    out_first: bool = flax.struct.field(pytree_node=False, default=False)
    quant: Any = flax.struct.field(pytree_node=False, default=None)
    experts_split: bool = flax.struct.field(pytree_node=False, default=False)

    @property
    def nbytes(self) -> int:
        """Bytes of all the prepared weights, summed over their shards (scales included)."""
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self.params))

    @property
    def specs(self) -> Params:
        """``weight_specs`` of these weights over their mesh (which must be set)."""
        return weight_specs(self.config, self.mesh, self.out_first, self.quant,
                            self.experts_split)

    def check_for(self, config: ModelConfig, mesh: Mesh | None, caller: str,
                  quant: Any = None) -> Mesh | None:
        """The mesh to run these weights on, for a ``caller`` given ``config``, ``mesh`` and
        ``quant`` (None: theirs).

        Raises:
          ValueError: they were prepared for another config, mesh or quantisation.
        """
        asked = None if quant is None else _parse_quant(config, quant, tensor_shards(self.mesh))
        if asked is not None and asked != self.quant:
            have = "float" if self.quant is None else self.quant.name
            raise ValueError(f"the DecodeWeights given to {caller} are {have}, not quant="
                             f"{quant!r}; prepare them with that quant, or pass quant=None")
        if self.config != config:
            raise ValueError("the DecodeWeights were prepared for a different config than the "
                             f"one given to {caller}")
        if mesh is not None and mesh != self.mesh:
            raise ValueError("the DecodeWeights were prepared for another mesh; prepare them "
                             "with this one, or pass mesh=None to use theirs")
        return self.mesh


def decode_config(config: ModelConfig) -> ModelConfig:
    """The config generation runs the model with: no rematerialisation (no backward pass)."""
    return config.replace(remat="none")


def target_platform(mesh: Mesh | None = None) -> str:
    """The platform a decode runs on: the mesh's devices', else the target (``ops.target``)."""
    return target.of_mesh(mesh) or target.platform()


def out_first_for(platform: str) -> bool:
    """Whether ``prepare`` stores the matrices output axes first: on CPU (``ops.dense``)."""
    return platform == "cpu"


def default_experts_split(config: ModelConfig, platform: str | None = None) -> bool:
    """Whether ``prepare`` stores a mixture's experts as ``ExpertList``s by default: on CPU."""
    return config.moe is not None and (platform or target.platform()) == "cpu"


def split_experts(tree: Params, n_experts: int, take: Callable[[Any, int, int], Any]
                  ) -> Params:
    """``tree`` (weights, or their shardings) with each expert stack (float or quantised)
    replaced by an ``ExpertList`` of its experts e < E, each of ``take(leaf, axis, e)`` of
    every leaf (``axis``: the stack's E axis)."""
    def one(path: tuple[Any, ...], x: Any) -> Any:
        if not is_expert_stack(path):
            return x
        axis = 1 if is_scanned_key(str(path[0].key)) else 0
        return ExpertList(tuple(jax.tree.map(lambda leaf, e=e: take(leaf, axis, e), x)
                                for e in range(n_experts)))

    return jax.tree_util.tree_map_with_path(
        one, tree, is_leaf=lambda x: is_quantized(x) or isinstance(x, NamedSharding))


def decode_params(config: ModelConfig, params: Params, out_first: bool | None = None
                  ) -> Params:
    """The parameter transform ``prepare`` computes: the blocks in the config's layout (from
    either layout), every matrix cast to the compute dtype (norm scales and correction biases
    keep theirs) and, with ``out_first`` (default ``out_first_for`` the default backend),
    stored output axes first (``out_first_layout``)."""
    if out_first is None:
        out_first = out_first_for(target.platform())
    if config.scan_layers and not is_scanned(params):
        params = stack_blocks(params, config)
    elif not config.scan_layers and is_scanned(params):
        params = unstack_blocks(params)

    def prepare_leaf(path: tuple[Any, ...], x: jax.Array) -> jax.Array:
        name = str(path[-1].key)
        # norms and a router's correction bias compute in float32: they keep their dtype
        if is_vector_param(name) and "norm" in str(path[-2].key) or name == CORRECTION_BIAS:
            return x
        return x.astype(config.jnp_dtype)

    params = jax.tree_util.tree_map_with_path(prepare_leaf, params)
    return out_first_layout(config, params, jnp.transpose) if out_first else params


def _permuted(s: NamedSharding, order: Sequence[int]) -> NamedSharding:
    """``s`` with its spec's entries in ``order`` (an axis left out of it: dropped)."""
    return NamedSharding(s.mesh, P(*(tuple(s.spec)[i] for i in order)))


def out_first_layout(config: ModelConfig, tree: Params,
                     permute: Callable[[Any, tuple[int, ...]], Any]) -> Params:
    """``tree`` (weights, or their shardings) with every matrix an ``OutFirst`` leaf of
    ``permute(leaf, order)`` (``ops.layouts.out_first_order``), and a tied [V, D] token table
    the head's ``OutFirst`` as it is; expert stacks stay in-first (``model.moe``)."""
    def one(path: tuple[Any, ...], x: Any) -> Any:
        name = str(path[-1].key)
        if name == EMBEDDING_PARAM and config.tie_embeddings:
            return OutFirst(x)
        if name not in MATRIX_INPUT_AXES or is_expert_stack(path):
            return x
        # A sharding's spec has an entry per axis (``sharding.param_shardings``).
        rank = len(x.spec) if isinstance(x, NamedSharding) else x.ndim
        lead = int(is_scanned_key(str(path[0].key)))
        return OutFirst(permute(x, out_first_order(rank, MATRIX_INPUT_AXES[name], lead)))

    return jax.tree_util.tree_map_with_path(
        one, tree, is_leaf=lambda x: isinstance(x, NamedSharding))


def prepare(config: ModelConfig, params: Params, mesh: Mesh | None = None, *,
            platform: str | None = None, quant: Any = None,
            experts_split: bool | None = None) -> DecodeWeights:
    """Prepares ``params`` for generation once (``decode_params``, placed on ``mesh``).

    Args:
      config, params: the model's config and parameters (either layout, on any device).
      mesh: optional mesh with a ``"tensor"`` axis, and for a mixture an ``"expert"`` axis
        (other axes of size 1): each device holds its block of every matrix and its E/X experts.
      platform: the platform the decode targets (it picks the layouts); default
        ``target_platform(mesh)``.
      quant: None (float weights), ``"int8"``, ``"int4"``, ``"int4:G"`` or a
        ``quant.WeightQuant``: store the matrices and token table quantised.
      experts_split: store a mixture's expert stacks as ``ExpertList``s; default
        ``default_experts_split(config, platform)``.

    Returns:
      The ``DecodeWeights``; pass them to ``generation.generate`` in place of ``params``.

    Raises:
      ValueError: for a mesh the config cannot be split over, an unknown quantisation scheme
        or an int4 group size that does not divide a width.
    """
    shards = tensor_shards(mesh)
    check_tensor_parallel(config, shards, expert_shards(mesh))
    quant = _parse_quant(config, quant, shards)
    platform = platform or target_platform(mesh)
    out_first = out_first_for(platform)
    # over an expert axis one stack spans the mesh: a per-expert array could not be split
    split = _experts_split(config, experts_split, platform) and expert_shards(mesh) == 1
    return DecodeWeights(_prepare_fn(config, mesh, out_first, quant, split)(params),
                         config, mesh, out_first, quant, split)


def _experts_split(config: ModelConfig, experts_split: bool | None, platform: str) -> bool:
    if experts_split is None:
        return default_experts_split(config, platform)
    return bool(experts_split) and config.moe is not None


def _parse_quant(config: ModelConfig, quant: Any, shards: int) -> Any:
    """``quant.parse_quant`` and ``for_model`` (qwix imported only when quantising)."""
    if quant is None:
        return None
    from transformer_jax.model import quant as quantization

    return quantization.for_model(config, quantization.parse_quant(quant), shards)


def abstract_weights(config: ModelConfig, platform: str | None = None,
                     quant: Any = None, experts_split: bool | None = None) -> DecodeWeights:
    """``prepare``'s result for a ``platform`` target (default: the default backend) as
    ``jax.ShapeDtypeStruct``s, without allocating (to compile ``generate_padded`` from shapes)."""
    platform = platform or target_platform()
    out_first = out_first_for(platform)
    quant = _parse_quant(config, quant, 1)
    split = _experts_split(config, experts_split, platform)
    params = jax.eval_shape(_weights_fn(config, out_first, quant, split),
                            abstract_params(config))
    return DecodeWeights(params, config, None, out_first, quant, split)


def _weights_fn(config: ModelConfig, out_first: bool, quant: Any,
                experts_split: bool = False) -> Callable[[Params], Params]:
    """``decode_params``, then the quantisation ``quant`` asks for, then ``split_experts``."""
    def fn(params: Params) -> Params:
        params = decode_params(config, params, out_first)
        if quant is not None:
            from transformer_jax.model.quant import quantize_params

            params = quantize_params(params, quant)
        if experts_split:
            params = split_experts(params, config.moe.n_experts, lambda a, axis, e:
                                   jax.lax.index_in_dim(a, e, axis, keepdims=False))
        return params

    return fn


@functools.lru_cache(maxsize=32)
def _prepare_fn(config: ModelConfig, mesh: Mesh | None, out_first: bool,
                quant: Any = None, experts_split: bool = False) -> Callable[[Params], Params]:
    """``decode_params`` (and ``quant``, ``split_experts``) jitted for one config, its outputs
    placed on the mesh by the rules."""
    fn = _weights_fn(config, out_first, quant, experts_split)
    if mesh is None:
        return jax.jit(fn)
    return jax.jit(fn, out_shardings=weight_shardings(config, mesh, out_first, quant,
                                                       experts_split))


def weight_shardings(config: ModelConfig, mesh: Mesh, out_first: bool,
                      quant: Any = None, experts_split: bool = False) -> Params:
    """The ``NamedSharding`` of every prepared weight over ``mesh`` (``weight_specs``)."""
    shardings = sharding.param_shardings(decode_config(config), mesh,
                                         decode_rules(config, mesh))
    if out_first:
        shardings = out_first_layout(config, shardings, _permuted)
    if quant is not None:
        from transformer_jax.model.quant import quantized_shardings

        shapes = jax.eval_shape(_weights_fn(config, out_first, quant),
                                abstract_params(config))
        shardings = quantized_shardings(shardings, shapes)
    if experts_split:
        shardings = split_experts(shardings, config.moe.n_experts, lambda s, axis, e:
                                  _permuted(s, [i for i in range(len(s.spec)) if i != axis]))
    return shardings


#: The decode's rules for a mixture's axes: the experts' F split over the tensor axis as the
#: dense FFN's is, every expert on every device (``decode_rules``: E over an expert axis).
EXPERT_RULES = (("experts", None), ("expert_embed", None), ("expert_mlp", TENSOR_AXIS),
                ("router", None))


def decode_rules(config: ModelConfig, mesh: Mesh | None) -> tuple:
    """The training's logical-axis rules, the vocabulary kept whole when the tensor axis does
    not divide it, and a mixture's axes as ``EXPERT_RULES`` says (E over an expert axis)."""
    ours = dict(EXPERT_RULES)
    if expert_shards(mesh) > 1:
        ours["experts"] = EXPERT_AXIS
    if config.vocab_size % tensor_shards(mesh):  # T does not divide V
        ours["vocab"] = None
    rules = tuple((name, ours.get(name, axes)) for name, axes in sharding.LOGICAL_RULES)
    have = {name for name, _ in rules}
    return rules + tuple((name, axes) for name, axes in EXPERT_RULES if name not in have)


def weight_specs(config: ModelConfig, mesh: Mesh, out_first: bool | None = None,
                 quant: Any = None, experts_split: bool = False) -> Params:
    """The ``PartitionSpec`` of every prepared weight over ``mesh`` (``decode_rules``), as
    ``prepare`` places them (``quant``: a parsed ``WeightQuant``)."""
    if out_first is None:
        out_first = out_first_for(target_platform(mesh))
    return jax.tree.map(lambda s: s.spec, weight_shardings(config, mesh, out_first,
                                                            quant, experts_split))


def has_expert_lists(params: Params) -> bool:
    """Whether ``params`` (arrays or tracers) hold ``ExpertList``s (``split_experts``)."""
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, ExpertList))
    return any(isinstance(x, ExpertList) for x in leaves)


def tensor_shards(mesh: Mesh | None) -> int:
    """T, the size of ``mesh``'s tensor axis (1 without a mesh).

    Raises:
      ValueError: if the mesh has no ``TENSOR_AXIS`` or another axis larger than 1.
    """
    if mesh is None:
        return 1
    sizes = dict(mesh.shape)
    if TENSOR_AXIS not in sizes:
        raise ValueError(f"decode needs a mesh with a '{TENSOR_AXIS}' axis, got axes "
                         f"{tuple(sizes)}")
    others = {k: v for k, v in sizes.items() if k not in (TENSOR_AXIS, EXPERT_AXIS) and v > 1}
    if others:
        raise ValueError(f"decode splits the model over the '{TENSOR_AXIS}' axis (and a "
                         f"mixture's experts over '{EXPERT_AXIS}') only; the other mesh axes "
                         f"must have size 1, got {others}")
    return sizes[TENSOR_AXIS]


def expert_shards(mesh: Mesh | None) -> int:
    """X, the size of ``mesh``'s expert axis (1 without a mesh or without that axis)."""
    return 1 if mesh is None else dict(mesh.shape).get(EXPERT_AXIS, 1)


def is_split(mesh: Mesh | None) -> bool:
    """Whether a decode over ``mesh`` is split over several devices (T > 1 or X > 1)."""
    return tensor_shards(mesh) > 1 or expert_shards(mesh) > 1


def check_tensor_parallel(config: ModelConfig, shards: int, experts: int = 1) -> None:
    """Raises ValueError unless T = ``shards`` divides the kv heads, query heads and FFN widths,
    and X = ``experts`` is 1 or divides a mixture's experts."""
    c = config
    if not is_int(shards) or shards < 1:
        raise ValueError(f"the tensor axis size must be a positive int, got {shards!r}")
    if not is_int(experts) or experts < 1:
        raise ValueError(f"the expert axis size must be a positive int, got {experts!r}")
    if experts > 1 and c.moe is None:
        raise ValueError(f"an expert axis of {experts} devices splits a mixture's experts; "
                         "this model has no moe layers (use the tensor axis)")
    if experts > 1 and c.moe.n_experts % experts:
        raise ValueError(f"expert-parallel decode over {experts} devices needs moe.n_experts "
                         f"divisible by {experts}; got moe.n_experts={c.moe.n_experts}")
    widths = [("n_kv_heads", c.n_kv_heads), ("n_heads", c.n_heads), ("d_ff", c.d_ff)]
    if c.moe is not None:
        widths += [("moe.d_ff", c.moe.d_ff), ("moe.shared_d_ff", c.moe.shared_d_ff)]
    bad = [f"{name}={value}" for name, value in widths if value % shards]
    if bad:
        names = ", ".join(name for name, _ in widths)
        raise ValueError(f"tensor-parallel decode over {shards} shards needs each of {names} "
                         f"divisible by {shards}; got {', '.join(bad)}")


def has_out_first(params: Params) -> bool:
    """Whether ``params`` (arrays or tracers) hold ``OutFirst`` matrices (``out_first_layout``)."""
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, OutFirst))
    return any(isinstance(x, OutFirst) for x in leaves)
