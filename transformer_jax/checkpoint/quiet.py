"""Keeps the echoes of orbax's failed background saves off stderr and out of the log.

A failed save is raised once, as one ``CheckpointError`` line (``checkpoint.CheckpointManager``);
what orbax, asyncio and Python print about the same failure from background threads (absl error
records with tracebacks, futures whose error nobody retrieved, the unraisable ``Event loop is
closed`` of every TensorStore write still in flight) goes to DEBUG level of
``transformer_jax.checkpoint`` instead.
"""

from __future__ import annotations

import logging
import re
import sys
from typing import Any

from transformer_jax.checkpoint.read import error_chain

logger = logging.getLogger("transformer_jax.checkpoint")


class QuietOrbaxErrors(logging.Filter):
    """Keeps orbax's tracebacks of failed background saves out of the log (each save error is
    raised once by ``CheckpointManager`` as a one-line ``CheckpointError``; the tracebacks are
    kept at DEBUG level of the ``transformer_jax.checkpoint`` logger)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if (record.levelno >= logging.ERROR and record.exc_info
                and "orbax" in record.pathname):
            logger.debug("orbax: %s", record.getMessage(), exc_info=record.exc_info)
            return False
        return True


class _QuietAsyncioErrors(logging.Filter):
    """Drops asyncio's "Future/Task exception was never retrieved" for orbax's or TensorStore's
    errors (the writes of a failed save that nobody awaits any more); kept at DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "exception was never retrieved" not in str(record.msg) or not record.exc_info:
            return True
        if not _from_writer(record.exc_info[1]):
            return True
        logger.debug("asyncio: %s", record.getMessage(), exc_info=record.exc_info)
        return False


def _from_writer(error: BaseException | None) -> bool:
    """Whether an error comes from orbax or TensorStore (a frame of theirs, or a TensorStore
    status such as ``RESOURCE_EXHAUSTED: ...``)."""
    for e in error_chain(error) if error is not None else ():
        if re.match(r"[A-Z_]{5,}: ", str(e)):
            return True
        tb = e.__traceback__
        while tb is not None:
            if re.search(r"[/\\](orbax|tensorstore)[/\\]", tb.tb_frame.f_code.co_filename):
                return True
            tb = tb.tb_next
    return False


def _is_closed_loop_callback(unraisable: Any) -> bool:
    """asyncio's ``RuntimeError: Event loop is closed`` from ``call_soon_threadsafe``: a
    TensorStore write of a failed (or abandoned) save finishing after orbax closed the event loop
    that awaited it (one per array still being written)."""
    error = unraisable.exc_value
    if not isinstance(error, RuntimeError) or str(error) != "Event loop is closed":
        return False
    tb = unraisable.exc_traceback
    while tb is not None:
        if tb.tb_frame.f_code.co_name == "call_soon_threadsafe":
            return True
        tb = tb.tb_next
    return False


def quiet_background_failures() -> None:
    """Keeps the echoes of a failed background save off stderr, for this process (idempotent).

    When a write fails (a full disk), orbax stops awaiting the save's other TensorStore writes;
    as each of them completes, its callback finds the event loop closed and Python prints that
    as an unraisable exception (tens of tracebacks), and asyncio may log futures whose error was
    never retrieved. The failure itself is raised once, as one ``CheckpointError`` line; these
    echoes are logged at DEBUG level of this module's logger instead.
    """
    hook = sys.unraisablehook
    if getattr(hook, "quiets_orbax", False):
        return

    def unraisable_hook(unraisable: Any) -> None:
        if _is_closed_loop_callback(unraisable):
            logger.debug("after a failed save: %s (a TensorStore write completed after orbax "
                         "stopped waiting)", unraisable.exc_value)
            return
        hook(unraisable)

    unraisable_hook.quiets_orbax = True  # type: ignore[attr-defined]
    sys.unraisablehook = unraisable_hook
    asyncio_logger = logging.getLogger("asyncio")
    if not any(isinstance(f, _QuietAsyncioErrors) for f in asyncio_logger.filters):
        asyncio_logger.addFilter(_QuietAsyncioErrors())
