"""New weights for a running engine (``Engine.update_weights``): prepared in memory by one
jitted program and checked to have the old weights' layout, so no step program recompiles."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from transformer_jax.decode.weights import DecodeWeights, _prepare_fn

Params = dict[str, Any]


def _signature(tree: Params) -> Any:
    return jax.tree.map(lambda x: (x.shape, x.dtype, getattr(x, "sharding", None)), tree)


def refreshed(old: DecodeWeights, weights_or_params: DecodeWeights | Params) -> DecodeWeights:
    """The new ``DecodeWeights``: ``weights_or_params`` as they are, or prepared by the program
    that prepared ``old`` (``_prepare_fn``'s, cached).

    Args:
      old: the engine's weights.
      weights_or_params: prepared weights, or model params (any placement).

    Raises:
      ValueError: the new weights differ from ``old`` in layout or preparation.
    """
    if isinstance(weights_or_params, DecodeWeights):
        new = weights_or_params
    else:
        prepare = _prepare_fn(old.config, old.mesh, old.out_first, old.quant, old.experts_split)
        params = weights_or_params
        if old.mesh is None:
            params = jax.device_put(params, jax.tree.leaves(old.params)[0].sharding)
        new = dataclasses.replace(old, params=prepare(params))
    statics = ("config", "mesh", "out_first", "quant", "experts_split")
    if (jax.tree.structure(new.params) != jax.tree.structure(old.params)
            or _signature(new.params) != _signature(old.params)
            or any(getattr(new, k) != getattr(old, k) for k in statics)):
        raise ValueError("update_weights: the new weights differ from the engine's in "
                         "structure, shape, dtype, placement or preparation")
    return new


__all__ = ["refreshed"]
