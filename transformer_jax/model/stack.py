"""The layer stack as groups: each layer is a ``LayerSpec``; the stack is cut into
``LayerGroup``s, periods of specs repeated (Gemma 3: 5 local + 1 global, four times, then two
local), which a scanned model scans one by one, the period's blocks unrolled in the body, each
addressing its cache with a ``LayerRef``. ``restack`` moves trees between the layouts."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax

#: Attention kinds a ``LayerSpec`` names (its FFN kind: ``"dense"`` or ``"moe"``).
ATTENTION_KINDS = ("global", "local", "chunked", "latent")
#: The kinds whose caches keep a ring of their last positions (``kv_ring``), not every one.
RING_KINDS = ("local", "chunked")


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """What one layer is (static, hashable).

    Attributes:
      attention: ``"global"`` (full causal), ``"local"`` (the sliding window), ``"chunked"``
        (causal within its chunk) or ``"latent"`` (multi-head latent attention).
      ffn: ``"dense"`` or ``"moe"`` (the mixture of experts).
      rope: whether the layer rotates q and k (False: a NoPE layer, ``nope_layers``).
    """

    attention: str = "global"
    ffn: str = "dense"
    rope: bool = True

    @property
    def local(self) -> bool:
        return self.attention == "local"

    @property
    def ring(self) -> bool:
        """Whether its cache is a ring of its last positions (``RING_KINDS``)."""
        return self.attention in RING_KINDS

    @property
    def sparse(self) -> bool:
        return self.ffn == "moe"


@dataclasses.dataclass(frozen=True)
class LayerRef:
    """Where a layer is, as a cache reads it: its attention kind (static) and its indices.

    Attributes:
      index, of_kind: its number among all L layers, and among those of its attention kind
        (Python ints, or traced in a scan).
      local: whether its cache is a ring (a local or chunked layer, static).
    """

    index: int | jax.Array
    local: bool
    of_kind: int | jax.Array


@dataclasses.dataclass(frozen=True)
class LayerGroup:
    """A run of layers: ``period`` repeated ``repeats`` times from layer ``start``.

    Attributes:
      start, period, repeats: the first layer's number, one repeat's specs, R repeats.
      before: per attention kind, how many layers of that kind come before the group
        (``(("global", n), ("local", m))``).
    """

    start: int
    period: tuple[LayerSpec, ...]
    repeats: int
    before: tuple[tuple[str, int], ...]

    @property
    def size(self) -> int:
        """The number of layers of the group, ``len(period) * repeats``."""
        return len(self.period) * self.repeats

    def ref(self, j: int, r: int | jax.Array) -> LayerRef:
        """Position ``j`` of repeat ``r``'s ``LayerRef`` (r traced in a scan)."""
        spec = self.period[j]
        same = [s.attention == spec.attention for s in self.period]
        of_kind = (dict(self.before)[spec.attention] + r * sum(same) + sum(same[:j]))
        return LayerRef(self.start + r * len(self.period) + j, spec.ring, of_kind)

    def layers(self, j: int) -> list[int]:
        """The layer numbers of period position ``j``, one per repeat."""
        return [self.start + r * len(self.period) + j for r in range(self.repeats)]


@functools.cache
def layer_groups(specs: tuple[LayerSpec, ...]) -> tuple[LayerGroup, ...]:
    """Cuts a stack into groups: from each layer on, the period that covers the most layers by
    repeating (the shortest among equals); a run that repeats nothing is one layer.

    Args:
      specs: each layer's spec, L entries.

    Returns:
      The groups in layer order, covering every layer once.
    """
    groups, start, n = [], 0, len(specs)
    while start < n:
        best = (1, 1)  # (period, repeats)
        for p in range(1, (n - start) // 2 + 1):
            r = 1
            while start + (r + 1) * p <= n and \
                    specs[start + r * p:start + (r + 1) * p] == specs[start:start + p]:
                r += 1
            if r > 1 and p * r > best[0] * best[1]:
                best = (p, r)
        p, r = best
        before = tuple((kind, sum(s.attention == kind for s in specs[:start]))
                       for kind in ATTENTION_KINDS)
        groups.append(LayerGroup(start, specs[start:start + p], r, before))
        start += p * r
    return tuple(groups)


def group_key(groups: tuple[LayerGroup, ...], g: int) -> str:
    """Scanned group ``g``'s params key: ``blocks`` if it is the only one, else ``scan_{g}``."""
    return "blocks" if len(groups) == 1 else f"scan_{g}"


def is_scanned_key(key: str) -> bool:
    """Whether a top-level params key holds scanned layers (a leading repeats axis)."""
    return key == "blocks" or key.startswith("scan_")


def block_paths(params: Mapping[str, Any]) -> list[tuple[tuple[str, ...], bool]]:
    """(path, stacked) of every block's subtree of a params-shaped tree, in layer order:
    ``("blocks_3",)``, ``("blocks",)``, ``("scan_1",)`` or ``("scan_0", "layer_2")``; ``stacked``:
    its leaves have a leading repeats axis."""
    def order(key: str) -> tuple[int, str]:
        return len(key), key

    out = []
    for key in sorted(params, key=order):
        if key.startswith("blocks_"):
            out.append(((key,), False))
        elif is_scanned_key(key):
            sub = params[key]
            if isinstance(sub, Mapping) and sub and all(k.startswith("layer_") for k in sub):
                out.extend(((key, j), True) for j in sorted(sub, key=order))
            else:
                out.append(((key,), True))
    return out


def tree_get(tree: Any, path: Sequence[str]) -> Any:
    """``tree[path[0]][path[1]]...``."""
    for key in path:
        tree = tree[key]
    return tree


def tree_set(tree: Mapping[str, Any], path: Sequence[str], value: Any) -> dict[str, Any]:
    """A copy of ``tree`` with ``value`` at ``path`` (the dicts along it copied or created)."""
    out = dict(tree)
    out[path[0]] = value if len(path) == 1 else tree_set(tree.get(path[0], {}), path[1:], value)
    return out


def stacked_layers(params: Mapping[str, Any]) -> dict[tuple[str, ...], list[int]]:
    """Each scanned block path of ``params`` -> the layer numbers it stacks, read off the tree."""
    paths = [p for p, stacked in block_paths(params) if stacked]
    out, start = {}, 0
    for key in dict.fromkeys(p[0] for p in paths):
        mine = [p for p in paths if p[0] == key]
        repeats = jax.tree.leaves(tree_get(params, mine[0]))[0].shape[0]
        for j, path in enumerate(mine):
            out[path] = [start + r * len(mine) + j for r in range(repeats)]
        start += len(mine) * repeats
    return out


def group_layers(groups: tuple[LayerGroup, ...]) -> dict[tuple[str, ...], list[int]]:
    """``stacked_layers`` of the scanned params of a stack cut into ``groups``."""
    out = {}
    for g, group in enumerate(groups):
        for j in range(len(group.period)):
            tail = () if len(group.period) == 1 else (f"layer_{j}",)
            out[(group_key(groups, g), *tail)] = group.layers(j)
    return out


def restack(tree: Mapping[str, Any], want: dict[tuple[str, ...], list[int]]) -> dict[str, Any]:
    """A params-shaped ``tree`` in the layer layout ``want`` (empty: unrolled ``blocks_{i}``)."""
    scanned = stacked_layers(tree)
    if bool(scanned) == bool(want):
        return dict(tree)
    out = {k: v for k, v in tree.items() if not (k.startswith("blocks_") or is_scanned_key(k))}
    for path, layers in want.items():  # unrolled -> scanned
        out = tree_set(out, path, jax.tree.map(lambda *xs: jax.numpy.stack(xs),
                                               *[tree[f"blocks_{i}"] for i in layers]))
    for path, layers in scanned.items():  # scanned -> unrolled
        for r, i in enumerate(layers):
            out[f"blocks_{i}"] = jax.tree.map(lambda x, r=r: x[r], tree_get(tree, path))
    return out
