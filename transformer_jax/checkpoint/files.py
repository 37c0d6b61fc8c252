"""A checkpoint's step directory on disk: its layout, checksums, damage checks and quarantine.

Plain file operations, no orbax. ``write_checksums`` records each committed file's size and
SHA-256; ``check_step_files`` compares them before a restore, so a truncated or bit-flipped
checkpoint is a ``DamagedCheckpointError`` naming the file, which ``set_aside`` renames.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from transformer_jax import storage
from transformer_jax.storage.files import atomic_writer

logger = logging.getLogger(__name__)

# Items of a step directory: ``<step>/state`` (the train state) and ``<step>/meta`` (JSON).
STATE_ITEM = "state"
META_ITEM = "meta"
CHECKSUMS_FILE = "CHECKSUMS.json"
_STEP_METADATA = "_CHECKPOINT_METADATA"
# Marks a complete step on object storage (no atomic rename of ``*.orbax-checkpoint-tmp*``).
COMMIT_FILE = "commit_success.txt"


def ensure_writable_dir(directory: str | os.PathLike[str], what: str = "directory") -> Any:
    """Creates ``directory`` if needed and checks that files can be written in it (at start-up,
    not at the first save); a remote URL is returned as an ``epath.Path`` without a probe.

    Args:
      directory: the directory, local or remote.
      what: what it is for, used in the error message.

    Returns:
      The absolute local path, or the remote ``epath.Path``.

    Raises:
      PermissionError: if the directory cannot be created or written to.
    """
    if storage.is_remote(directory):
        logger.debug("%s %s is on object storage: not probed for writability", what, directory)
        return storage.as_path(directory)
    path = Path(directory).expanduser().absolute()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as e:
        raise PermissionError(f"{what} {str(path)!r} is not writable: {e}") from e
    return path


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message is one line naming the path."""


class DamagedCheckpointError(CheckpointError):
    """A checkpoint directory exists but is unreadable (missing, truncated or altered files).

    Attributes:
      path: the step directory.
      reason: what is wrong, one line.
    """

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"checkpoint {path} is damaged: {reason}")
        self.path, self.reason = path, reason


def write_checksums(step_dir: Path) -> None:
    """Records the size and SHA-256 of every file of a complete step directory (not on object
    storage, which keeps each object's CRC32C itself)."""
    if not isinstance(step_dir, Path):
        return
    sums = {str(f.relative_to(step_dir)): [f.stat().st_size, _sha256(f)]
            for f in sorted(step_dir.rglob("*"))
            # (not a file ``atomic_writer`` has yet to rename into place, ``.NAME.XXXX.tmp``)
            if f.is_file() and f.name != CHECKSUMS_FILE
            and not (f.name.startswith(".") and f.name.endswith(".tmp"))}
    with atomic_writer(step_dir / CHECKSUMS_FILE) as out:
        out.write(json.dumps(sums, indent=0).encode())


def verify_checksums(step_dir: Path) -> None:
    """Checks the files of a step directory against its ``CHECKSUMS.json``, if it has one.

    Raises:
      DamagedCheckpointError: a file is missing or has another size or content.
      FileNotFoundError: the directory itself is gone.
    """
    file = step_dir / CHECKSUMS_FILE
    if not step_dir.is_dir():
        raise FileNotFoundError(step_dir)
    if not file.is_file():
        return
    try:
        sums = json.loads(file.read_bytes())
        items = [(str(k), int(v[0]), str(v[1])) for k, v in sums.items()]
    except (ValueError, TypeError, IndexError, AttributeError) as e:
        raise DamagedCheckpointError(step_dir, f"{CHECKSUMS_FILE} is unreadable ({e})") from None
    for name, size, digest in items:
        f = step_dir / name
        if not f.is_file():
            raise DamagedCheckpointError(step_dir, f"{name} is missing")
        if (found := storage.size(f)) != size:
            raise DamagedCheckpointError(
                step_dir, f"{name} has {found} bytes, {size} were written (truncated?)")
        if _sha256(f) != digest:
            raise DamagedCheckpointError(step_dir, f"{name} differs from what was written "
                                                   "(checksum mismatch)")


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def check_step_files(step_dir: Path) -> None:
    """Checks a committed step's files against ``CHECKSUMS.json`` (if written), and its orbax
    metadata and ``meta`` item, before orbax reads any of it.

    Raises:
      DamagedCheckpointError: a file is missing, unreadable or differs from its checksum.
      FileNotFoundError: the directory itself is gone (or went while being checked).
    """
    verify_checksums(step_dir)
    for name in (_STEP_METADATA, f"{STATE_ITEM}/_METADATA"):
        if not (step_dir / name).is_file():
            raise DamagedCheckpointError(step_dir, f"{name} is missing")
        try:
            json.loads((step_dir / name).read_bytes())
        except ValueError as e:
            raise DamagedCheckpointError(step_dir, f"{name} is not valid JSON ({e})") from None
    read_meta_file(step_dir)


def read_meta_file(step_dir: Path) -> dict[str, Any]:
    """The ``meta`` dict stored with a step (``CheckpointManager.save(..., meta=...)``).

    Raises:
      FileNotFoundError: the step directory is gone.
      DamagedCheckpointError: its ``meta/metadata`` is missing, not JSON or not an object.
    """
    file = step_dir / META_ITEM / "metadata"
    if not step_dir.is_dir():
        raise FileNotFoundError(f"no checkpoint {step_dir}")
    try:
        meta = json.loads(file.read_bytes())
    except FileNotFoundError:
        if not step_dir.is_dir():
            raise
        raise DamagedCheckpointError(step_dir, f"{META_ITEM}/metadata is missing") from None
    except ValueError as e:
        raise DamagedCheckpointError(step_dir, f"{META_ITEM}/metadata is not valid JSON "
                                               f"({e})") from None
    if not isinstance(meta, dict):
        raise DamagedCheckpointError(step_dir, f"{META_ITEM}/metadata is not a JSON object")
    return meta


def read_meta(directory: Path, step: int | None = None) -> dict[str, Any]:
    """The ``meta`` of checkpoint ``step`` in ``directory`` (default: the newest readable
    one); file reads only, so it may run before ``jax.distributed.initialize``.

    Raises:
      FileNotFoundError: there is no checkpoint (of that step).
      DamagedCheckpointError: the meta of the given step is unreadable.
      CheckpointError: no checkpoint has a readable meta (each one's problem named).
    """
    if step is not None:
        return read_meta_file(directory / str(step))
    steps = disk_steps(directory)
    if not steps:
        raise FileNotFoundError(f"no complete checkpoint in {directory}")
    errors = []
    for s in reversed(steps):
        try:
            return read_meta_file(directory / str(s))
        except (DamagedCheckpointError, FileNotFoundError) as e:
            errors.append(str(e))
    raise CheckpointError(f"no checkpoint in {directory} has a readable meta: "
                          + "; ".join(errors))


def disk_steps(directory: Path) -> list[int]:
    """Committed steps on disk now: directories named by an integer (on object storage, those
    holding ``commit_success.txt``)."""
    storage.forget_listings(directory)  # another process may have written a step since
    try:
        return sorted(int(p.name) for p in directory.iterdir()
                      if p.name.isdigit() and p.is_dir() and is_committed(p))
    except FileNotFoundError:
        return []


def is_committed(step_dir: Path) -> bool:
    """Whether orbax finished writing a step directory (named by its step)."""
    return isinstance(step_dir, Path) or (step_dir / COMMIT_FILE).exists()


def unfinished(directory: Path) -> list[Any]:
    """The directories of saves that never completed: ``*.orbax-checkpoint-tmp*`` on a file
    system; on object storage, step directories without ``commit_success.txt``."""
    if isinstance(directory, Path):
        return [p for p in sorted(directory.glob("*.orbax-checkpoint-tmp*")) if p.is_dir()]
    storage.forget_listings(directory)
    try:
        return [p for p in sorted(directory.iterdir(), key=lambda p: p.name)
                if p.name.isdigit() and p.is_dir() and not is_committed(p)]
    except FileNotFoundError:
        return []


def set_aside(step_dir: Path) -> Path:
    """Renames a damaged step directory to ``<step>.damaged-<n>`` (first free n)."""
    n = 1
    while (aside := step_dir.with_name(f"{step_dir.name}.damaged-{n}")).exists():
        n += 1
    step_dir.rename(aside)
    return aside
