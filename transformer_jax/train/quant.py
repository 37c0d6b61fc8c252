"""Quantised training through qwix: ``train.quant=int8`` (or ``fp8`` on GPU/TPU).

``training_model`` wraps the one ``Transformer`` with ``qwix.QtProvider``: every weight product
(``ops.quantized.einsum``, a ``jax.lax.dot_general``) runs on quantised operands, the weight and
its input quantised in the forward pass (int8: absmax per channel) and the incoming gradient in
the backward pass, with straight-through gradients into the float parameters. Attention's own
einsums (q k^T, p v), the norms and the embedding lookup stay float, as does a chunked loss's
LM head (``train.loss_chunk``, applied outside the model).

The parameters, the optimizer state, the loss, checkpoints and exports stay in the parameter
dtype: quantisation is a property of the step, not of the weights.

fp8 (e4m3 forward, e5m2 gradients) needs a backend with fp8 matmuls; on CPU a run refuses it
(``train.checks.check_config``), while ``jax.export`` lowers its step for ``cuda`` from any host.
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
