"""The decode benchmark's ``--quant`` comparison: the same point with quantised weights."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from transformer_jax.decode import loop as decode
from transformer_jax.model.config import ModelConfig


def step_weight_bytes(config: ModelConfig, weights: decode.DecodeWeights) -> int:
    """Bytes of weights a step reads (quantised values and scales included): all of them, but
    of an untied embedding table only B rows."""
    table = [] if config.tie_embeddings else jax.tree.leaves(weights.params["embed"])
    return weights.nbytes - sum(x.nbytes for x in table)


def compare(config: ModelConfig, weights: decode.DecodeWeights, float_rec: dict[str, Any],
            float_bytes: int, run: Callable[..., dict[str, Any]],
            products: Callable[[decode.DecodeWeights], float]) -> dict[str, Any]:
    """The point ``run(config, weights, weight_bytes=...)`` with quantised ``weights`` against
    the float run ``float_rec`` (its tokens still in it), and its matrix products alone."""
    weight_bytes = step_weight_bytes(config, weights)
    got = run(config, weights, weight_bytes=weight_bytes)
    same = np.mean(np.asarray(got.pop("tokens")) == np.asarray(float_rec["tokens"]))
    return dict(scheme=weights.quant.name, weight_bytes=weight_bytes,
                weight_bytes_vs_float=weight_bytes / float_bytes,
                step_bytes=got["step_bytes"], step_ms=got["step_ms"],
                step_vs_float=got["step_ms"] / float_rec["step_ms"],
                weights_only_ms=products(weights),
                greedy_token_agreement_with_float=float(same), run=got)


def describe(q: dict[str, Any]) -> str:
    """One line of ``compare``'s record."""
    return (f"  {q['scheme']} weights: {q['weight_bytes'] / 1e6:.1f} MB "
            f"({q['weight_bytes_vs_float']:.3f}x the float bytes), step {q['step_ms']:.2f} ms "
            f"= {q['step_vs_float']:.2f}x float's; matrix products alone "
            f"{q['weights_only_ms']:.2f} ms; greedy tokens agree with float "
            f"{q['greedy_token_agreement_with_float']:.0%}")
