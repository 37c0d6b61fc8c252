"""The spelling of a weight quantisation: ``"int8"``, ``"int4"``, ``"int4:G"``, ``"nf4"``,
``"nf4:G"``, parsed in one place (``parse_quant``) for every flag and setting that takes one.
It needs neither qwix nor a device, so a setting is checked before anything is loaded."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

SCHEMES = ("int8", "int4", "nf4")
#: The schemes of 4-bit values in groups (packed two to a byte).
GROUPED = ("int4", "nf4")
DEFAULT_GROUP_SIZE = 64
#: What a quantisation setting accepts, for the errors.
ACCEPTS = ("int8, int4, nf4, int4:G or nf4:G (G, the inputs sharing a scale, an even integer "
           ">= 2)")
_DIGITS = re.compile(r"[0-9]+")  # ASCII only: str.isdigit() takes '²' and int() refuses it


@dataclasses.dataclass(frozen=True)
class WeightQuant:
    """How ``prepare`` quantises the weights.

    Attributes:
      scheme: ``"int8"`` (per output channel), ``"int4"`` or ``"nf4"`` (and group).
      group_size: G, the consecutive inputs sharing a scale (int4/nf4); None for int8, and
        for int4/nf4 picked per matrix by ``quant.for_model``.
      groups: ``for_model``'s per-matrix picks, ((leaf name, G), ...) sorted; empty otherwise.
    """

    scheme: str = "int8"
    group_size: int | None = None
    groups: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"quant scheme must be one of {SCHEMES}, got {self.scheme!r}")
        if self.scheme == "int8" and self.group_size is not None:
            raise ValueError(f"quant int8 has one scale per output channel; group_size "
                             f"{self.group_size!r} is for int4 and nf4")
        if self.scheme in GROUPED and self.group_size is not None:
            g = self.group_size
            if not isinstance(g, int) or isinstance(g, bool) or g < 2 or g % 2:
                raise ValueError(f"quant {self.scheme} group_size must be an even int >= 2 "
                                 f"(two values pack in a byte), got {g!r}")

    @property
    def name(self) -> str:
        """The spelling ``parse_quant`` reads (``"int8"``, ``"int4"``, ``"int4:G"``, ...)."""
        return self.scheme if self.group_size is None else f"{self.scheme}:{self.group_size}"

    def group_for(self, name: str) -> int | None:
        """G of the weight with this leaf name (None for int8)."""
        return dict(self.groups).get(name, self.group_size)


def parse_quant(quant: str | WeightQuant | None, *, field: str = "quant") -> WeightQuant | None:
    """The ``WeightQuant`` of a spelling (None: float weights).

    Args:
      quant: ``"int8"``, ``"int4"`` / ``"nf4"`` (G picked per matrix by ``quant.for_model``),
        ``"int4:G"`` / ``"nf4:G"``, a ``WeightQuant`` or None.
      field: how the errors name the setting (``"--quant"``, ``"train.lora_base_quant"``).

    Raises:
      ValueError: an unknown scheme, or a group size that is not an even integer >= 2.
    """
    if quant is None or isinstance(quant, WeightQuant):
        return quant
    if not isinstance(quant, str):
        raise ValueError(f"{field} must be a string, one of {ACCEPTS}; got {quant!r}")
    scheme, colon, group = quant.partition(":")
    if scheme not in SCHEMES:
        raise ValueError(f"{field} must be one of 'int8', 'int4', 'int4:G', 'nf4' or 'nf4:G', "
                         f"got {quant!r} (G, the inputs sharing a scale, an even integer >= 2)")
    if scheme == "int8":
        if colon:
            raise ValueError(f"{field} int8 takes no group size (one scale per output "
                             f"channel), got {quant!r}; accepted: {ACCEPTS}")
        return WeightQuant("int8")
    if not colon:
        return WeightQuant(scheme)
    # (At most 9 digits: int() refuses over 4300, and no width is that large.)
    if not _DIGITS.fullmatch(group) or len(group) > 9 or int(group) < 2 or int(group) % 2:
        raise ValueError(f"{field} {scheme}:G needs G, the group size, an even integer >= 2 "
                         f"(two 4-bit values pack in a byte), got {quant!r}")
    return WeightQuant(scheme, int(group))


#: The arrays of a quantised weight as a checkpoint restored without a target tree holds them.
SAVED_PACKED = frozenset({"packed", "scale"})
SAVED_QARRAY = frozenset({"qvalue", "scale"})


def is_saved_quantized(node: Any) -> bool:
    """Whether ``node`` is a quantised weight as a checkpoint restores it (a dict of arrays)."""
    if not isinstance(node, Mapping):
        return False
    keys = frozenset(node)
    return keys == SAVED_PACKED or keys - {"zero_point"} == SAVED_QARRAY


#: The leaf names of a mixture's [E, ...] expert stacks in a sparse layer's ``moe`` module.
EXPERT_PARAMS = ("gate", "up", "down")
EXPERT_MODULE = "moe"


def _key(entry: Any) -> str:
    return str(getattr(entry, "key", entry))


def is_expert_stack(path: Sequence[Any]) -> bool:
    """Whether the parameter at ``path`` (leaf name last) is an ``moe/{gate,up,down}`` stack."""
    return (len(path) >= 2 and _key(path[-1]) in EXPERT_PARAMS and _key(path[-2]) == EXPERT_MODULE)


__all__ = ["ACCEPTS", "DEFAULT_GROUP_SIZE", "EXPERT_MODULE", "EXPERT_PARAMS", "GROUPED",
           "SAVED_PACKED", "SAVED_QARRAY", "SCHEMES", "WeightQuant", "is_expert_stack",
           "is_saved_quantized", "parse_quant"]
