"""Many LoRA adapters of one base, stacked for a batch whose rows pick different ones
(``stack_adapters``; ids from 1, 0 the base), and the params a step runs with
(``with_row_adapters``: each adapted matrix a ``RowAdapters``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.model.layers import MATRIX_INPUT_AXES
from transformer_jax.model.lora import DEFAULT_TARGETS, TARGETS, LoraConfig
from transformer_jax.model.ops.layouts import OutFirst
from transformer_jax.model.ops.row_lora import RowAdapters
from transformer_jax.model.stack import block_paths, restack, stacked_layers, tree_set

Params = dict[str, Any]
#: The targets that take per-row adapters (``DEFAULT_TARGETS``: the dense matrices).
ROW_TARGETS = DEFAULT_TARGETS


def _node(tree: Mapping[str, Any], path: Sequence[str]) -> Any:
    for key in path:
        if not isinstance(tree, Mapping) or key not in tree:
            return None
        tree = tree[key]
    return tree


def _in_first_shape(w: Any, name: str, stacked: bool) -> tuple[int, ...]:
    """The matrix's in-first shape without its layers axis."""
    shape = tuple(w.shape)[int(stacked):]
    if isinstance(w, OutFirst):  # stored (out..., in...): put the inputs back first
        n_out = len(shape) - MATRIX_INPUT_AXES[name]
        shape = shape[n_out:] + shape[:n_out]
    return shape


def stack_adapters(params: Params, adapters: Sequence[tuple[Mapping[str, Any], LoraConfig]],
                   *, names: Sequence[str] | None = None) -> Params:
    """The stacked adapters of ``params``.

    Args:
      params: the base params the forward runs with (the factors take each matrix's layout).
      adapters: (adapter tree, its ``LoraConfig``) per adapter, in id order from 1.
      names: the adapters' names, for errors (default ``adapter 1`` ...).

    Returns:
      ``{block: {module: {name: {"a": [L?, Na, in..., R], "b": [L?, Na, R, out...]}}}}`` float32
      (out-first: A [L?, Na, R, in...], B [L?, out..., Na, R]) for every targeted matrix.

    Raises:
      ValueError: naming the adapter: a target outside ``ROW_TARGETS``, a missing matrix, or
        shapes that do not fit the base.
    """
    if not adapters:
        raise ValueError("stack_adapters needs at least one adapter")
    names = list(names) if names is not None else [f"adapter {i + 1}" for i in range(len(adapters))]
    blocks = block_paths(params)
    rank = max(cfg.rank for _, cfg in adapters)
    trees = []
    for (tree, cfg), name in zip(adapters, names, strict=True):
        if other := [t for t in cfg.targets if t not in ROW_TARGETS]:
            raise ValueError(f"adapter {name!r} targets {other}: a serving batch takes per-row "
                             f"adapters on the dense matrices only ({', '.join(ROW_TARGETS)})")
        tree = restack(tree, stacked_layers(params))
        if sorted(block_paths(tree)) != sorted(blocks):
            raise ValueError(f"adapter {name!r} has blocks {block_paths(tree)[:3]}..., the base "
                             f"{blocks[:3]}... ({len(block_paths(tree))} vs {len(blocks)} layers)")
        trees.append((tree, cfg, name))
    stack: Params = {}
    for block, scanned in blocks:
        for target in ROW_TARGETS:
            path = TARGETS[target]
            w = _node(params, (*block, *path))
            used = [(t, c, n) for t, c, n in trees if target in c.targets
                    and _node(t, (*block, *path)) is not None]
            if w is None or not used:
                continue
            shape = _in_first_shape(w, path[-1], scanned)
            n_in = MATRIX_INPUT_AXES[path[-1]]
            lead = (tuple(w.shape)[0],) if scanned else ()
            # Assembled on the host: on the device every op of each shape would compile.
            a = np.zeros((*lead, len(trees), *shape[:n_in], rank), np.float32)
            b = np.zeros((*lead, len(trees), rank, *shape[n_in:]), np.float32)
            for i, (tree, cfg, name) in enumerate(trees):
                ab = _node(tree, (*block, *path))
                if target not in cfg.targets or ab is None:
                    continue
                want_a = (*lead, *shape[:n_in], cfg.rank)
                want_b = (*lead, cfg.rank, *shape[n_in:])
                if tuple(ab["a"].shape) != want_a or tuple(ab["b"].shape) != want_b:
                    raise ValueError(
                        f"adapter {name!r}: {'/'.join((*block, *path))} has A {ab['a'].shape} and "
                        f"B {ab['b'].shape}; the base's matrix needs {want_a} and {want_b}")
                at, own = (slice(None),) * len(lead) + (i,), slice(0, cfg.rank)
                a[(*at, Ellipsis, own)] = np.asarray(ab["a"], np.float32)
                b[(*at, own)] = np.asarray(ab["b"], np.float32) * np.float32(cfg.scale)
            if isinstance(w, OutFirst):  # A [L?, Na, R, in...], B [L?, out..., Na, R]
                n = len(lead)
                a = np.moveaxis(a, -1, n + 1)
                b = np.moveaxis(b, (n, n + 1), (-2, -1))
            stack = tree_set(stack, (*block, *path), {"a": jnp.asarray(a), "b": jnp.asarray(b)})
    if not stack:
        raise ValueError(f"no matrix of the base is adapted by {names}")
    return stack


def with_row_adapters(params: Params, stack: Params, ids: jax.Array) -> Params:
    """``params`` with each matrix of ``stack`` a ``RowAdapters`` choosing, for batch row b, adapter
    ``ids[b]`` (pure; call it inside the jitted step).

    Args:
      params, stack: the params the forward runs with, ``stack_adapters``'s output for them.
      ids: [B] int32 adapter of each row (its index in ``stack_adapters``' list + 1; 0: base).

    Returns:
      The param tree for ``Transformer.apply`` (scanned: the ids repeated per layer, [L, B]).
    """
    out = dict(params)
    for block, stacked in block_paths(stack):
        for target in ROW_TARGETS:
            path = (*block, *TARGETS[target])
            ab = _node(stack, path)
            if ab is None:
                continue
            rows = jnp.broadcast_to(ids, (ab["a"].shape[0], *ids.shape)) if stacked else ids
            out = tree_set(out, path, RowAdapters(_node(params, path), ab["a"], ab["b"], rows))
    return out


__all__ = ["ROW_TARGETS", "stack_adapters", "with_row_adapters"]
