"""The weights of a decode, prepared once: ``prepare`` and the layouts and shardings behind it.

``prepare`` is the one parameter transform in front of the forward (``decode/loop.py``): it puts the
blocks in the config's layer layout, casts the matrices to the compute dtype once (so no step
re-casts them), lays them out for the backend (``weights_out_first`` on CPU, see ``ops.dense``:
a property of the prepared weights, which the forward is told, not a model setting) and places
them on a mesh by the same logical-axis rules as training (``sharding.param_shardings``). With a
``tensor`` axis of T devices each device holds its block of every matrix (``weight_specs``:
N/T heads, K/T kv heads, F/T FFN units, V/T vocabulary rows when T divides V).

With ``quant`` the matrices and the token table are stored quantised (``model.quant``:
int8 per output channel, int4 in groups, through qwix): values and scales only, which the same
forward computes with.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
from jax.sharding import Mesh

from transformer_jax.decode.prompts import is_int
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.layers import MATRIX_INPUT_AXES, is_vector_param, to_out_first
from transformer_jax.model.quant_spec import is_expert_stack
from transformer_jax.model.transformer import abstract_params, stack_blocks, unstack_blocks
from transformer_jax.parallel import sharding

Params = dict[str, Any]

#: The mesh axis a tensor-parallel decode splits the model over (as in training).
TENSOR_AXIS = "tensor"


@flax.struct.dataclass
class DecodeWeights:
    """A model's weights prepared once for generation (``prepare``).

    Attributes:
      params: the parameters in the config's layer layout, matrices in the compute dtype,
        placed on the mesh by the logical-axis rules when there is one.
      config: the config they were prepared for (static).
      mesh: the mesh they are placed on, or None (static).
      weights_out_first: static; every matrix is stored output axes first (``layers.matrix``).
      quant: static; how the matrices are quantised (``quant.WeightQuant``), or None (float).
    """

    params: Params
    config: ModelConfig = flax.struct.field(pytree_node=False)
    mesh: Mesh | None = flax.struct.field(pytree_node=False, default=None)
    weights_out_first: bool = flax.struct.field(pytree_node=False, default=False)
    quant: Any = flax.struct.field(pytree_node=False, default=None)

    @property
    def nbytes(self) -> int:
        """Bytes of all the prepared weights (summed over their shards), quantised values and
        scales included."""
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self.params))

    def check_for(self, config: ModelConfig, mesh: Mesh | None, caller: str,
                  quant: Any = None) -> Mesh | None:
        """The mesh to run these weights on, for a ``caller`` given ``config`` and ``mesh``
        (None: theirs) and ``quant`` (None: theirs).

        Raises:
          ValueError: they were prepared for another config, another mesh or another
            quantisation.
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
    """The config generation runs the model with: the same forward, without rematerialisation
    (there is no backward pass to save memory for)."""
    return config.replace(remat="none")


def default_weights_out_first() -> bool:
    """The matrix layout ``prepare`` gives by default: output axes first on the CPU backend,
    where decode steps measured faster that way (``ops.dense``); in-first elsewhere."""
    return jax.default_backend() == "cpu"


def decode_params(config: ModelConfig, params: Params, weights_out_first: bool | None = None
                  ) -> Params:
    """The parameter transform in front of the decode: what ``prepare`` computes.

    The blocks are put in the config's layout (``blocks`` stacked when ``scan_layers``, else
    ``blocks_{i}``), whichever layout ``params`` has, every matrix is cast to the compute dtype
    (so no step converts a weight again; norm scales keep their dtype) and, with
    ``weights_out_first`` (default ``default_weights_out_first()``), transposed to be stored
    output axes first (``layers.to_out_first``). A mixture's router and shared expert follow
    the layout; its experts' [E, D, F] / [E, F, D] stacks are cast and kept in-first.
    """
    out_first = default_weights_out_first() if weights_out_first is None else weights_out_first
    if config.scan_layers and "blocks" not in params:
        params = stack_blocks(params, config.n_layers)
    elif not config.scan_layers and "blocks" in params:
        params = unstack_blocks(params)

    def prepare_leaf(path: tuple[Any, ...], x: jax.Array) -> jax.Array:
        name = str(path[-1].key)
        # Norm gains/shifts keep their dtype (norms compute in float32); the rest is cast.
        if is_vector_param(name) and "norm" in str(path[-2].key):
            return x
        x = x.astype(config.jnp_dtype)
        # The experts' [E, ...] stacks stay in-first in every layout (``model.moe``).
        if out_first and name in MATRIX_INPUT_AXES and not is_expert_stack(path):
            x = to_out_first(x, name, stacked=str(path[0].key) == "blocks")
        return x

    return jax.tree_util.tree_map_with_path(prepare_leaf, params)


def prepare(config: ModelConfig, params: Params, mesh: Mesh | None = None, *,
            weights_out_first: bool | None = None, quant: Any = None) -> DecodeWeights:
    """Prepares ``params`` for generation once (``decode_params``, placed on ``mesh``).

    Args:
      config: the model's config.
      params: the model's parameters (scanned or unrolled layout), on any device.
      mesh: optional mesh with a ``"tensor"`` axis (other axes of size 1): each device then
        holds its block of every matrix, split by the logical-axis rules.
      weights_out_first: the matrix layout; default ``default_weights_out_first()``.
      quant: None (float weights), ``"int8"``, ``"int4"``, ``"int4:G"`` or a
        ``quant.WeightQuant``: store the matrices and token table quantised.

    Returns:
      The ``DecodeWeights``; pass them to ``generation.generate`` in place of ``params``.

    Raises:
      ValueError: for a mesh the config cannot be split over (``check_tensor_parallel``), an
        unknown quantisation scheme or an int4 group size that does not divide a width.
    """
    shards = tensor_shards(mesh)
    check_tensor_parallel(config, shards)
    quant = _parse_quant(config, quant, shards)
    if weights_out_first is None:
        weights_out_first = default_weights_out_first()
    return DecodeWeights(_prepare_fn(config, mesh, weights_out_first, quant)(params), config,
                         mesh, weights_out_first, quant)


def _parse_quant(config: ModelConfig, quant: Any, shards: int) -> Any:
    """``quant.parse_quant`` and ``for_model`` (qwix imported only when quantising)."""
    if quant is None:
        return None
    from transformer_jax.model import quant as quantization

    return quantization.for_model(config, quantization.parse_quant(quant), shards)


def abstract_weights(config: ModelConfig, weights_out_first: bool | None = None,
                     quant: Any = None) -> DecodeWeights:
    """``prepare``'s result as ``jax.ShapeDtypeStruct``s, without allocating anything (to lower
    and compile ``generate_padded`` from shapes alone)."""
    if weights_out_first is None:
        weights_out_first = default_weights_out_first()
    quant = _parse_quant(config, quant, 1)
    params = jax.eval_shape(_weights_fn(config, weights_out_first, quant),
                            abstract_params(config))
    return DecodeWeights(params, config, None, weights_out_first, quant)


def _weights_fn(config: ModelConfig, weights_out_first: bool, quant: Any
                ) -> Callable[[Params], Params]:
    """``decode_params``, then the quantisation ``quant`` asks for."""
    fn = functools.partial(decode_params, config, weights_out_first=weights_out_first)
    if quant is None:
        return fn
    from transformer_jax.model.quant import quantize_params

    return lambda params: quantize_params(fn(params), quant, out_first=weights_out_first)


@functools.lru_cache(maxsize=32)
def _prepare_fn(config: ModelConfig, mesh: Mesh | None, weights_out_first: bool,
                quant: Any = None) -> Callable[[Params], Params]:
    """``decode_params`` (and ``quant``) jitted for one config, its outputs placed on the mesh
    by the rules."""
    fn = _weights_fn(config, weights_out_first, quant)
    if mesh is None:
        return jax.jit(fn)
    return jax.jit(fn, out_shardings=_weight_shardings(config, mesh, weights_out_first, quant))


def _weight_shardings(config: ModelConfig, mesh: Mesh, weights_out_first: bool,
                      quant: Any = None) -> Params:
    float_shardings = sharding.param_shardings(decode_config(config), mesh,
                                               decode_rules(config, mesh),
                                               weights_out_first=weights_out_first)
    if quant is None:
        return float_shardings
    from transformer_jax.model.quant import quantized_shardings

    shapes = jax.eval_shape(_weights_fn(config, weights_out_first, quant),
                            abstract_params(config))
    return quantized_shardings(float_shardings, shapes)


#: The decode's rules for a mixture's axes: the experts' F split over the tensor axis as the
#: dense FFN's is (gate/up [E, D, F/T], down [E, F/T, D]), every expert on every device, the
#: router replicated. (Training may split E over an expert axis; a decode mesh has only
#: ``tensor``.)
EXPERT_RULES = (("experts", None), ("expert_embed", None), ("expert_mlp", TENSOR_AXIS),
                ("router", None))


def decode_rules(config: ModelConfig, mesh: Mesh | None) -> tuple:
    """The training's logical-axis rules, with the vocabulary kept whole on every device when
    the tensor axis does not divide it (the embedding and head are then replicated), and a
    mixture's axes split as ``EXPERT_RULES`` says."""
    ours = dict(EXPERT_RULES)
    if not vocab_is_split(config, mesh):
        ours["vocab"] = None
    rules = tuple((name, ours.get(name, axes)) for name, axes in sharding.LOGICAL_RULES)
    have = {name for name, _ in rules}
    return rules + tuple((name, axes) for name, axes in EXPERT_RULES if name not in have)


def vocab_is_split(config: ModelConfig, mesh: Mesh | None) -> bool:
    """Whether a decode over ``mesh`` splits the vocabulary: when T divides V."""
    return config.vocab_size % tensor_shards(mesh) == 0


def weight_specs(config: ModelConfig, mesh: Mesh, weights_out_first: bool | None = None,
                 quant: Any = None) -> Params:
    """The ``PartitionSpec`` of every prepared weight over ``mesh``: the training's logical-axis
    rules applied to the decode layout (``decode_rules``), as ``prepare`` places them (the
    quantised values and scales with ``quant``, a parsed ``WeightQuant``)."""
    if weights_out_first is None:
        weights_out_first = default_weights_out_first()
    return jax.tree.map(lambda s: s.spec,
                        _weight_shardings(config, mesh, weights_out_first, quant))


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
    others = {k: v for k, v in sizes.items() if k != TENSOR_AXIS and v > 1}
    if others:
        raise ValueError(f"decode splits the model over the '{TENSOR_AXIS}' axis only; the other "
                         f"mesh axes must have size 1, got {others}")
    return sizes[TENSOR_AXIS]


def check_tensor_parallel(config: ModelConfig, shards: int) -> None:
    """Raises ValueError unless T = ``shards`` divides the kv heads, query heads and FFN width
    (and a mixture's expert and shared-expert widths)."""
    c = config
    if not is_int(shards) or shards < 1:
        raise ValueError(f"the tensor axis size must be a positive int, got {shards!r}")
    widths = [("n_kv_heads", c.n_kv_heads), ("n_heads", c.n_heads), ("d_ff", c.d_ff)]
    if c.moe is not None:
        widths += [("moe.d_ff", c.moe.d_ff), ("moe.shared_d_ff", c.moe.shared_d_ff)]
    bad = [f"{name}={value}" for name, value in widths if value % shards]
    if bad:
        names = ", ".join(name for name, _ in widths)
        raise ValueError(f"tensor-parallel decode over {shards} shards needs each of {names} "
                         f"divisible by {shards}; got {', '.join(bad)}")
