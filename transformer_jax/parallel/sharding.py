"""Logical-axis rules, shardings and sharded jit for data, FSDP, tensor, expert and context
parallelism.

The model only names its parameter axes (embed, heads, ...); ``rules_for`` the mesh maps them
to mesh axes, so changing the parallelism changes the mesh sizes, never the model::

    mesh = make_mesh(MeshConfig(data=-1, fsdp=8))
    p_shard = param_shardings(config, mesh)
    s_shard = state_shardings(jax.eval_shape(init_state, rng), p_shard)
    state = shard_init(init_state, s_shard)(rng)          # created sharded, never whole
    step = jit_train_step(train_step, s_shard, batch_sharding(mesh))
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from transformer_jax.model.config import ModelConfig
from transformer_jax.model.ops import target
from transformer_jax.model.transformer import abstract_params, logical_axes
from transformer_jax.parallel.mesh import (  # noqa: F401 (sharding.make_mesh etc. are the API)
    CONTEXT_MESH_AXES,
    EXPERT_MESH_AXES,
    MESH_AXES,
    MeshConfig,
    configure_cpu_devices,
    make_mesh,
)

T = TypeVar("T")
MeshAxes = str | tuple[str, ...] | None

# Logical axis name -> mesh axes, each name once. The batch splits over both data axes;
# parameters over fsdp along their model width (embed) and over tensor along heads / FFN width /
# vocab (every matmul a Megatron pair: column-split in, row-split out).
LOGICAL_RULES: tuple[tuple[str, MeshAxes], ...] = (
    ("batch", ("data", "fsdp")), ("length", None), ("embed", "fsdp"),
    # Latent attention's low ranks (q_b_proj [Q, N, H], kv_b_proj [R, N, H]) have no embed
    # axis: split as embed is, or an FSDP mesh holds them and their optimizer state whole.
    ("latent_rank", "fsdp"),
    ("heads", "tensor"), ("kv_heads", "tensor"), ("mlp", "tensor"), ("vocab", "tensor"),
    ("head_dim", None), ("layers", None), ("norm", None), ("act_embed", None),
    # A mixture's stacked experts [E, D, F], without an expert axis: all E on every device.
    ("experts", None), ("expert_embed", "fsdp"), ("expert_mlp", "tensor"), ("router", None),
)

# With an ``expert`` axis the experts' E splits over it, and every other layer uses it as more
# FSDP devices (the batch and every non-expert weight's embed axis split over it, as MaxText).
EXPERT_RULES: tuple[tuple[str, MeshAxes], ...] = tuple(
    {**dict(LOGICAL_RULES), "batch": ("data", "fsdp", "expert"), "embed": ("fsdp", "expert"),
     "latent_rank": ("fsdp", "expert"), "experts": "expert"}.items())

# With a ``context`` axis (``parallel.context``) the sequence axis of the batch and every
# activation splits over it, and the weights' embed axis too (context devices act as FSDP).
CONTEXT_RULES: tuple[tuple[str, MeshAxes], ...] = tuple(
    {**dict(LOGICAL_RULES), "length": "context", "embed": ("fsdp", "context"),
     "latent_rank": ("fsdp", "context")}.items())

# Logical axes of the [B, T, D] residual stream between blocks: D stays whole, so that XLA
# gathers the weights (FSDP) rather than the batch.
RESIDUAL_AXES = ("batch", "length", "act_embed")


def rules_for(mesh: Mesh | jax.sharding.AbstractMesh) -> tuple[tuple[str, MeshAxes], ...]:
    """``CONTEXT_RULES`` or ``EXPERT_RULES`` if ``mesh`` has that axis, else ``LOGICAL_RULES``."""
    if "context" in mesh.axis_names:
        return CONTEXT_RULES
    return EXPERT_RULES if "expert" in mesh.axis_names else LOGICAL_RULES


def batch_devices(mesh: Mesh | jax.sharding.AbstractMesh,
                  rules: Sequence[tuple[str, MeshAxes]] | None = None) -> int:
    """How many parts the batch splits into on ``mesh`` (data x fsdp, times expert if any):
    the global batch size must be a multiple of it."""
    spec = logical_to_mesh_spec(("batch",), rules_for(mesh) if rules is None else rules)
    return math.prod(mesh.shape[a] for a in _as_tuple(spec[0]))


def logical_to_mesh_spec(logical: Sequence[str | None],
                         rules: Sequence[tuple[str, MeshAxes]] = LOGICAL_RULES) -> P:
    """Maps a tuple of logical axis names to a ``PartitionSpec`` of mesh axes.

    Args:
      logical: one logical name (or None) per array dimension.
      rules: (logical name, mesh axes) pairs, each logical name once.

    Returns:
      The mesh ``PartitionSpec``.

    Raises:
      ValueError: for a logical name without a rule, or a mesh axis used by two dimensions.
    """
    table = dict(rules)
    out: list[MeshAxes] = []
    used: dict[str, str] = {}
    for name in logical:
        if name is None:
            out.append(None)
            continue
        if name not in table:
            raise ValueError(f"no sharding rule for logical axis {name!r}; rules cover "
                             f"{sorted(table)}")
        axes = table[name]
        for axis in _as_tuple(axes):
            if axis in used:
                raise ValueError(f"mesh axis {axis!r} is used by both logical axes "
                                 f"{used[axis]!r} and {name!r} of {tuple(logical)}")
            used[axis] = name
        out.append(axes)
    return P(*out)


def param_shardings(config: ModelConfig, mesh: Mesh,
                    rules: Sequence[tuple[str, MeshAxes]] | None = None) -> Any:
    """The ``NamedSharding`` of every parameter, from ``model.logical_axes`` and the rules.

    Args:
      config, mesh: the model, and a mesh with (a superset of) the axes the rules name.
      rules: logical -> mesh axis rules (None: ``rules_for(mesh)``).

    Returns:
      A tree shaped like the parameters with a ``NamedSharding`` per leaf.

    Raises:
      ValueError: if a parameter dimension is not divisible by the size of its mesh axes.
    """
    shapes, logical = _param_layout(config)
    rules = rules_for(mesh) if rules is None else rules

    def one(path, spec: P, shape: jax.ShapeDtypeStruct) -> NamedSharding:
        mesh_spec = logical_to_mesh_spec(tuple(spec), rules)
        padded = tuple(mesh_spec) + (None,) * (len(shape.shape) - len(mesh_spec))
        for dim, (size, axes) in enumerate(zip(shape.shape, padded, strict=True)):
            if size % math.prod(mesh.shape[a] for a in _as_tuple(axes)):
                axis_desc = " x ".join(f"{a}={mesh.shape[a]}" for a in _as_tuple(axes))
                raise ValueError(
                    f"parameter {_path_str(path)} dimension {dim} ({spec[dim]}) has size {size}, "
                    f"which is not divisible by mesh axis {axis_desc}; change the mesh or the "
                    "model shape")
        return NamedSharding(mesh, mesh_spec)

    return jax.tree_util.tree_map_with_path(one, logical, shapes,
                                            is_leaf=lambda x: isinstance(x, P))


def batch_sharding(mesh: Mesh, rules: Sequence[tuple[str, MeshAxes]] | None = None
                   ) -> NamedSharding:
    """Sharding of every batch array: B split over (data, fsdp[, expert]), and T too where the
    rules split ``length`` (context parallelism; ``rules`` None: ``rules_for(mesh)``)."""
    rules = rules_for(mesh) if rules is None else rules
    logical = ("batch", "length") if dict(rules).get("length") else ("batch",)
    return NamedSharding(mesh, logical_to_mesh_spec(logical, rules))


def replicated(mesh: Mesh) -> NamedSharding:
    """A fully replicated sharding (scalars, step counters, RNG keys, metrics)."""
    return NamedSharding(mesh, P())


def state_shardings(abstract_state: Any, params_shardings: Any) -> Any:
    """Shardings for a whole train state: a leaf (Adam's moments, ...) whose key path ends with
    a parameter's path, of its rank and splitting evenly like it, gets its sharding; every other
    leaf is replicated.

    Args:
      abstract_state: the state, or its ``jax.eval_shape``.
      params_shardings: ``param_shardings(config, mesh)``.

    Returns:
      A tree shaped like ``abstract_state`` with a ``NamedSharding`` per leaf.
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(params_shardings)
    if not flat:
        raise ValueError("params_shardings is empty")
    mesh = flat[0][1].mesh
    by_path = {_path_keys(path): sharding for path, sharding in flat}

    def one(path, leaf) -> NamedSharding:
        keys = _path_keys(path)
        shape = tuple(np.shape(leaf))
        for start in range(len(keys)):
            sharding = by_path.get(keys[start:])
            if sharding is not None and _fits(sharding, shape):
                return sharding
        return NamedSharding(mesh, P())

    return jax.tree_util.tree_map_with_path(one, abstract_state)


def _fits(sharding: NamedSharding, shape: tuple[int, ...]) -> bool:
    spec = tuple(sharding.spec)
    return len(spec) == len(shape) and all(
        axes is None or size % math.prod(sharding.mesh.shape[a] for a in _as_tuple(axes)) == 0
        for size, axes in zip(shape, spec, strict=True))


def per_device_bytes(abstract_tree: Any, shardings: Any) -> int:
    """Bytes one device holds of a sharded tree (the largest shard of each leaf).

    Args:
      abstract_tree: arrays or ``ShapeDtypeStruct``s.
      shardings: a matching tree (or prefix) of ``Sharding``s.

    Returns:
      Sum over leaves of ``prod(shard_shape) * itemsize``.
    """
    leaves = jax.tree.leaves(abstract_tree)
    # Broadcast a prefix tree of shardings to one sharding per leaf.
    per_leaf = jax.tree.map(lambda s, sub: jax.tree.map(lambda _: s, sub), shardings,
                            abstract_tree, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))
    shards = jax.tree.leaves(per_leaf, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))
    return sum(math.prod(s.shard_shape(tuple(x.shape))) * np.dtype(x.dtype).itemsize
               for x, s in zip(leaves, shards, strict=True))


def with_shardings(abstract_tree: Any, shardings: Any) -> Any:
    """``ShapeDtypeStruct``s carrying shardings, for lowering/compiling without allocating.

    Args:
      abstract_tree: arrays or ``ShapeDtypeStruct``s (e.g. from ``jax.eval_shape``).
      shardings: a tree of the same structure with a ``Sharding`` per leaf.

    Returns:
      The tree of sharded ``ShapeDtypeStruct``s.
    """
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        abstract_tree, shardings)


def shard_init(init_fn: Callable[..., T], out_shardings: Any) -> Callable[..., T]:
    """``init_fn`` jitted so that each device computes only its shards of the outputs (with
    the partitionable threefry PRNG, the values of the unsharded init).

    Args:
      init_fn: e.g. ``lambda rng: init_params(config, rng)`` or the train-state init.
      out_shardings: a tree (or prefix) of shardings of its outputs.

    Returns:
      The jitted init function.
    """
    return jax.jit(init_fn, out_shardings=out_shardings)


def jit_sharded(fn: Callable[..., Any], mesh: Mesh, in_shardings: Any, out_shardings: Any, *,
                donate_argnums: Sequence[int] = (),
                rules: Sequence[tuple[str, MeshAxes]] | None = None) -> Any:
    """``jax.jit`` with explicit shardings, tracing ``fn`` with the abstract mesh, the rules and
    the mesh's platform as ``model.ops.target`` in force (so the model's logical constraints
    resolve to mesh axes). Use it for every function that runs the model.

    Args:
      fn, mesh: the pure function and the device mesh.
      in_shardings, out_shardings: shardings (or prefixes) of the arguments and outputs.
      donate_argnums: arguments whose buffers the outputs may reuse.
      rules: logical -> mesh axis rules (None: ``rules_for(mesh)``).

    Returns:
      The jitted function (with ``.lower`` for ahead-of-time compilation).
    """
    rules = rules_for(mesh) if rules is None else rules

    @functools.wraps(fn)
    def in_context(*args):
        # Entered at trace time: that is when the model's logical constraints are resolved.
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), nn.logical_axis_rules(rules), \
                target.targeting(target.of_mesh(mesh)):
            return fn(*args)

    return jax.jit(in_context, in_shardings=in_shardings, out_shardings=out_shardings,
                   donate_argnums=tuple(donate_argnums))


def jit_train_step(train_step: Callable[[Any, Any], tuple[Any, Any]], state_shardings: Any,
                   batch_sharding: NamedSharding, *, donate: bool = True,
                   rules: Sequence[tuple[str, MeshAxes]] | None = None
                   ) -> Callable[[Any, Any], tuple[Any, Any]]:
    """Jits ``train_step(state, batch) -> (state, metrics)`` (``jit_sharded``): the state keeps
    its shardings (and is donated); metrics come back replicated, readable on every process.

    Args:
      train_step: the pure step function.
      state_shardings: ``state_shardings(abstract_state, param_shardings(...))``.
      batch_sharding: ``batch_sharding(mesh)`` (applies to every leaf of the batch).
      donate: donate the input state's buffers.
      rules: logical -> mesh axis rules (None: ``rules_for`` the mesh).

    Returns:
      The jitted step (with ``.lower`` for ahead-of-time compilation).
    """
    mesh = batch_sharding.mesh
    return jit_sharded(train_step, mesh, (state_shardings, batch_sharding),
                       (state_shardings, NamedSharding(mesh, P())),
                       donate_argnums=(0,) if donate else (), rules=rules)


@functools.lru_cache(maxsize=16)
def _param_layout(config: ModelConfig) -> tuple[Any, Any]:
    # Each is a trace of the whole model's init; callers ask again for every mesh they try.
    return abstract_params(config), logical_axes(config)


def _as_tuple(axes: MeshAxes) -> tuple[str, ...]:
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


_KEY_ATTRS = {jax.tree_util.DictKey: "key", jax.tree_util.GetAttrKey: "name",
              jax.tree_util.SequenceKey: "idx"}


def _path_keys(path: Sequence[Any]) -> tuple:
    return tuple(getattr(k, _KEY_ATTRS[type(k)]) if type(k) in _KEY_ATTRS else str(k)
                 for k in path)


def _path_str(path: Sequence[Any]) -> str:
    return "/".join(str(k) for k in _path_keys(path))
