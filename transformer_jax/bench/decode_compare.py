"""``bench decode``'s comparisons (``decode.py``): the same point with quantised weights
(``--quant``), and on a mixture-of-experts config the expert bytes a step reads (it gathers
min(B*k, E) of the E experts when B*k <= E) and its time against a dense twin of the same
active parameters (every FFN dense of width ``k * moe.d_ff + moe.shared_d_ff``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from transformer_jax.decode import loop as decode
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.ops.moe import choose_impl
from transformer_jax.model.quant_spec import is_expert_stack
from transformer_jax.model.transformer import init_params


def step_weight_bytes(config: ModelConfig, weights: decode.DecodeWeights) -> int:
    """Bytes of weights a step reads (quantised values and scales included): all of them, but
    of an untied embedding table only B rows."""
    table = [] if config.tie_embeddings else jax.tree.leaves(weights.params["embed"])
    return weights.nbytes - sum(x.nbytes for x in table)


def compare_quant(config: ModelConfig, weights: decode.DecodeWeights,
                  float_rec: dict[str, Any], float_bytes: int, run: Callable[..., dict[str, Any]],
                  products: Callable[[decode.DecodeWeights], float]) -> dict[str, Any]:
    """The point ``run(config, weights, weight_bytes=...)`` with quantised ``weights`` against
    the float run ``float_rec`` (its tokens still in it), and its matrix products alone."""
    weight_bytes = step_weight_bytes(config, weights)
    got = run(config, weights, weight_bytes=weight_bytes)
    same = np.mean(np.asarray(got.pop("tokens")) == np.asarray(float_rec["tokens"]))
    return dict(scheme=weights.quant.name, weight_bytes=weight_bytes,
                weight_bytes_vs_float=weight_bytes / float_bytes, step_bytes=got["step_bytes"],
                step_ms=got["step_ms"], step_vs_float=got["step_ms"] / float_rec["step_ms"],
                weights_only_ms=products(weights),
                greedy_token_agreement_with_float=float(same), run=got)


def expert_bytes(weights: decode.DecodeWeights) -> tuple[int, int]:
    """(bytes of every expert stack, bytes of the shared experts), quantised scales included."""
    experts = shared = 0
    for path, x in jax.tree_util.tree_flatten_with_path(weights.params)[0]:
        keys = [str(getattr(p, "key", getattr(p, "name", p))) for p in path]
        # A quantised weight's leaves sit under its name (``.../moe/gate/packed``).
        if any(is_expert_stack(keys[:j]) for j in range(len(keys), 1, -1)):
            experts += x.nbytes
        elif "shared" in keys and "moe" in keys:
            shared += x.nbytes
    return experts, shared


def compare_moe(config: ModelConfig, weights: decode.DecodeWeights, moe_rec: dict[str, Any],
                batch: int, run: Callable[..., dict[str, Any]]) -> dict[str, Any]:
    """The expert bytes of a step at ``batch`` and the dense twin's point ``run(twin_config,
    twin_weights, weight_bytes=...)`` against the mixture's ``moe_rec``."""
    m = config.moe
    experts, shared = expert_bytes(weights)
    taken = min(batch * m.top_k, m.n_experts)
    impl = choose_impl("auto", batch, m.top_k, m.n_experts, widths=(config.d_model, m.d_ff))
    # Gathering reads the taken experts' bytes; any other impl reads every expert.
    read = (experts * taken // m.n_experts if impl == "gather" else experts) + shared
    twin = config.replace(moe=None, d_ff=m.top_k * m.d_ff + m.shared_d_ff)  # k F + F_shared
    twin_weights = decode.prepare(twin, jax.jit(init_params, static_argnums=0)(
        twin, jax.random.key(0)), weights.mesh,
        quant=None if weights.quant is None else weights.quant.name)
    twin_bytes = step_weight_bytes(twin, twin_weights)
    got = run(twin, twin_weights, weight_bytes=twin_bytes)
    return dict(
        n_experts=m.n_experts, top_k=m.top_k, expert_d_ff=m.d_ff, shared_d_ff=m.shared_d_ff,
        impl=impl, expert_bytes_all=experts + shared, expert_bytes_read=read,
        read_fraction=read / (experts + shared),
        bound_fraction=(taken * experts / m.n_experts + shared) / (experts + shared),
        dense_d_ff=twin.d_ff, dense_weight_bytes=twin_bytes, dense_step_ms=got["step_ms"],
        moe_step_ms=moe_rec["step_ms"], step_vs_dense=moe_rec["step_ms"] / got["step_ms"])
