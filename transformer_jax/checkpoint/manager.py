"""Train-state checkpoints with orbax: periodic, asynchronous, atomic, last K kept.

One directory per step holds the whole train state (params, optimizer state, step, RNG) and a
small JSON ``meta`` item (configs, losses). Orbax writes a step into a temporary directory and
renames it once complete, so a save interrupted by a crash is never listed or restored. The data
position needs no saving: batches are a pure function of (seed, step). A step directory's files
(checksums, damage checks, setting aside) are ``checkpoint.files``'s.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import orbax.checkpoint as ocp

from transformer_jax import storage
from transformer_jax.checkpoint.files import CHECKSUMS_FILE as CHECKSUMS_FILE
from transformer_jax.checkpoint.files import (
    META_ITEM,
    STATE_ITEM,
    CheckpointError,
    DamagedCheckpointError,
    disk_steps,
    ensure_writable_dir,
    read_meta,
    set_aside,
    unfinished,
    write_checksums,
)
from transformer_jax.checkpoint.files import verify_checksums as verify_checksums
from transformer_jax.checkpoint.quiet import QuietOrbaxErrors, quiet_background_failures
from transformer_jax.checkpoint.read import CheckpointMismatchError as CheckpointMismatchError
from transformer_jax.checkpoint.read import (
    StepVanished,
    error_chain,
    read_params,
    read_state,
    reason,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")


class CheckpointManager:
    """Saves and restores train states in ``directory/<step>``, keeping the last ``keep``.

    ``save`` returns once the arrays are off the device; ``wait`` blocks until the files are
    written and summed (``CHECKSUMS.json``). A failed write surfaces from the next ``save``,
    ``wait`` or ``close`` as one ``CheckpointError``; earlier checkpoints are kept.

    Args:
      directory: where the step directories go (created if missing).
      keep: how many of the most recent checkpoints to keep (>= 1).
      async_save: write in a background thread.
      read_only: only read (``save`` raises; a damaged checkpoint is skipped, not moved).

    Raises:
      FileNotFoundError: ``read_only`` and the directory does not exist.
      PermissionError: not ``read_only`` and the directory cannot be created or written.
    """

    def __init__(self, directory: str | os.PathLike[str], *, keep: int = 3,
                 async_save: bool = True, read_only: bool = False) -> None:
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be a positive int, got {keep!r}")
        self.read_only = read_only
        self._manager: Any = None  # orbax's manager, which writes: not opened to read
        if read_only:
            self.directory = storage.as_path(directory)
            if not self.directory.is_dir():
                raise FileNotFoundError(f"checkpoint directory {self.directory} does not exist")
        else:
            self.directory = ensure_writable_dir(directory, "checkpoint directory")
            options = ocp.CheckpointManagerOptions(
                max_to_keep=keep, create=True, enable_async_checkpointing=async_save)
            self._manager = _retry_listing(lambda: ocp.CheckpointManager(
                self.directory, options=options,
                item_handlers={STATE_ITEM: ocp.StandardCheckpointHandler(),
                               META_ITEM: ocp.JsonCheckpointHandler()}))
        self._in_flight: int | None = None  # the step being written, until checked complete
        self._failed: CheckpointError | None = None
        self._failed_step: int | None = None
        self._abandoned = False
        self._quiet = QuietOrbaxErrors()
        logging.getLogger("absl").addFilter(self._quiet)

    def all_steps(self) -> list[int]:
        """Checkpoint steps, ascending: those on disk at creation plus those saved since (the
        newest may still be being written); read-only: the complete ones on disk now."""
        if self._manager is None:
            return disk_steps(self.directory)
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None if there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def step_path(self, step: int) -> Any:
        """The directory of the checkpoint of ``step``."""
        return self.directory / str(step)

    def save(self, step: int, state: Any, meta: dict[str, Any] | None = None) -> bool:
        """Starts saving ``state`` (any pytree of arrays) as the checkpoint of ``step``.

        Args:
          step: the step number (the directory name).
          state: the train state.
          meta: JSON-serialisable extra information stored alongside.

        Returns:
          True if a save was started, False if a checkpoint of this step already exists.

        Raises:
          CheckpointError: the previous save failed, or this one could not be started.
        """
        if self._manager is None:
            raise CheckpointError(f"could not write checkpoint {self.step_path(step)}: the "
                                  "manager was opened read-only")
        # One save in flight at a time (so orbax sees the previous one complete when rotating).
        self.wait()
        if step in self.all_steps():
            return False
        args = ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardSave(state),
                                     META_ITEM: ocp.args.JsonSave(meta or {})})
        quiet_background_failures()
        self._in_flight = step
        try:
            saved = self._manager.save(step, args=args, force=True)
        except Exception as e:
            raise self._write_failed(step, e) from None
        logger.debug("checkpoint of step %d started -> %s", step, self.step_path(step))
        return saved

    def wait(self) -> None:
        """Blocks until the save in flight (if any) is complete on disk and summed.

        Raises:
          CheckpointError: the save failed (``could not write checkpoint <path>: <cause>``).
        """
        if self._failed is not None:
            raise self._failed
        if self._manager is None:
            return
        step = self._in_flight
        try:
            self._manager.wait_until_finished()
            if step is not None:
                self._manager.check_for_errors()
        except Exception as e:
            raise self._write_failed(step, e) from None
        if step is not None:
            self._in_flight = None
            # The primary process sums the files (orbax has finalised the directory by now).
            if jax.process_index() == 0 and self.step_path(step).is_dir():
                try:
                    write_checksums(self.step_path(step))
                except OSError as e:
                    raise self._write_failed(step, e) from None

    def _write_failed(self, step: int | None, error: BaseException) -> CheckpointError:
        """The one error reported for a failed save, after removing its partial files."""
        path = self.step_path(step) if step is not None else self.directory
        disk_full = "No space left on device" in str(error) or any(
            getattr(e, "errno", None) == errno.ENOSPC for e in error_chain(error))
        why = os.strerror(errno.ENOSPC) if disk_full else reason(error)
        logger.debug("checkpoint save of %s failed", path, exc_info=error)
        self._failed_step = step
        self._remove_partial()
        self._in_flight = None
        self._failed = CheckpointError(f"could not write checkpoint {path}: {why}")
        return self._failed

    def _remove_partial(self, step: int | None = None) -> None:
        """Frees the space a failed (or abandoned) save took, its temporary directory; the
        committed checkpoints stay. ``step`` defaults to the failed save's."""
        step = self._failed_step if step is None else step
        if step is None:
            return
        # Orbax's threads may still recreate it: removed until gone for 3 polls (at most ~2 s).
        quiet = 0
        for _ in range(40):
            partials = [p for p in unfinished(self.directory)
                        if p.name.split(".", 1)[0] == str(step)]
            for partial in partials:
                storage.rmtree(partial)
            quiet = 0 if partials else quiet + 1
            if quiet >= 3:
                return
            time.sleep(0.05)

    def abandon(self) -> int | None:
        """Gives up the save in flight without waiting for it (a run aborted by a signal):
        removes its temporary directory; afterwards ``close`` neither waits nor raises.

        Returns:
          The step whose save was abandoned, or None if none was in flight.
        """
        self._abandoned = True
        step, self._in_flight = self._in_flight, None
        if step is not None:
            self._remove_partial(step)
        return step

    def remove_unfinished(self, primary: bool = True) -> list[str]:
        """Deletes the temporary directories of saves that never completed, before saving
        again. Every process calls it; the ``primary`` one deletes, all meet at a barrier.

        Returns:
          The names of the directories removed (logged).
        """
        removed = []
        for partial in unfinished(self.directory) if primary else ():
            storage.rmtree(partial)
            removed.append(partial.name)
        if removed:
            logger.info("removed the unfinished save%s %s in %s", "s" if len(removed) > 1 else "",
                        ", ".join(removed), self.directory)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("transformer_jax:remove_unfinished")
        if self._manager is not None and (removed or jax.process_count() > 1):
            _retry_listing(self._manager.reload)
        return removed

    def read_meta(self, step: int | None = None) -> dict[str, Any]:
        """The ``meta`` dict saved with a checkpoint (``save(..., meta=...)``); reads no array.

        Args:
          step: which checkpoint; by default the newest complete one whose meta is readable.

        Raises:
          FileNotFoundError: there is no checkpoint (of that step).
          DamagedCheckpointError: the meta of the given step is unreadable.
        """
        self.wait()
        return read_meta(self.directory, step)

    def restore(self, abstract_state: Any | None, step: int | None = None, *,
                quarantine: bool = True, attempts: int = 20) -> tuple[Any, dict[str, Any]]:
        """Reads a checkpoint into arrays shaped, typed and placed like ``abstract_state``.

        With ``step=None`` the newest intact checkpoint is read: a damaged newer one is warned
        of and (with ``quarantine``) renamed to ``<step>.damaged-<n>``; a vanishing one skipped.

        Args:
          abstract_state: a pytree of ``jax.ShapeDtypeStruct`` (with shardings) or arrays of the
            saved structure; None reads the saved tree as it is (on the first device).
          step: which checkpoint; the latest intact one by default.
          quarantine: rename damaged checkpoints aside (the run's owner); False only skips them.
          attempts: how many unreadable checkpoints to go past before giving up.

        Returns:
          ``(state, meta)``.

        Raises:
          FileNotFoundError: if there is no checkpoint (of that step).
          DamagedCheckpointError: the given ``step`` is damaged.
          CheckpointMismatchError: the saved state differs in structure or shapes.
          CheckpointError: every checkpoint is damaged (or kept vanishing).
        """
        return self._read_newest(lambda s: read_state(self.step_path(s), abstract_state), step,
                                 quarantine=quarantine and not self.read_only, attempts=attempts)

    def restore_params(self, abstract_params: Any | None = None, step: int | None = None, *,
                       attempts: int = 20) -> tuple[Any, dict[str, Any]]:
        """Reads only the ``params`` subtree of a saved train state (no optimizer moments).

        Damaged or vanishing checkpoints are skipped as by ``restore``, never renamed.

        Args:
          abstract_params: like ``restore``'s ``abstract_state``, for the params.
          step: which checkpoint; the latest intact one by default.
          attempts: how many unreadable checkpoints to go past before giving up.

        Returns:
          ``(params, meta)``.

        Raises:
          CheckpointMismatchError: the state has no ``params``; and the errors of ``restore``.
        """
        return self._read_newest(lambda s: read_params(self.step_path(s), abstract_params), step,
                                 quarantine=False, attempts=attempts)

    def _read_newest(self, read: Any, step: int | None, *, quarantine: bool, attempts: int
                     ) -> tuple[Any, dict[str, Any]]:
        self.wait()
        if step is not None:
            if step not in disk_steps(self.directory):
                raise FileNotFoundError(
                    f"no complete checkpoint of step {step} in {self.directory}; available: "
                    f"{disk_steps(self.directory)}")
            try:
                return read(step)
            except StepVanished:
                raise FileNotFoundError(f"checkpoint {self.step_path(step)} disappeared while "
                                        "it was being read") from None
        skipped: set[int] = set()
        problems: list[str] = []
        for _ in range(max(attempts, 1)):
            steps = [s for s in disk_steps(self.directory) if s not in skipped]
            if not steps:
                if quarantine:
                    break
                time.sleep(0.05)  # a live run may be between deleting one and writing the next
                continue
            step = steps[-1]
            try:
                result = read(step)
            except StepVanished:
                logger.info("checkpoint %s disappeared while being read; trying the newest "
                            "again", self.step_path(step))
                time.sleep(0.01)
                continue
            except DamagedCheckpointError as e:
                if not quarantine:
                    # A live run may be deleting it (files go one by one): not damage then.
                    time.sleep(0.05)
                    if not e.path.is_dir():
                        continue
                problems.append(f"step {step}: {e.reason}")
                skipped.add(step)
                if quarantine:
                    try:
                        aside = set_aside(e.path)
                    except OSError as rename_error:
                        logger.warning("%s; skipping it (could not move it aside: %s)", e,
                                       rename_error)
                    else:
                        logger.warning("%s; moved it to %s", e, aside.name)
                else:
                    logger.warning("%s; skipping it", e)
                continue
            if problems:
                logger.warning("restored the newest intact checkpoint %s", self.step_path(step))
            if quarantine:
                _retry_listing(self._manager.reload)  # forget the steps set aside
            return result
        if quarantine:
            _retry_listing(self._manager.reload)
        if not problems and not disk_steps(self.directory):
            raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
        raise CheckpointError(f"no intact checkpoint in {self.directory}: "
                              + ("; ".join(problems) or "they kept disappearing while read"))

    def close(self) -> None:
        """Waits for the save in flight and releases orbax's resources.

        Raises:
          CheckpointError: the save in flight failed (reported once).
        """
        if self._abandoned:
            return  # orbax's close would wait for the abandoned save's threads
        try:
            if self._failed is None:
                self.wait()
        finally:
            try:
                if self._manager is not None:
                    self._manager.close()
            except Exception as e:  # the failure was reported already
                if self._failed is None:
                    raise self._write_failed(None, e) from None
                logger.debug("orbax close after a failed save: %s", reason(e))
            finally:
                self._remove_partial()  # again: orbax's threads may have written more since
                if self._failed is None:  # else its threads may still log the failure
                    logging.getLogger("absl").removeFilter(self._quiet)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None and self._failed is not None:
            # The failed save is being raised already; don't raise it a second time.
            with contextlib.suppress(CheckpointError):
                self.close()
            return
        self.close()


def _retry_listing(fn: Callable[[], T], tries: int = 20) -> T:
    """Runs ``fn`` (which lists the steps) again while a step vanishes meanwhile (a live run)."""
    for _ in range(tries - 1):
        try:
            return fn()
        except (FileNotFoundError, NotADirectoryError):
            time.sleep(0.02)
    return fn()
