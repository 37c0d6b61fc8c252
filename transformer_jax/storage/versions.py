"""What says a remote object and a local file hold the same bytes, without trusting sizes.

A retrained model has the same shapes, so its files have the same sizes as the last one's: a
size says nothing about the content. Two kinds of evidence are used instead:

* **An object's version**, from the listing fsspec gives (``ls(detail=True)`` / ``find``):
  GCS's ``generation`` (new on every write) with its ``crc32c`` / ``md5Hash``, or the
  ``ETag`` / ``etag`` other stores give. ``local_copy`` keeps a cached file only while the
  object's version is the one recorded when that file was fetched. A filesystem whose listing
  has none of these (fsspec's ``memory://``, whose ``created`` time is not a version) has its
  files fetched again on every copy.
* **A content hash**, for uploads: ``push`` skips a file only when the remote object's
  recorded CRC32C (or MD5) equals the local file's, computed from its bytes; a remote that
  records no hash gets every file again.

The record of what was fetched lives beside the cached directory (not in it: the directory is
uploaded and listed as the remote one's copy), one entry per file: the object's version and the
local file's size, modification time and inode as they were just after it was renamed into
place. The entry is written after the file, so a copy killed in between leaves an entry that
no longer matches the file (another inode): the file is fetched again.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# Listing fields that change whenever an object's content does: GCS (gcsfs), S3 (s3fs),
# Azure (adlfs), the HF hub.
VERSION_FIELDS = ("generation", "crc32c", "md5Hash", "ETag", "etag", "blob_id")
_CHUNK = 1 << 22


def object_version(info: dict[str, Any]) -> str | None:
    """A string that changes whenever the object an fsspec listing entry describes is
    rewritten (its size and every version field the filesystem gives), or None if the
    entry has no version field (then nothing cached may be trusted)."""
    fields = {k: str(info[k]) for k in VERSION_FIELDS if info.get(k) not in (None, "")}
    if not fields:
        return None
    fields["size"] = str(int(info.get("size") or 0))
    return json.dumps(fields, sort_keys=True)


def stamp(file: Path) -> list[int]:
    """The local file as it is now: size, modification time (ns) and inode."""
    st = file.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def _digest(file: Path, hasher: Any) -> str:
    with open(file, "rb") as f:
        while chunk := f.read(_CHUNK):
            hasher.update(chunk)
    return base64.b64encode(hasher.digest()).decode("ascii")


def crc32c(file: Path) -> str | None:
    """A file's CRC32C as GCS records it (base64 of the big-endian 4 bytes), or None where
    ``google-crc32c`` (a dependency of gcsfs) is not installed."""
    try:
        import google_crc32c
    except ImportError:
        return None
    return _digest(file, google_crc32c.Checksum())


def md5(file: Path) -> str:
    """A file's MD5 as GCS records it (``md5Hash``: base64 of the digest)."""
    return _digest(file, hashlib.md5(usedforsecurity=False))


def same_content(file: Path, info: dict[str, Any]) -> bool:
    """Whether a local file holds the bytes of the remote object ``info`` (an fsspec listing
    entry) describes, by the content hash the remote recorded: CRC32C, else MD5. False when
    the sizes differ or the remote records no hash (nothing proves them equal)."""
    if info.get("size") is None or int(info["size"]) != file.stat().st_size:
        return False
    if info.get("crc32c") and (local_crc := crc32c(file)) is not None:
        return local_crc == info["crc32c"]
    return bool(info.get("md5Hash")) and md5(file) == info["md5Hash"]


def records_file(local: Path) -> Path:
    """Where the record of a cached directory's fetched files is kept: beside it."""
    return local.parent / f".{local.name}.versions.json"


def read_records(local: Path) -> dict[str, list[Any]]:
    """``{relative name: [object version, *stamp]}`` of the files fetched into ``local``; an
    unreadable or damaged record is an empty one (everything is fetched again)."""
    try:
        records = json.loads(records_file(local).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(records, dict):
        return {}
    return {k: v for k, v in records.items() if isinstance(v, list) and len(v) == 4}


def write_records(local: Path, records: dict[str, list[Any]]) -> None:
    """Replaces the record of ``local`` atomically (a temporary file renamed over it)."""
    path = records_file(local)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f"{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(records, f, sort_keys=True)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def is_fresh(file: Path, version: str | None, record: list[Any] | None) -> bool:
    """Whether a cached file may be used for an object of ``version``: the object has a
    version, it is the one recorded when the file was fetched, and the file is still the one
    fetched then (same size, modification time and inode)."""
    if version is None or record is None or not file.is_file():
        return False
    return record == [version, *stamp(file)]


__all__ = ["VERSION_FIELDS", "crc32c", "is_fresh", "md5", "object_version", "read_records",
           "records_file", "same_content", "stamp", "write_records"]
