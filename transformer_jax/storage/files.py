"""File helpers: atomic writes of files and directories, JSON read with errors naming the file."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from transformer_jax import storage


def umask() -> int:
    """The process's umask, from ``/proc/self/status``, else set and restored (not atomic)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def default_mode(directory: bool = False) -> int:
    """The mode ``open``/``mkdir`` give a new file or directory (``tempfile``'s are private)."""
    return (0o777 if directory else 0o666) & ~umask()


def set_default_mode(path: str | os.PathLike[str]) -> None:
    """Gives a file or directory made by ``tempfile`` the mode ``open``/``mkdir`` would give."""
    os.chmod(path, default_mode(directory=os.path.isdir(path)))


@contextlib.contextmanager
def atomic_writer(path: Path) -> Iterator[IO[bytes]]:
    """Yields a binary file that replaces ``path`` (synced and renamed, with ``open``'s mode)
    only when the block finishes without error, so a crash never leaves a partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fchmod(f.fileno(), default_mode())
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def read_json(path: Path, what: str = "file") -> Any:
    """Parses a JSON file; ``what`` names it in the messages (e.g. ``"config"``).

    Raises:
      FileNotFoundError: no such file.
      ValueError: not UTF-8 JSON: ``<what> <path> is not valid JSON: <why> (line L, column C)``.
    """
    path = storage.as_path(path) if storage.is_remote(path) else Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} does not exist")
    try:
        return json.loads(path.read_bytes())
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} {path} is not valid JSON: {e.msg} (line {e.lineno}, column "
                         f"{e.colno})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} {path} is not valid JSON: not UTF-8 text (byte {e.start})"
                         ) from None


@contextlib.contextmanager
def replacing_directory(path: Path, carry_over: Callable[[str], bool] = lambda name: True
                        ) -> Iterator[Path]:
    """Yields an empty directory that replaces ``path`` when the block finishes without error,
    with the old entries the block did not write that ``carry_over(name)`` accepts linked or
    copied in; an error or a crash in the block leaves ``path`` as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    old: Path | None = None
    try:
        yield tmp
        set_default_mode(tmp)
        if path.exists():
            for entry in path.iterdir():
                target = tmp / entry.name
                if target.exists() or not carry_over(entry.name):
                    continue
                if entry.is_dir() and not entry.is_symlink():
                    shutil.copytree(entry, target, symlinks=True, copy_function=_link_or_copy)
                else:
                    _link_or_copy(entry, target)
            old = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.",
                                        suffix=".old"))
            os.replace(path, old)  # an empty directory is replaced atomically
        try:
            os.replace(tmp, path)
        except BaseException:
            if old is not None:
                os.replace(old, path)  # put the old one back
                old = None
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _link_or_copy(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """Hard-links ``src`` to ``dst``, or copies it (a symlink, another filesystem)."""
    if not os.path.islink(src):
        try:
            os.link(src, dst)
            return
        except OSError:
            pass
    shutil.copy2(src, dst, follow_symlinks=False)
