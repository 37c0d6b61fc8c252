"""Runs a command with some directories read-only, as on a read-only mount (a test helper).

The tests run as root, for whom ``chmod`` stops no write. So the command runs in a new user and
mount namespace (``unshare -rm``) in which each directory is bind-mounted onto itself
read-only: every write below it fails with ``EROFS``, as on a read-only filesystem, while the
rest of the filesystem stays writable. Where namespaces are not allowed, a non-root user gets the
directories ``chmod``-ed read-only instead (writes fail with ``EACCES``); root without
namespaces cannot be stopped from writing, and ``mode()`` is None (the tests skip).
"""

from __future__ import annotations

import functools
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

# $1 = how many directories follow; each is bind-mounted read-only onto itself, then the rest
# of the arguments is run.
_MOUNT_SCRIPT = ('n=$1; shift; while [ "$n" -gt 0 ]; do mount --bind -o ro "$1" "$1" || exit 97; '
                 'shift; n=$((n - 1)); done; exec "$@"')


@functools.cache
def mode() -> str | None:
    """``"mount"`` (read-only bind mounts in a namespace), ``"chmod"`` (non-root) or None."""
    if shutil.which("unshare") and shutil.which("mount"):
        with tempfile.TemporaryDirectory() as tmp:
            probe = subprocess.run(["unshare", "-rm", "sh", "-c", _MOUNT_SCRIPT, "sh", "1", tmp,
                                    "sh", "-c", f"! touch {tmp}/probe 2>/dev/null"],
                                   capture_output=True, timeout=60)
            if probe.returncode == 0 and not os.path.exists(f"{tmp}/probe"):
                return "mount"
    if os.geteuid() != 0:
        return "chmod"
    return None


def run(directories: Sequence[Path], argv: Sequence[str], **kwargs) -> subprocess.CompletedProcess:
    """Runs ``argv`` with ``directories`` (and everything below them) read-only.

    Args:
      directories: existing directories.
      argv: the command.
      **kwargs: for ``subprocess.run`` (``capture_output=True, text=True`` by default).

    Raises:
      RuntimeError: ``mode()`` is None (check it first and skip).
    """
    kwargs = {"capture_output": True, "text": True, **kwargs}
    how = mode()
    if how == "mount":
        return subprocess.run(["unshare", "-rm", "sh", "-c", _MOUNT_SCRIPT, "sh",
                               str(len(directories)), *map(str, directories), *argv], **kwargs)
    if how == "chmod":
        saved = _chmod_read_only(directories)
        try:
            return subprocess.run(list(argv), **kwargs)
        finally:
            for path, mode_bits in saved:
                os.chmod(path, mode_bits)
    raise RuntimeError("no way to make a directory read-only here")


def _chmod_read_only(directories: Sequence[Path]) -> list[tuple[Path, int]]:
    saved = []
    for top in directories:
        for path in [top, *Path(top).rglob("*")]:
            if path.is_symlink():
                continue
            bits = path.stat().st_mode
            saved.append((path, stat.S_IMODE(bits)))
    for path, bits in saved:
        os.chmod(path, bits & ~0o222)
    return saved[::-1]
