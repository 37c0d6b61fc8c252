"""Streaming tokens out of the compiled decode loop to a host callback, step by step: the
program holds only the callback's integer id, so a new callback does not recompile."""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator

import jax
import numpy as np

#: ``fn(step, tokens [B], active [B])``, called on the host after every decode step.
StreamFn = Callable[[int, np.ndarray, np.ndarray], None]

_STREAMS: dict[int, StreamFn] = {}
_STREAM_IDS = itertools.count(1)
_STREAM_LOCK = threading.Lock()


@contextlib.contextmanager
def registered(stream: StreamFn | None) -> Iterator[np.int32 | None]:
    """Registers ``stream`` for the duration of a generate call; yields its id (or None).

    On exit every callback of the call has run (``jax.effects_barrier``) and it is removed.
    """
    if stream is None:
        yield None
        return
    with _STREAM_LOCK:
        stream_id = next(_STREAM_IDS)
        _STREAMS[stream_id] = stream
    try:
        yield np.int32(stream_id)
        jax.effects_barrier()  # every stream callback has run before the caller returns
    finally:
        with _STREAM_LOCK:
            _STREAMS.pop(stream_id, None)


def _call(stream_id: np.ndarray, step: np.ndarray, tokens: np.ndarray,
          active: np.ndarray) -> None:
    callback = _STREAMS.get(int(stream_id))
    if callback is not None:
        callback(int(step), np.asarray(tokens), np.asarray(active))


def emit(stream_id: jax.Array, step: jax.Array, tokens: jax.Array, active: jax.Array,
         *, ordered: bool = True) -> None:
    """Inside the traced loop: sends one step's [B] tokens and [B] active flags to the host.

    ``ordered`` keeps the callbacks in program order; a program split over several devices
    cannot order effects, and there the loop's data dependence keeps the steps in order.
    """
    jax.debug.callback(_call, stream_id, step, tokens, active, ordered=ordered)
