"""Weight-only post-training quantisation of the prepared decode weights, through qwix.

``decode.prepare(config, params, quant="int8")`` stores every matrix and the token table as
quantised values and their scales only (``quantize_params``); the forward is unchanged: its
products and the embedding lookup take a quantised weight as they take a float one
(``ops.quantized``). Schemes:

- ``"int8"``: one absmax scale per output channel (``qwix.quantize`` with the output axes
  channelwise): the token table one per row, which is also one per logit as the tied head.
- ``"int4"`` / ``"int4:G"``: one scale per output channel and group of G consecutive inputs
  along the matrix's last input axis (D, or H for o_proj, F for down; the token table's D),
  values packed two to a byte (``PackedInt4``). G must be even and divide that width, and with
  a tensor split each shard's part of it; ``"int4"`` takes, for each matrix, the largest power
  of two up to 64 that divides its width (so one odd width, say F = 688, makes only ``down``'s
  groups smaller).
- ``"nf4"`` / ``"nf4:G"``: as int4, with the 16 NormalFloat levels of QLoRA (qwix's nf4).

Norm gains and biases stay float (they are a few vectors). With a stacked (scanned) layout each
layer has its own scales.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import jax.numpy as jnp
import qwix
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from transformer_jax.model.config import ModelConfig
from transformer_jax.model.layers import EMBEDDING_PARAM, MATRIX_INPUT_AXES
from transformer_jax.model.ops.quantized import PackedInt4, is_quantized, pack_int4

Params = dict[str, Any]

logger = logging.getLogger(__name__)

SCHEMES = ("int8", "int4", "nf4")
#: The schemes of 4-bit values in groups (packed two to a byte).
GROUPED = ("int4", "nf4")
DEFAULT_GROUP_SIZE = 64


@dataclasses.dataclass(frozen=True)
class WeightQuant:
    """How ``prepare`` quantises the weights.

    Attributes:
      scheme: ``"int8"`` (per output channel) or ``"int4"`` (per output channel and group).
      group_size: G, int4's group of consecutive inputs sharing a scale, for every matrix;
        None for int8, and for int4 picked per matrix by ``for_model``.
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
                             f"{self.group_size!r} is for int4")
        if self.scheme in GROUPED and self.group_size is not None:
            g = self.group_size
            if not isinstance(g, int) or isinstance(g, bool) or g < 2 or g % 2:
                raise ValueError(f"quant {self.scheme} group_size must be an even int >= 2 "
                                 f"(two values pack in a byte), got {g!r}")

    @property
    def name(self) -> str:
        """The spelling ``parse_quant`` reads: ``"int8"``, ``"int4"`` (groups per matrix) or
        ``"int4:G"``."""
        return self.scheme if self.group_size is None else f"{self.scheme}:{self.group_size}"

    def group_for(self, name: str) -> int | None:
        """G of the weight with this leaf name (None for int8)."""
        return dict(self.groups).get(name, self.group_size)


def parse_quant(quant: str | WeightQuant | None) -> WeightQuant | None:
    """``"int8"``, ``"int4"`` (G picked by ``for_model``) or ``"int4:G"`` (or a
    ``WeightQuant``, or None) -> the ``WeightQuant`` (None: float weights).

    Raises:
      ValueError: an unknown scheme or a bad group size.
    """
    if quant is None or isinstance(quant, WeightQuant):
        return quant
    if not isinstance(quant, str):
        raise ValueError(f"quant must be a string such as 'int8' or 'int4:64', got {quant!r}")
    scheme, _, group = quant.partition(":")
    if scheme not in SCHEMES:
        raise ValueError(f"quant must be one of 'int8', 'int4', 'int4:G', 'nf4' or 'nf4:G', "
                         f"got {quant!r}")
    if scheme == "int8":
        if group:
            raise ValueError(f"quant int8 takes no group size, got {quant!r}")
        return WeightQuant("int8")
    if not group:
        return WeightQuant(scheme)
    if not group.isdigit():
        raise ValueError(f"quant {scheme} group size must be an int, got {quant!r}")
    return WeightQuant(scheme, int(group))


def grouped_widths(config: ModelConfig, shards: int = 1) -> dict[str, int]:
    """The width of each weight's grouped (last input) axis as one of T = ``shards`` shards
    holds it: D for the projections in and the head, H for o_proj, F/T for down."""
    c = config
    widths = {"q_proj": c.d_model, "k_proj": c.d_model, "v_proj": c.d_model,
              "o_proj": c.head_dim, "up": c.d_model, "down": c.d_ff // shards,
              EMBEDDING_PARAM: c.d_model}
    if c.ffn in ("swiglu", "geglu"):
        widths["gate"] = c.d_model
    if not c.tie_embeddings:
        widths["lm_head"] = c.d_model
    return widths


def for_model(config: ModelConfig, quant: WeightQuant | None, shards: int = 1
              ) -> WeightQuant | None:
    """``quant`` for this model split over T = ``shards``: int4 without a group size gets, for
    each matrix, the largest power of two up to ``DEFAULT_GROUP_SIZE`` dividing its grouped
    width (per shard).

    Raises:
      ValueError: int4's group size does not divide a grouped width (per shard).
    """
    if quant is None or quant.scheme not in GROUPED:
        return quant
    widths = grouped_widths(config, shards)
    if quant.group_size is None and not quant.groups:
        picks = {}
        for name, width in widths.items():
            g = DEFAULT_GROUP_SIZE
            while g > 2 and width % g:
                g //= 2
            picks[name] = g
        small = [f"{n} ({widths[n]}: {g})" for n, g in picks.items() if g < DEFAULT_GROUP_SIZE]
        if small:  # smaller groups carry more scales: more bytes per weight
            logger.info("quant %s: groups of %d inputs, but fewer for the input widths that "
                        "%d does not divide: %s", quant.scheme, DEFAULT_GROUP_SIZE,
                        DEFAULT_GROUP_SIZE, ", ".join(small))
        quant = WeightQuant(quant.scheme, None, tuple(sorted(picks.items())))
    bad = [f"{name} ({width})" for name, width in widths.items()
           if width % quant.group_for(name)]
    if bad:
        per = f" per shard of {shards}" if shards > 1 else ""
        if quant.group_size is None:  # the picks: an odd width has no even group size
            raise ValueError(f"quant {quant.scheme} needs an even group size dividing the input "
                             f"width{per} of {', '.join(bad)}; no such width can be grouped")
        raise ValueError(f"quant {quant.scheme} group_size={quant.group_size} does not divide "
                         f"the input width{per} of {', '.join(bad)}; pick a group size that "
                         "divides them")
    return quant


def quantized_axes(name: str, ndim: int, *, stacked: bool, out_first: bool
                   ) -> tuple[tuple[int, ...], int]:
    """(the channelwise axes, the grouped axis) of stored weight ``name`` of rank ``ndim``.

    Output axes (and a stacked layout's layers axis) get one scale each entry; the grouped axis
    is the last input axis (a matrix stored in-first has its inputs first, out-first last).
    """
    lead = int(stacked)
    n_in = 1 if name == EMBEDDING_PARAM else MATRIX_INPUT_AXES[name]
    if name == EMBEDDING_PARAM:  # [V, D]: a row per token, never transposed
        inputs = (lead + 1,)
    elif out_first:
        inputs = tuple(range(ndim - n_in, ndim))
    else:
        inputs = tuple(range(lead, lead + n_in))
    channel = tuple(a for a in range(ndim) if a not in inputs)
    return channel, inputs[-1]


def quantize_weight(w: jax.Array, name: str, quant: WeightQuant, *, stacked: bool,
                    out_first: bool) -> Any:
    """One stored weight -> a ``qwix.QArray`` (int8) or a ``PackedInt4``, scales in w's dtype."""
    channel, grouped = quantized_axes(name, w.ndim, stacked=stacked, out_first=out_first)
    if quant.scheme == "int8":
        return qwix.quantize(w, jnp.int8, channelwise_axes=channel)
    q = qwix.quantize(w, jnp.int4 if quant.scheme == "int4" else "nf4",
                      channelwise_axes=channel, tiled_axes={grouped: quant.group_for(name)})
    return pack_int4(q, grouped)


def is_quantizable(name: str) -> bool:
    """Whether ``quantize_params`` quantises a weight of this leaf name."""
    return name in MATRIX_INPUT_AXES or name == EMBEDDING_PARAM


def quantize_params(params: Params, quant: WeightQuant, *, out_first: bool) -> Params:
    """Decode params (``decode_params``' layout) with every matrix and the token table
    quantised (``quantize_weight``); the rest as given."""
    def one(path: tuple[Any, ...], x: jax.Array) -> Any:
        name = str(path[-1].key)
        if not is_quantizable(name):
            return x
        return quantize_weight(x, name, quant, stacked=str(path[0].key) == "blocks",
                               out_first=out_first)

    return jax.tree_util.tree_map_with_path(one, params)


def dequantize(w: Any) -> jax.Array:
    """A quantised weight's float values (``qwix.dequantize``); a float one as it is."""
    if isinstance(w, PackedInt4):
        w = w.qarray()
    return qwix.dequantize(w) if is_quantized(w) else w


def dequantize_params(params: Params) -> Params:
    """Every quantised weight of ``params`` replaced by its float values (same layout)."""
    return jax.tree.map(dequantize, params, is_leaf=is_quantized)


def quantized_shardings(shardings: Params, quantized: Params) -> Params:
    """The shardings of quantised weights, from those of the float weights they replace.

    Values keep their weight's spec (int4's packed axis is halved, still divisible when the
    group size divides each shard's width); scales take it on the axes they have entries along
    and replicate their size-1 axes.
    """
    def one(s: NamedSharding, q: Any) -> Any:
        if not is_quantized(q):
            return s
        spec = tuple(s.spec) + (None,) * (len(q.shape) - len(s.spec))
        scale_spec = P(*(a if n > 1 else None for a, n in zip(spec, q.scale.shape, strict=True)))
        tree = jax.tree.map(lambda _: s, q)
        return tree.replace(scale=NamedSharding(s.mesh, scale_spec))

    return jax.tree.map(one, shardings, quantized)
