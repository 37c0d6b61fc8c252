"""Products and lookups with quantised weights (``qwix.QArray`` or ``PackedInt4``): ``einsum``
and ``take_rows`` take them or plain arrays, so the model's code does not branch on them (qwix
is imported only once a quantised weight exists)."""

from __future__ import annotations

import sys
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class PackedInt4:
    """4-bit values (int4, or nf4's 16 levels) stored two to a byte (XLA:CPU keeps ``int4`` a byte
    per value), with qwix's scales; ``qarray`` unpacks them inside the step that uses them.

    Attributes:
      packed: uint8, the shape with ``axis`` halved: value 2i the low nibble, 2i+1 the high.
      scale: the QArray's scale.
      axis: static; the packed axis, negative (counted from the last).
      qtype: static; ``"int4"`` or ``"nf4"``.
    """

    packed: jax.Array
    scale: jax.Array
    axis: int = flax.struct.field(pytree_node=False, default=-1)
    qtype: str = flax.struct.field(pytree_node=False, default="int4")

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical (unpacked) shape."""
        s = list(self.packed.shape)
        s[self.axis] *= 2
        return tuple(s)

    @property
    def ndim(self) -> int:
        return self.packed.ndim

    @property
    def dtype(self) -> jnp.dtype:
        return self.scale.dtype

    def astype(self, dtype: Any) -> PackedInt4:
        """The same values dequantising to ``dtype`` (as ``QArray.astype``)."""
        return self.replace(scale=self.scale.astype(dtype))

    def qarray(self) -> Any:
        """The ``qwix.QArray`` (int4 values, same scales) these bytes hold."""
        import qwix

        if self.qtype == "nf4":  # level indices: unsigned nibbles
            low, high = self.packed & 0xF, self.packed >> 4
            storage, qtype = jnp.uint4, "nf4"
        else:
            signed = self.packed.astype(jnp.int8)
            low = jnp.left_shift(signed, 4) >> 4  # arithmetic shifts sign-extend the nibbles
            high = signed >> 4
            storage = qtype = jnp.int4
        axis = self.axis % self.packed.ndim
        pairs = jnp.stack([low, high], axis=axis + 1)
        return qwix.QArray(pairs.reshape(self.shape).astype(storage), self.scale, qtype=qtype)


def pack_int4(qarray: Any, axis: int) -> PackedInt4:
    """A ``qwix.QArray`` of int4 (or nf4) values packed two to a byte along (even) ``axis``."""
    nf4 = qarray.qtype == "nf4"
    values = qarray.qvalue.astype(jnp.uint8 if nf4 else jnp.int8)
    axis = axis % values.ndim
    shape = values.shape
    pairs = values.reshape(*shape[:axis], shape[axis] // 2, 2, *shape[axis + 1:])
    low = jnp.take(pairs, 0, axis=axis + 1) & 0xF
    high = jnp.left_shift(jnp.take(pairs, 1, axis=axis + 1), 4)
    # Counted from the end: a layer scan slices a stacked weight's leading axis off.
    return PackedInt4((low | high).astype(jnp.uint8), qarray.scale, axis - values.ndim,
                      "nf4" if nf4 else "int4")


def is_quantized(w: Any) -> bool:
    """Whether ``w`` is a quantised weight (a ``qwix.QArray`` or a ``PackedInt4``)."""
    if isinstance(w, PackedInt4):
        return True
    qwix = sys.modules.get("qwix")  # no QArray can exist before qwix is imported
    return qwix is not None and isinstance(w, qwix.QArray)


def _as_qwix(w: Any) -> Any:
    return w.qarray() if isinstance(w, PackedInt4) else w


def einsum(spec: str, a: Any, b: Any, *, preferred_element_type: jnp.dtype | None = None
           ) -> jax.Array:
    """``jnp.einsum(spec, a, b)`` of a weight product: ``qwix.einsum`` when either is quantised
    (the float product over the dequantised weight), else ``dot_general_einsum``."""
    if is_quantized(a) or is_quantized(b):
        import qwix

        return qwix.einsum(spec, _as_qwix(a), _as_qwix(b),
                           preferred_element_type=preferred_element_type)
    return dot_general_einsum(spec, a, b, preferred_element_type=preferred_element_type)


def dot_general_einsum(spec: str, a: jax.Array, b: jax.Array, *,
                       preferred_element_type: jnp.dtype | None = None) -> jax.Array:
    """A two-operand einsum ``"<a>,<b>-><out>"`` (single letters, no ellipsis) as one
    ``jax.lax.dot_general`` and a transpose: letters of both operands and the output are
    batch axes, of both and not the output contracted."""
    inputs, out = spec.split("->")
    sa, sb = inputs.split(",")
    batch = [c for c in sa if c in sb and c in out]
    contract = [c for c in sa if c in sb and c not in out]
    dims = (([sa.index(c) for c in contract], [sb.index(c) for c in contract]),
            ([sa.index(c) for c in batch], [sb.index(c) for c in batch]))
    y = jax.lax.dot_general(a, b, dims, preferred_element_type=preferred_element_type)
    # dot_general's output order: batch, then a's free axes, then b's.
    order = batch + [c for c in sa if c not in sb] + [c for c in sb if c not in sa]
    perm = [order.index(c) for c in out]
    return y if perm == sorted(perm) else y.transpose(perm)


def dequantize(w: Any, dtype: jnp.dtype) -> jax.Array:
    """A weight as a float array of ``dtype``: a quantised one dequantised (all of it)."""
    if not is_quantized(w):
        return w.astype(dtype)
    import qwix

    return qwix.dequantize(_as_qwix(w)).astype(dtype)


def take_rows(table: Any, ids: jax.Array, fill: bool = False) -> jax.Array:
    """Rows ``ids`` (any shape) of a [V, ...] table, dequantised when it is quantised:
    [*ids.shape, ...]. Only the rows taken (and their scales) are read, packed bytes before
    they are unpacked. With ``fill`` an id past the table gives a row of zeros; otherwise ids
    must be in range."""
    def take(a: jax.Array) -> jax.Array:
        return jnp.take(a, ids, axis=0, **(dict(mode="fill", fill_value=0) if fill else {}))

    if not is_quantized(table):
        return take(table)
    import qwix

    if isinstance(table, PackedInt4):  # its packed axis is negative: still right once taken
        q = table.replace(packed=take(table.packed), scale=take(table.scale)).qarray()
        return qwix.dequantize(q)
    # One scale (or one per group) per row: taken with the row.
    return qwix.dequantize(qwix.QArray(take(table.qvalue), take(table.scale), qtype=table.qtype))
