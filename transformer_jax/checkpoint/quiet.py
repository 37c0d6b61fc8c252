"""Keeps the echoes of orbax's failed background saves off stderr and out of the log.

A failed save is raised once, as one ``CheckpointError`` line; what orbax, asyncio and Python
print about it from background threads goes to DEBUG level of ``transformer_jax.checkpoint``.
"""

from __future__ import annotations

import logging
import re
import sys
import traceback
from typing import Any

from transformer_jax.checkpoint.read import error_chain

logger = logging.getLogger("transformer_jax.checkpoint")


class QuietOrbaxErrors(logging.Filter):
    """Moves orbax's error records with tracebacks (of failed background saves) to DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        if (record.levelno >= logging.ERROR and record.exc_info
                and "orbax" in record.pathname):
            logger.debug("orbax: %s", record.getMessage(), exc_info=record.exc_info)
            return False
        return True


class _QuietAsyncioErrors(logging.Filter):
    """Moves asyncio's "exception was never retrieved" of orbax/TensorStore errors to DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        if ("exception was never retrieved" not in str(record.msg) or not record.exc_info
                or not _from_writer(record.exc_info[1])):
            return True
        logger.debug("asyncio: %s", record.getMessage(), exc_info=record.exc_info)
        return False


def _from_writer(error: BaseException | None) -> bool:
    """Whether an error comes from orbax or TensorStore (a frame of theirs, or a TensorStore
    status such as ``RESOURCE_EXHAUSTED: ...``)."""
    for e in error_chain(error) if error is not None else ():
        files = (frame.f_code.co_filename for frame, _ in traceback.walk_tb(e.__traceback__))
        if re.match(r"[A-Z_]{5,}: ", str(e)) or any(
                re.search(r"[/\\](orbax|tensorstore)[/\\]", file) for file in files):
            return True
    return False


def quiet_background_failures() -> None:
    """Keeps the echoes of a failed background save off stderr (idempotent): the unraisable
    ``Event loop is closed`` of late TensorStore writes and asyncio's never-retrieved errors."""
    hook = sys.unraisablehook
    if getattr(hook, "quiets_orbax", False):
        return

    def unraisable_hook(unraisable: Any) -> None:
        # asyncio's "Event loop is closed" from call_soon_threadsafe: a TensorStore write of a
        # failed (or abandoned) save finishing after orbax closed its loop.
        error = unraisable.exc_value
        if (isinstance(error, RuntimeError) and str(error) == "Event loop is closed"
                and any(frame.f_code.co_name == "call_soon_threadsafe"
                        for frame, _ in traceback.walk_tb(unraisable.exc_traceback))):
            logger.debug("after a failed save: %s (a TensorStore write completed after orbax "
                         "stopped waiting)", error)
            return
        hook(unraisable)

    unraisable_hook.quiets_orbax = True  # type: ignore[attr-defined]
    sys.unraisablehook = unraisable_hook
    asyncio_logger = logging.getLogger("asyncio")
    if not any(isinstance(f, _QuietAsyncioErrors) for f in asyncio_logger.filters):
        asyncio_logger.addFilter(_QuietAsyncioErrors())
