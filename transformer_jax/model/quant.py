"""Weight-only post-training quantisation of the prepared decode weights, through qwix
(``decode.prepare(..., quant=...)``): ``"int8"`` one scale per output channel; ``"int4"`` /
``"nf4"`` (``":G"``) per output channel and group of G inputs, two values a byte. The forward
takes quantised weights as floats (``ops.quantized``); see docs/quantisation.md."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import qwix
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from transformer_jax.model.config import ModelConfig
from transformer_jax.model.layers import EMBEDDING_PARAM, MATRIX_INPUT_AXES
from transformer_jax.model.ops.layouts import OutFirst
from transformer_jax.model.ops.quantized import PackedInt4, is_quantized, pack_int4
from transformer_jax.model.quant_spec import (  # noqa: F401  (the parser's names, re-exported)
    DEFAULT_GROUP_SIZE,
    EXPERT_MODULE,
    GROUPED,
    SAVED_PACKED,
    SCHEMES,
    WeightQuant,
    is_expert_stack,
    is_saved_quantized,
    parse_quant,
)
from transformer_jax.model.stack import is_scanned_key

Params = dict[str, Any]

logger = logging.getLogger(__name__)


def grouped_widths(config: ModelConfig, shards: int = 1) -> dict[str, int]:
    """The width of each weight's grouped (last input) axis per shard, by its ``group_key``."""
    c = config
    widths = {"q_proj": c.d_model, "k_proj": c.d_model, "v_proj": c.d_model,
              "o_proj": c.head_dim, "up": c.d_model, "down": c.d_ff // shards,
              EMBEDDING_PARAM: c.d_model}
    gated = c.ffn in ("swiglu", "geglu")
    if gated:
        widths["gate"] = c.d_model
    if not c.tie_embeddings:
        widths["lm_head"] = c.d_model
    if c.moe is not None:
        m = c.moe
        widths |= {"experts/gate": c.d_model, "experts/up": c.d_model,
                   "experts/down": m.d_ff // shards}
        if m.shared_d_ff:
            widths |= {"shared/up": c.d_model, "shared/down": m.shared_d_ff // shards}
            if gated:
                widths["shared/gate"] = c.d_model
    return widths


def group_key(path: Sequence[Any]) -> str:
    """A weight's group-size key: its leaf name, or ``experts/<name>`` / ``shared/<name>``."""
    keys = [str(getattr(p, "key", p)) for p in path]
    if is_expert_stack(keys):
        return f"experts/{keys[-1]}"
    if len(keys) >= 3 and keys[-2] == "shared" and keys[-3] == EXPERT_MODULE:
        return f"shared/{keys[-1]}"
    return keys[-1]


def for_model(config: ModelConfig, quant: WeightQuant | None, shards: int = 1
              ) -> WeightQuant | None:
    """``quant`` for this model split over ``shards``: int4/nf4 without a group size gets, per
    matrix, the largest power of two up to ``DEFAULT_GROUP_SIZE`` dividing its grouped width.

    Raises:
      ValueError: int4's group size does not divide a grouped width (per shard).
    """
    if quant is None or quant.scheme not in GROUPED:
        return quant
    widths = grouped_widths(config, shards)
    if quant.group_size is None and not quant.groups:
        # At least 2: an odd width then fails the check below.
        picks = {n: max(2, math.gcd(width, DEFAULT_GROUP_SIZE)) for n, width in widths.items()}
        small = [f"{n} ({widths[n]}: {g})" for n, g in picks.items() if g < DEFAULT_GROUP_SIZE]
        if small:  # smaller groups carry more scales: more bytes per weight
            logger.info("quant %s: groups of %d inputs, but fewer for the input widths that "
                        "%d does not divide: %s", quant.scheme, DEFAULT_GROUP_SIZE,
                        DEFAULT_GROUP_SIZE, ", ".join(small))
        quant = WeightQuant(quant.scheme, None, tuple(sorted(picks.items())))
    bad = [f"{name} ({width})" for name, width in widths.items() if width % quant.group_for(name)]
    if bad:
        per = f" per shard of {shards}" if shards > 1 else ""
        if quant.group_size is None:  # the picks: an odd width has no even group size
            raise ValueError(f"quant {quant.scheme} needs an even group size dividing the input "
                             f"width{per} of {', '.join(bad)}; no such width can be grouped")
        raise ValueError(f"quant {quant.scheme} group_size={quant.group_size} does not divide "
                         f"the input width{per} of {', '.join(bad)}; pick a group size that "
                         "divides them")
    return quant


def quantized_axes(name: str, w: Any, *, stacked: bool, expert: bool = False
                   ) -> tuple[tuple[int, ...], int]:
    """(the channelwise axes, the grouped axis: the last input one) of stored weight ``name``, ``w``
    (maybe ``OutFirst``); an ``expert`` stack [L?, E, in, out] has a scale per expert."""
    lead, ndim = int(stacked), len(w.shape)
    n_in = 1 if name == EMBEDDING_PARAM else MATRIX_INPUT_AXES[name]
    if expert or name == EMBEDDING_PARAM:  # the token table [V, D]: a row per token, never
        inputs = (lead + 1,)  # transposed
    elif isinstance(w, OutFirst):
        inputs = tuple(range(ndim - n_in, ndim))
    else:
        inputs = tuple(range(lead, lead + n_in))
    channel = tuple(a for a in range(ndim) if a not in inputs)
    return channel, inputs[-1]


def quantize_weight(w: Any, name: str, quant: WeightQuant, *, stacked: bool,
                    expert: bool = False, key: str | None = None) -> Any:
    """One stored weight (maybe ``OutFirst``) -> a ``qwix.QArray`` (int8) or ``PackedInt4``, scales
    in w's dtype; ``expert``: an [E, ...] stack; ``key``: its ``group_key`` (default ``name``)."""
    channel, grouped = quantized_axes(name, w, stacked=stacked, expert=expert)
    if isinstance(w, OutFirst):
        return OutFirst(_quantize(w.w, quant, channel, grouped, key or name))
    return _quantize(w, quant, channel, grouped, key or name)


def _quantize(w: jax.Array, quant: WeightQuant, channel: tuple[int, ...], grouped: int,
              key: str) -> Any:
    if quant.scheme == "int8":
        return qwix.quantize(w, jnp.int8, channelwise_axes=channel)
    q = qwix.quantize(w, jnp.int4 if quant.scheme == "int4" else "nf4",
                      channelwise_axes=channel, tiled_axes={grouped: quant.group_for(key)})
    return pack_int4(q, grouped)


#: Matrices kept float: a mixture's router and shared-expert gate (small, and routing is sensitive).
FLOAT_MATRICES = ("router", "shared_gate")


def is_quantizable(name: str) -> bool:
    """Whether ``quantize_params`` quantises a weight of this leaf name."""
    return (name in MATRIX_INPUT_AXES and name not in FLOAT_MATRICES) or name == EMBEDDING_PARAM


def quantize_params(params: Params, quant: WeightQuant) -> Params:
    """Params with every matrix (in-first or ``OutFirst``) and the token table quantised."""
    def one(path: tuple[Any, ...], x: Any) -> Any:
        name = str(path[-1].key)
        if not is_quantizable(name):
            return x
        return quantize_weight(x, name, quant, stacked=is_scanned_key(str(path[0].key)),
                               expert=is_expert_stack(path), key=group_key(path))

    return jax.tree_util.tree_map_with_path(one, params, is_leaf=lambda x: isinstance(x, OutFirst))


def dequantize(w: Any) -> jax.Array:
    """A quantised weight's float values (``qwix.dequantize``); a float one as it is."""
    if isinstance(w, PackedInt4):
        w = w.qarray()
    return qwix.dequantize(w) if is_quantized(w) else w


def dequantize_params(params: Params) -> Params:
    """Every quantised weight of ``params`` replaced by its float values (same layout)."""
    return jax.tree.map(dequantize, params, is_leaf=is_quantized)


def from_saved(params: Params, quant: str | WeightQuant, *, where: Any = "the checkpoint"
               ) -> Params:
    """``params`` with every quantised weight that orbax restored as a plain dict rebuilt as the
    ``PackedInt4`` / ``qwix.QArray`` that ``quantize_params(params, quant)`` made of it.

    Raises:
      ValueError: naming ``where`` and the weight: another scheme than ``quant``, or arrays
        whose shapes do not fit together.
    """
    scheme = parse_quant(quant).scheme

    def rebuild(path: tuple[str, ...], node: Any) -> Any:
        name, stacked = path[-1], is_scanned_key(path[0])
        keys = frozenset(node)
        what = f"{where}: the quantised weight {'/'.join(path)}"
        if not is_quantizable(name):
            raise ValueError(f"{what} is not a matrix or the token table, which alone are "
                             "quantised")
        if (keys == SAVED_PACKED) != (scheme in GROUPED):
            saved = "4-bit (packed)" if keys == SAVED_PACKED else "int8"
            raise ValueError(f"{what} is saved {saved}, not {scheme} ({quant!r} was given "
                             "to read it by)")
        scale = jnp.asarray(node["scale"])
        values = jnp.asarray(node["packed" if scheme in GROUPED else "qvalue"])
        if scale.ndim != values.ndim:
            raise ValueError(f"{what} has values of rank {values.ndim} but scales of rank "
                             f"{scale.ndim}")
        if scheme == "int8":
            zero = node.get("zero_point")
            return qwix.QArray(values, scale, None if zero is None else jnp.asarray(zero),
                               qtype=jnp.int8)
        grouped = quantized_axes(name, values, stacked=stacked, expert=is_expert_stack(path))[1]
        packed = PackedInt4(values, scale, grouped - values.ndim, scheme)
        if any(n % s for n, s in zip(packed.shape, scale.shape, strict=True)):
            raise ValueError(f"{what} has values of shape {list(packed.shape)} (unpacked) "
                             f"that its scales {list(scale.shape)} do not tile")
        return packed

    def walk(path: tuple[str, ...], node: Any) -> Any:
        if is_saved_quantized(node) and path:
            return rebuild(path, node)
        if isinstance(node, Mapping):
            return {k: walk((*path, str(k)), v) for k, v in node.items()}
        return node

    return walk((), params)


def quantized_shardings(shardings: Params, quantized: Params) -> Params:
    """The shardings of quantised weights from their float weights' (scales: where they vary)."""
    def one(s: NamedSharding, q: Any) -> Any:
        if not is_quantized(q):
            return s
        spec = tuple(s.spec) + (None,) * (len(q.shape) - len(s.spec))
        scale_spec = P(*(a if n > 1 else None for a, n in zip(spec, q.scale.shape, strict=True)))
        tree = jax.tree.map(lambda _: s, q)
        return tree.replace(scale=NamedSharding(s.mesh, scale_spec))

    return jax.tree.map(one, shardings, quantized)
