"""Log-likelihood of token continuations, several requests packed into each row (best-fit
decreasing; ``segment_ids`` 1, 2, ... and ``positions`` restarting per request, so each sees
what it would alone). Shapes: B rows per forward, W slots per row, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.data.instruct import packed_layout
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.ops import softcap
from transformer_jax.model.ops.lm_loss import head_logits
from transformer_jax.model.transformer import Params, Transformer
from transformer_jax.parallel import sharding as sharding_lib

#: Rows are at least this many slots (short requests share them), at most the model's window.
MIN_ROW_LEN = 256


@dataclasses.dataclass(frozen=True)
class Request:
    """One sequence to score.

    Attributes:
      inputs: [n_in] the model's input ids (the window, without its last token).
      targets: [n_in] the next token of each input.
      n_scored: how many of the last targets count (the continuation), 1 <= n_scored <= n_in.
    """

    inputs: np.ndarray
    targets: np.ndarray
    n_scored: int


def window(context: Sequence[int], continuation: Sequence[int], max_length: int) -> Request:
    """The request of ``continuation`` after ``context`` in a window of ``max_length`` tokens:
    as the harness's ``hf`` backend, the last ``max_length + 1`` tokens of both. ValueError:
    an empty context or continuation, or a continuation over ``max_length``."""
    if not context or not continuation:
        raise ValueError(f"a request needs a context and a continuation, got {len(context)} and "
                         f"{len(continuation)} tokens")
    if len(continuation) > max_length:
        raise ValueError(f"a continuation of {len(continuation)} tokens does not fit the "
                         f"model's window of {max_length}")
    seq = np.asarray([*context, *continuation], np.int32)[-(max_length + 1):]
    return Request(seq[:-1], seq[1:], len(continuation))


def row_length(requests: Sequence[Request], max_length: int) -> int:
    """W: the longest request's length rounded up to a power of two, in [``MIN_ROW_LEN``,
    ``max_length``]."""
    longest = max(len(r.inputs) for r in requests)
    return min(max_length, max(MIN_ROW_LEN, 1 << (longest - 1).bit_length()))


@dataclasses.dataclass(frozen=True)
class PackedRequests:
    """Requests placed in rows.

    Attributes:
      inputs, targets, segment_ids, positions: [R, W] int32 (padding: id ``pad_id``,
        segment 0, position 0).
      placement: per request, ``(row, first slot)``.
    """

    inputs: np.ndarray
    targets: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray
    placement: list[tuple[int, int]]


def pack_requests(requests: Sequence[Request], row_len: int, pad_id: int = 0) -> PackedRequests:
    """Places the requests into rows of ``row_len`` slots (best-fit decreasing by length)."""
    lengths = [len(r.inputs) for r in requests]
    if max(lengths) > row_len:
        raise ValueError(f"a request of {max(lengths)} tokens does not fit rows of {row_len}")
    segment_ids, positions, placement = packed_layout(lengths, row_len)
    inputs = np.full(segment_ids.shape, pad_id, np.int32)
    targets = np.full(segment_ids.shape, pad_id, np.int32)
    for request, (r, start) in zip(requests, placement, strict=True):
        inputs[r, start:start + len(request.inputs)] = request.inputs
        targets[r, start:start + len(request.inputs)] = request.targets
    return PackedRequests(inputs, targets, segment_ids, positions, placement)


def token_scores(model: Transformer, params: Params, inputs: jax.Array, targets: jax.Array,
                 positions: jax.Array, segment_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each target's log-probability and whether it is the model's argmax (the LM head runs one
    row at a time: one row's [W, V] float32 logits at once).

    Args:
      model, params: the ``Transformer`` and its parameters.
      inputs, targets, positions, segment_ids: [B, W] int32 packed rows.

    Returns:
      ``(logprob [B, W] float32, greedy [B, W] bool)``.
    """
    hidden = model.apply({"params": params}, inputs, positions=positions,
                         segment_ids=segment_ids, hidden_only=True).hidden  # [B, W, D]
    head = model.lm_head(params)
    cap = model.config.final_softcap

    def row(args: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        x, t = args  # [W, D], [W]
        logits = head_logits(x, head)
        if cap is not None:
            logits = softcap(logits, cap)
        target = jnp.take_along_axis(logits, t[:, None], axis=-1)[:, 0]
        return target - jax.nn.logsumexp(logits, axis=-1), jnp.argmax(logits, axis=-1) == t

    return jax.lax.map(row, (hidden, targets))


class Scorer:
    """Scores requests with one model: packed rows, ``batch_size`` rows per forward.

    Args:
      config, params: the model's config and parameters (placed on ``mesh`` when given).
      batch_size: B, rows per forward (rounded up to a multiple of the mesh's batch axes).
      mesh: optional device mesh for the params; rows are split over ``data`` x ``fsdp``.
    """

    def __init__(self, config: ModelConfig, params: Params, *, batch_size: int = 8,
                 mesh: Any = None) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.config, self.params, self.mesh = config, params, mesh
        fn = functools.partial(token_scores, Transformer(config))
        if mesh is None:
            self.batch_size = batch_size
            self._fn: Callable[..., Any] = jax.jit(fn)
        else:
            split = mesh.shape["data"] * mesh.shape["fsdp"]
            self.batch_size = -(-batch_size // split) * split
            rows = sharding_lib.batch_sharding(mesh)
            self._fn = sharding_lib.jit_sharded(
                fn, mesh, (sharding_lib.param_shardings(config, mesh), rows, rows, rows, rows),
                sharding_lib.replicated(mesh))

    def score(self, requests: Sequence[Request], *, pad_id: int = 0,
              progress: Callable[[int], None] | None = None) -> list[tuple[float, bool]]:
        """``(sum of the scored targets' log-probabilities, all of them greedy)`` per request.

        Args:
          requests: the requests; each at most ``config.max_seq_len`` inputs.
          pad_id: id written into padding slots.
          progress: called with the number of requests finished after each forward.
        """
        if not requests:
            return []
        packed = pack_requests(requests, row_length(requests, self.config.max_seq_len), pad_id)
        vocab = self.config.vocab_size
        for name in ("inputs", "targets"):
            ids = getattr(packed, name)
            if ids.min() < 0 or ids.max() >= vocab:
                raise ValueError(f"request {name} hold ids outside [0, vocab_size={vocab}): "
                                 f"{ids.min()}..{ids.max()}")
        by_row: dict[int, list[int]] = {}
        for i, (row, _) in enumerate(packed.placement):
            by_row.setdefault(row, []).append(i)
        out: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
        num_rows, b = packed.inputs.shape[0], self.batch_size
        for first in range(0, num_rows, b):
            real = np.minimum(np.arange(first, first + b), num_rows - 1)  # repeats the last row
            arrays = [getattr(packed, k)[real] for k in ("inputs", "targets", "positions",
                                                         "segment_ids")]
            logprob, greedy = jax.device_get(self._fn(self.params, *arrays))
            done = 0
            for k, row in enumerate(range(first, min(first + b, num_rows))):
                for i in by_row[row]:
                    start = packed.placement[i][1]
                    n_in, n = len(requests[i].inputs), requests[i].n_scored
                    scored = slice(start + n_in - n, start + n_in)
                    out[i] = (float(np.sum(logprob[k, scored], dtype=np.float64)),
                              bool(np.all(greedy[k, scored])))
                    done += 1
            if progress is not None:
                progress(done)
        return out


__all__ = ["MIN_ROW_LEN", "PackedRequests", "Request", "Scorer", "pack_requests", "row_length",
           "token_scores", "window"]
