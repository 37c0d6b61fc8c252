"""Quantised training through qwix (``train.quant=int8``, or ``fp8`` on GPU/TPU): every weight
product runs on quantised operands, straight-through into the float parameters
(docs/quantisation.md).
"""

from __future__ import annotations

import jax.numpy as jnp
import qwix

from transformer_jax.model.transformer import Transformer

#: Per ``train.quant`` scheme (``train.config.QUANT_SCHEMES``): (the forward qtype of weights
#: and activations, the backward qtype of gradients).
QTYPES = {"int8": (jnp.int8, jnp.int8), "fp8": (jnp.float8_e4m3fn, jnp.float8_e5m2)}


def rules(quant: str) -> list[qwix.QtRule]:
    """The qwix rules of ``quant``: every ``dot_general`` of the model quantised."""
    fwd, bwd = QTYPES[quant]
    return [qwix.QtRule(module_path=".*", op_names=("dot_general",), weight_qtype=fwd,
                        act_qtype=fwd, bwd_qtype=bwd)]


def training_model(model: Transformer, quant: str) -> Transformer:
    """``model`` with its weight products quantised by ``quant`` ("" returns it as it is)."""
    if not quant:
        return model
    return qwix.quantize_model(model, qwix.QtProvider(rules(quant)))
