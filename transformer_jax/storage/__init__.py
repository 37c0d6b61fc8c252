"""Object storage: which paths are remote, and moving files between them and local disk.

A path with a scheme other than ``file://`` (``gs://bucket/run``) is remote: fsspec and
``etils.epath``, never ``pathlib`` or ``os``. Directories read whole are cached by
``local_copy`` (``cache_dir``), those written whole uploaded by ``push`` (docs/training.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

from transformer_jax.storage import versions

logger = logging.getLogger(__name__)

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_remote(path: str | os.PathLike[str] | Any) -> bool:
    """True for a URL with a scheme other than ``file://`` (``gs://b/x``, ``s3://...``)."""
    text = os.fspath(path) if isinstance(path, (str, os.PathLike)) else str(path)
    return bool(_SCHEME.match(text)) and not text.startswith("file://")


def as_path(path: str | os.PathLike[str]) -> Any:
    """A path object for ``path``: an ``etils.epath.Path`` for a remote URL (what orbax
    takes), else an absolute ``pathlib.Path`` (``~`` expanded, a ``file://`` prefix dropped)."""
    if is_remote(path):
        from etils import epath

        return epath.Path(os.fspath(path) if not isinstance(path, str) else path)
    text = os.fspath(path)
    if text.startswith("file://"):
        text = text[len("file://"):]
    return Path(text).expanduser().absolute()


def filesystem(url: str) -> tuple[Any, str]:
    """``(fsspec filesystem, path within it)`` for a URL: for ``gs``, ``s3``, ``az`` and ``hf``
    the object epath (and orbax) uses, so both forget the listings this module changes."""
    import fsspec

    url = os.fspath(url)
    if url.split("://", 1)[0] in ("gs", "s3", "az", "hf"):
        from etils.epath import backend

        fs = backend.fsspec_backend.fs(url)
        return fs, fs._strip_protocol(url)
    return fsspec.core.url_to_fs(url)


def forget_listings(path: Any) -> None:
    """Drops every listing fsspec cached for a remote path's filesystem (no-op for a local
    one): objects written by another process, or by tensorstore, are not in them."""
    if not isinstance(path, Path) and is_remote(path):
        filesystem(os.fspath(path))[0].invalidate_cache()


def size(path: Any) -> int:
    """A file's size in bytes, for a ``pathlib`` or ``epath`` path."""
    if isinstance(path, Path):
        return path.stat().st_size
    fs, inner = filesystem(os.fspath(path))
    return int(fs.size(inner))


def rmtree(path: Any) -> None:
    """Removes a directory tree or a file, local or remote; a missing one is no error."""
    if isinstance(path, Path):
        import shutil

        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        return
    fs, inner = filesystem(os.fspath(path))
    with contextlib.suppress(FileNotFoundError):
        fs.rm(inner, recursive=True)


def check_bucket(url: str, what: str = "path") -> None:
    """Raises FileNotFoundError, naming ``what`` the URL is for, when its bucket is not seen."""
    fs, inner = filesystem(url)
    bucket = inner.split("/", 1)[0]
    try:
        found = fs.exists(bucket)
    except OSError as e:
        raise FileNotFoundError(f"{what} {url}: cannot reach the bucket {bucket}: {e}") from None
    if not found:
        raise FileNotFoundError(f"{what} {url}: the bucket {bucket} does not exist or is not "
                                "visible with these credentials")


def check_writable(url: str, what: str = "--out") -> None:
    """Fails early, in one line, for a remote directory that cannot be written: a missing
    bucket (``check_bucket``) or an object where the directory would be (FileExistsError)."""
    check_bucket(url, what)
    fs, inner = filesystem(url)
    try:
        is_file = fs.isfile(inner.rstrip("/"))
    finally:
        fs.invalidate_cache()
    if is_file:
        raise FileExistsError(f"{what} {url} is a file, not a directory")


def cache_dir() -> Path:
    """Where remote files are staged: ``$TRANSFORMER_JAX_CACHE/remote`` (default
    ``~/.cache/transformer_jax/remote``; ArrayRecord, HF and SentencePiece read local files)."""
    root = os.environ.get("TRANSFORMER_JAX_CACHE") or "~/.cache/transformer_jax"
    return Path(root).expanduser().absolute() / "remote"


def staging_dir(url: str, purpose: str) -> Path:
    """The local directory that stands for ``url`` (one per URL and purpose, e.g.
    ``"run"``, ``"read"``): readable name, hashed so two URLs never share one."""
    digest = hashlib.sha256(f"{purpose}:{url.rstrip('/')}".encode()).hexdigest()[:12]
    tail = re.sub(r"[^A-Za-z0-9._-]+", "_", url.rstrip("/").split("://", 1)[-1])[-60:]
    return cache_dir() / purpose / f"{tail}-{digest}"


def _remote_files(url: str, exclude: tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
    """``{relative name: fsspec listing entry}`` of every file under a remote directory, less
    the top-level names ``exclude``; not left in fsspec's cache, which orbax shares."""
    fs, inner = filesystem(url)
    inner = inner.rstrip("/")
    try:
        top = fs.ls(inner, detail=True)
    except FileNotFoundError:
        return {}
    files = {}
    try:
        for entry in top:
            name = entry["name"].rstrip("/")
            rel = name[len(inner):].lstrip("/")
            if not rel or rel.split("/", 1)[0] in exclude:
                continue
            if entry.get("type") != "directory":
                files[rel] = entry
                continue
            for sub, info in fs.find(name, detail=True).items():
                if info.get("type") != "directory":
                    files[sub[len(inner):].lstrip("/")] = info
    finally:
        fs.invalidate_cache()
    return files


def local_copy(path: str | os.PathLike[str], *, exclude: tuple[str, ...] = (),
               purpose: str = "read") -> Path:
    """A local directory with the files of ``path``: ``path`` itself (``~`` expanded) if it is
    local, else a download of the remote directory (or file), less the top-level names
    ``exclude``, cached in ``staging_dir(url, purpose)`` (``versions``); FileNotFoundError for
    a URL with no file under it."""
    if not is_remote(path):
        return Path(os.fspath(path)).expanduser()
    url = os.fspath(path).rstrip("/")
    fs, inner = filesystem(url)
    try:
        info = fs.info(inner)
    except FileNotFoundError:
        info = None
    finally:
        fs.invalidate_cache()
    local = staging_dir(url, purpose)
    if info is not None and info.get("type") == "file":
        # One file (a tokenizer.json, say): fetched into a directory of its own.
        name = url.rsplit("/", 1)[-1]
        _sync(fs, {name: info}, inner.rsplit("/", 1)[0], local, url)
        return local / name
    files = _remote_files(url, exclude)
    if not files and not as_path(url).exists():
        raise FileNotFoundError(f"{url} does not exist")
    _sync(fs, files, inner.rstrip("/"), local, url)
    for stale in [f for f in local.rglob("*") if f.is_file() and not f.name.endswith(".part")]:
        rel = stale.relative_to(local).as_posix()
        if rel not in files and rel.split("/", 1)[0] not in exclude:
            stale.unlink()
    return local


def _sync(fs: Any, files: dict[str, dict[str, Any]], inner: str, local: Path, url: str
          ) -> None:
    """Fetches into ``local`` each of ``files`` (relative name -> listing entry, under the
    remote directory ``inner``) not known to be cached, then records its version."""
    local.mkdir(parents=True, exist_ok=True)
    records = versions.read_records(local)
    fetched, written = 0, time.monotonic()
    for rel, info in sorted(files.items()):
        target = local / rel
        version = versions.object_version(info)
        if versions.is_fresh(target, version, records.get(rel)):
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        records.pop(rel, None)
        _fetch(fs, f"{inner}/{rel}", target)
        fetched += 1
        if version is not None:
            records[rel] = [version, *versions.stamp(target)]
            if time.monotonic() - written > 2.0:  # a killed copy keeps most of what it got
                versions.write_records(local, records)
                written = time.monotonic()
    kept = {rel: r for rel, r in records.items() if rel in files}
    if kept != versions.read_records(local):
        versions.write_records(local, kept)
    if fetched:
        logger.info("fetched %d file%s of %s into %s", fetched, "" if fetched == 1 else "s",
                    url, local)


def _fetch(fs: Any, inner: str, target: Path) -> None:
    """Downloads one object to ``target`` through a temporary name of its own (one per process)."""
    fd, part = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    os.close(fd)
    try:
        fs.get_file(inner, part)
        os.replace(part, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(part)


def push(local: Path, url: str, *, exclude: tuple[str, ...] = ()) -> int:
    """Uploads the files of the directory ``local`` (less the top-level names ``exclude``) whose
    remote copy under ``url`` has another CRC32C or MD5, or none; returns how many."""
    fs, inner = filesystem(url)
    inner = inner.rstrip("/")
    remote = _remote_files(url, exclude)
    sent = 0
    for file in sorted(f for f in local.rglob("*") if f.is_file()):
        rel = file.relative_to(local).as_posix()
        if rel.split("/", 1)[0] in exclude or file.name.endswith(".part"):
            continue
        if rel in remote and versions.same_content(file, remote[rel]):
            continue
        fs.put_file(str(file), f"{inner}/{rel}")
        sent += 1
    fs.invalidate_cache()
    return sent


__all__ = ["as_path", "cache_dir", "check_bucket", "check_writable", "filesystem",
           "forget_listings", "is_remote", "local_copy", "push", "rmtree", "size", "staging_dir"]
