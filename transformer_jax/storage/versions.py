"""Whether a remote object and a local file hold the same bytes, sizes not trusted: the version
recorded with the file's ``stamp`` (``local_copy``), or the remote's CRC32C or MD5 (``push``)."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

# Listing fields that change with an object's content: GCS, S3, Azure, the HF hub.
VERSION_FIELDS = ("generation", "crc32c", "md5Hash", "ETag", "etag", "blob_id")
_CHUNK = 1 << 22


def object_version(info: dict[str, Any]) -> str | None:
    """A string that changes whenever the object of an fsspec listing entry is rewritten, or
    None when it has no version field."""
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
    """Whether a local file holds the bytes of the object of the listing entry ``info``, by the
    hash the remote recorded (CRC32C, else MD5); False when sizes differ or there is no hash."""
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
    """Whether a cached file may be used for an object of ``version``: it is the version
    recorded when the file was fetched, and the file has the same size, mtime and inode."""
    if version is None or record is None or not file.is_file():
        return False
    return record == [version, *stamp(file)]


__all__ = ["VERSION_FIELDS", "crc32c", "is_fresh", "md5", "object_version", "read_records",
           "records_file", "same_content", "stamp", "write_records"]
