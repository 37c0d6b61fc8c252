"""Rematerialisation policies (``Execution.remat``): which named activations (``checkpoint_name``)
a block keeps for the backward pass, offloads to the host, or recomputes: ``none``, ``full``,
``save_qkv_proj``, ``save_dots_except_mlp``, ``save_dots_except_mlp_in``, ``save_dots`` and
the ``offload_*`` policies (saved in place on a CPU target)."""

from __future__ import annotations

import logging
from typing import Any

import jax

logger = logging.getLogger(__name__)

QUERY, KEY, VALUE = "query_proj", "key_proj", "value_proj"
#: Latent attention's compressed keys and values (and their rope part): its k/v projection.
KV_LATENT = "kv_latent"
#: The attention's output, before its output projection (MaxText's ``context``).
CONTEXT = "attn_context"
OUT = "out_proj"
MLP_GATE, MLP_UP, MLP_DOWN = "mlp_gate", "mlp_up", "mlp_down"
#: A mixture's routed experts: gate and up products, and the layer's combined output.
MOE_GATE, MOE_UP, MOE_OUT = "moe_gate", "moe_up", "moe_out"

QKV = (QUERY, KEY, VALUE, KV_LATENT)
ATTENTION = (*QKV, CONTEXT, OUT)
FFN_IN = (MLP_GATE, MLP_UP, MOE_GATE, MOE_UP)
NAMES = (*ATTENTION, MLP_GATE, MLP_UP, MLP_DOWN, MOE_GATE, MOE_UP, MOE_OUT)

#: Each named policy: (names saved in device memory, names offloaded to the host).
_NAMED: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "save_qkv_proj": (QKV, ()),
    "save_dots_except_mlp": (ATTENTION, ()),
    "save_dots_except_mlp_in": (tuple(n for n in NAMES if n not in FFN_IN), ()),
    "offload_qkv_proj": ((), QKV),
    "offload_dots": ((), NAMES),
}
#: ``model.remat``'s values, from the least memory kept to the most (offloading last).
REMATS = ("none", "full", "save_qkv_proj", "save_dots_except_mlp", "save_dots_except_mlp_in",
          "save_dots", "offload_qkv_proj", "offload_dots")

_warned: set[tuple[str, str]] = set()


def saved_names(remat: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(names kept in device memory, names offloaded) of a policy; () for those not by names."""
    return _NAMED.get(remat, ((), ()))


def policy(remat: str, platform: str) -> Any:
    """The ``jax.checkpoint`` policy of ``remat``.

    Args:
      remat, platform: one of ``REMATS`` but ``"none"``; the target's (on ``"cpu"`` an
        offloading policy keeps its names in device memory, logged once).

    Returns:
      The policy (None for ``"full"``: nothing saved).

    Raises:
      ValueError: an unknown policy.
    """
    if remat == "full":
        return None  # save nothing inside a block: recompute it all in the backward pass
    if remat == "save_dots":
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    if remat not in _NAMED:
        raise ValueError(f"remat must be one of {', '.join(REMATS[1:])}, got {remat!r}")
    saved, offloaded = _NAMED[remat]
    if offloaded and platform == "cpu":
        if (remat, platform) not in _warned:
            _warned.add((remat, platform))
            logger.info("remat=%s: a CPU's device memory is the host's, so its %s stay in "
                        "place (nothing to offload to)", remat, ", ".join(offloaded))
        saved, offloaded = (*saved, *offloaded), ()
    if not offloaded:
        return jax.checkpoint_policies.save_only_these_names(*saved)
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=list(saved), names_which_can_be_offloaded=list(offloaded),
        offload_src="device", offload_dst="pinned_host")
