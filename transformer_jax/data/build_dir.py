"""A shard build's hold on its ``--out`` directory: which directories it may build into, its
lock, and what a killed build left behind.

A build writes ``.build.json`` (inputs, options, tokenizer) and builds only into an empty
directory or its own (an unfinished one of other inputs is replaced), or any with ``overwrite``;
a ``flock`` refuses a second build at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from transformer_jax.storage.files import atomic_writer

logger = logging.getLogger(__name__)

FORMAT = "transformer_jax.shards"
METADATA = "metadata.json"
MARKER = ".build.json"

# The temporary names of the shard writers', ``atomic_writer``'s and ``replacing_directory``'s.
_TEMP_FILE = re.compile(r"\.(?:(?:train|val)-\d{5}\.arrayrecord\.tmp\d+"
                        r"|(?:(?:train|val)-\d{5}\.lengths\.npy|shard-\d{5}\.json"
                        r"|metadata\.json|\.build\.json)\.\w+\.tmp"
                        r"|tokenizer\.\w+\.(?:tmp|old))")


@contextlib.contextmanager
def locked(out: Path) -> Iterator[None]:
    """Holds an exclusive ``flock`` on the directory ``out`` for the block: the OS drops it
    when the process ends, so a build killed with SIGKILL never blocks the next one."""
    fd = os.open(out, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FileExistsError(f"--out {out}: another build is writing into it; wait for "
                                  "it to end or choose another --out") from None
        yield
    finally:
        os.close(fd)


def claim(out: Path, identity: dict[str, Any], overwrite: bool) -> None:
    """Makes ``out`` this build's (see the module docstring): refuses a directory that is not,
    writes ``.build.json`` and removes what killed builds left (their temporary files)."""
    try:
        marker = json.loads((out / MARKER).read_text())
        if not isinstance(marker, dict) or marker.get("format") != FORMAT:
            marker = None
    except (OSError, ValueError):
        marker = None
    entries = sorted(p.name for p in out.iterdir() if not _TEMP_FILE.fullmatch(p.name))
    if marker != identity and entries:
        finished = (out / METADATA).exists()
        if marker is None and not overwrite:
            shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more"
                                              if len(entries) > 5 else "")
            what = ("a shard build of an earlier version (no .build.json)" if _is_old_build(out)
                    else f"files that are not a shard build's ({shown})")
            raise FileExistsError(
                f"--out {out} holds {what}; pass --overwrite to build into it (metadata.json, "
                "tokenizer/ and the shard files are replaced, other files are kept)")
        if marker is not None and finished and not overwrite:
            raise FileExistsError(f"--out {out} holds a build of other {_changes(marker, identity)}"
                                  "; pass --overwrite to replace it")
        logger.info("building into %s, %s", out,
                    "replacing the build's own files" if overwrite else
                    f"replacing an unfinished build of other {_changes(marker, identity)}")
    if marker != identity:
        with atomic_writer(out / MARKER) as f:
            f.write(json.dumps(identity, indent=1, sort_keys=True).encode())
    for path in out.iterdir():  # of a build killed while it wrote (the lock is ours)
        if _TEMP_FILE.fullmatch(path.name):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()


def _is_old_build(out: Path) -> bool:
    """Whether ``out`` holds the ``metadata.json`` of a build made before ``.build.json``."""
    try:
        return json.loads((out / METADATA).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _changes(marker: dict[str, Any], identity: dict[str, Any]) -> str:
    """What differs between two builds' ``.build.json`` (``options (val_fraction 0.1 -> 0.3)``)."""
    said = []
    if marker.get("inputs") != identity["inputs"]:
        said.append(f"inputs ({', '.join(marker.get('inputs') or [])})")
    old = marker.get("options") if isinstance(marker.get("options"), dict) else {}
    changed = [f"{k} {old.get(k)!r} -> {v!r}" for k, v in identity["options"].items()
               if old.get(k) != v]
    if changed:
        said.append(f"options ({', '.join(changed)})")
    if marker.get("tokenizer") != identity["tokenizer"]:
        said.append("tokenizer")
    if marker.get("version") != identity["version"]:
        said.append(f"version ({marker.get('version')})")
    return " and ".join(said) or "settings"


__all__ = ["FORMAT", "MARKER", "METADATA", "claim", "locked"]
