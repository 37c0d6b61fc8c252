"""Train-state checkpoints with orbax: periodic, asynchronous, atomic, last K kept.

A checkpoint is one directory per step under the checkpoint directory, holding the whole train
state (parameters, optimizer state, step, RNG) and a small JSON ``meta`` item (configs, losses).
Orbax writes each step into a temporary directory and renames it only once every file is
complete, so a checkpoint that was being written when the process died is never listed, restored
or counted towards ``keep``. The data position needs no saving: batches are a pure function of
(seed, step).
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

logger = logging.getLogger(__name__)

STATE_ITEM = "state"
META_ITEM = "meta"


def ensure_writable_dir(directory: str | os.PathLike[str], what: str = "directory") -> Path:
    """Creates ``directory`` if needed and checks that files can be written in it.

    Checked up front so that an unwritable location fails at start-up, not at the first save
    minutes (or hours) into a run.

    Args:
      directory: the directory.
      what: what it is for, used in the error message.

    Returns:
      The absolute path.

    Raises:
      PermissionError: if the directory cannot be created or written to (also when a parent
        is a regular file).
    """
    path = Path(directory).expanduser().absolute()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as e:
        raise PermissionError(f"{what} {str(path)!r} is not writable: {e}") from e
    return path


class CheckpointManager:
    """Saves and restores train states in ``directory/<step>``, keeping the last ``keep``.

    Saves are asynchronous: ``save`` returns once the arrays are copied off the device and the
    files are written by a background thread; ``wait`` blocks until that is done.

    Args:
      directory: where the step directories go (created if missing).
      keep: how many of the most recent checkpoints to keep (>= 1).
      async_save: write in a background thread.
    """

    def __init__(self, directory: str | os.PathLike[str], *, keep: int = 3,
                 async_save: bool = True) -> None:
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be a positive int, got {keep!r}")
        self.directory = ensure_writable_dir(directory, "checkpoint directory")
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=async_save)
        self._manager = ocp.CheckpointManager(
            self.directory, options=options,
            item_handlers={STATE_ITEM: ocp.StandardCheckpointHandler(),
                           META_ITEM: ocp.JsonCheckpointHandler()})

    def all_steps(self) -> list[int]:
        """Steps of the checkpoints, ascending: the complete ones found on disk when this
        manager was created (temporary directories of interrupted saves excluded), plus the
        ones it saved since (the newest may still be being written; see ``wait``)."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None if there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def step_path(self, step: int) -> Path:
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
        """
        # One save in flight at a time; waiting first also lets orbax see the previous save
        # as complete when it picks the old checkpoints to delete.
        self._manager.wait_until_finished()
        if step in self.all_steps():
            return False
        args = ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardSave(state),
                                     META_ITEM: ocp.args.JsonSave(meta or {})})
        saved = self._manager.save(step, args=args, force=True)
        logger.debug("checkpoint of step %d started -> %s", step, self.step_path(step))
        return saved

    def restore(self, abstract_state: Any | None, step: int | None = None
                ) -> tuple[Any, dict[str, Any]]:
        """Reads a checkpoint into arrays shaped, typed and placed like ``abstract_state``.

        Args:
          abstract_state: a pytree of ``jax.ShapeDtypeStruct`` (with shardings) or arrays, of
            the same structure as the saved state; None reads the saved tree as it is (nested
            dicts of arrays on the first device, e.g. for inspection).
          step: which checkpoint; the latest complete one by default.

        Returns:
          ``(state, meta)``.

        Raises:
          FileNotFoundError: if there is no checkpoint (of that step).
        """
        self._manager.wait_until_finished()
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
            step = steps[-1]
        elif step not in steps:
            raise FileNotFoundError(f"no complete checkpoint of step {step} in {self.directory}; "
                                    f"available: {steps}")
        if abstract_state is None:
            # Whatever devices it was saved from, read it onto this process's first device.
            metadata = self._manager.item_metadata(step)[STATE_ITEM]
            abstract_state = jax.tree.map(
                lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), metadata,
                is_leaf=lambda m: hasattr(m, "shape") and hasattr(m, "dtype"))
        abstract_state = jax.tree.map(_as_abstract, abstract_state)
        args = ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardRestore(abstract_state),
                                     META_ITEM: ocp.args.JsonRestore()})
        restored = self._manager.restore(step, args=args)
        return restored[STATE_ITEM], dict(restored[META_ITEM] or {})

    def wait(self) -> None:
        """Blocks until the save in flight (if any) is complete on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for the save in flight and releases orbax's resources."""
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _as_abstract(x: Any) -> Any:
    if isinstance(x, jax.ShapeDtypeStruct):
        if x.sharding is None:
            # Without a sharding orbax cannot place the array; default to the first device.
            return jax.ShapeDtypeStruct(x.shape, x.dtype,
                                        sharding=jax.sharding.SingleDeviceSharding(
                                            jax.devices()[0]))
        return x
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    return x
