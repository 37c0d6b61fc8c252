"""Corpus files (``resolve_corpus``; ``default_corpus``: the Python standard library's sources,
so a run works offline) -> one flat token memmap, cached on disk (``tokenize_corpus``)."""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import sysconfig
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from transformer_jax.storage.files import atomic_writer
from transformer_jax.tokenizer import Tokenizer, read_utf8

logger = logging.getLogger(__name__)

# Bump when the token file layout changes so old caches are not reused.
_TOKEN_CACHE_VERSION = 1
DEFAULT_CORPUS_MAX_BYTES = 8_000_000
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test",
                               "__pycache__"})
_GLOB_CHARS = frozenset("*?[")


def resolve_corpus(patterns: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], *,
                   exclude: Sequence[str | os.PathLike[str]] = ()) -> list[Path]:
    """Absolute paths, sorted and unique, of the files that ``patterns`` name (files,
    directories, globs), less those under ``exclude`` (logged).

    Raises:
      FileNotFoundError: A path does not exist or a pattern matches no (unexcluded) file.
      ValueError: No pattern is given or every matched file is empty.
    """
    patterns = [patterns] if isinstance(patterns, str | os.PathLike) else list(patterns)
    if not patterns:
        raise ValueError("resolve_corpus needs at least one path or glob pattern")
    excluded = [Path(os.path.expanduser(os.fspath(e))).resolve() for e in exclude]
    found: set[Path] = set()
    left_out: set[Path] = set()
    for pattern in patterns:
        text = os.path.expanduser(os.fspath(pattern))
        if any(c in _GLOB_CHARS for c in text):
            files = [Path(m) for m in glob.glob(text, recursive=True) if os.path.isfile(m)]
        elif os.path.isdir(text):
            files = [p for p in Path(text).rglob("*") if p.is_file()
                     and not any(part.startswith(".") for part in p.relative_to(text).parts)]
        elif os.path.isfile(text):
            files = [Path(text)]
        else:
            raise FileNotFoundError(f"corpus path not found: {pattern!r}")
        if not files:
            raise FileNotFoundError(f"corpus pattern {pattern!r} matches no files")
        files = [f.resolve() for f in files]
        kept = [f for f in files if not is_under(f, excluded)]
        left_out.update(f for f in files if f not in kept)
        if not kept:
            raise FileNotFoundError(f"corpus pattern {pattern!r} matches only files under "
                                    f"{', '.join(map(str, excluded))}, which is left out of the "
                                    "inputs")
        found.update(kept)
    if left_out:
        logger.info("left %d file%s under %s out of the inputs", len(left_out),
                    "" if len(left_out) == 1 else "s", ", ".join(map(str, excluded)))
    result = sorted(found)
    if sum(f.stat().st_size for f in result) == 0:
        raise ValueError(f"corpus {patterns!r} is empty: all {len(result)} matched files have 0 "
                         "bytes")
    return result


def is_under(path: Path, directories: Sequence[Path]) -> bool:
    """Whether ``path`` is one of ``directories`` or lies below one (all absolute, resolved)."""
    return any(path == d or d in path.parents for d in directories)


def default_corpus(max_bytes: int | None = DEFAULT_CORPUS_MAX_BYTES) -> list[Path]:
    """The standard library's ``.py`` sources (no tests) as an offline corpus: sorted paths,
    at most ``max_bytes`` (None: no cap) spread over the library by a hash of the path.
    ValueError for ``max_bytes`` <= 0, FileNotFoundError when no usable file is found."""
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive or None, got {max_bytes!r}")
    root = Path(sysconfig.get_paths()["stdlib"]).resolve()
    candidates: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames
                             if d not in _STDLIB_SKIP_DIRS and not d.startswith("."))
        candidates.extend(Path(dirpath) / name for name in sorted(filenames)
                          if name.endswith(".py"))
    chosen: list[Path] = []
    total = 0
    for path in sorted(candidates, key=lambda p: hashlib.sha256(
            p.relative_to(root).as_posix().encode()).hexdigest()):  # spread over the library
        try:
            size = path.stat().st_size
            if size == 0 or (max_bytes is not None and total + size > max_bytes):
                continue
            read_utf8(path)
        except (OSError, ValueError):
            continue
        chosen.append(path)
        total += size
    if not chosen:
        raise FileNotFoundError(f"no readable .py files found under stdlib directory {root}")
    logger.info("default corpus: %d stdlib files, %d bytes", len(chosen), total)
    return sorted(chosen)


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype holding ids in ``[0, V)``: uint16 up to 2**16, else uint32;
    ValueError for ``vocab_size`` outside ``[1, 2**32]``."""
    if vocab_size <= 0 or vocab_size > 2**32:
        raise ValueError(f"vocab_size must be in [1, 2**32], got {vocab_size}")
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def tokenize_corpus(files: Sequence[str | os.PathLike[str]], tokenizer: Tokenizer,
                    cache_dir: str | os.PathLike[str], *, add_bos: bool = False,
                    add_eos: bool = True) -> np.memmap:
    """The token ids [N] of the UTF-8 ``files`` (a document each), cached in ``cache_dir`` by
    a hash of paths, contents, tokenizer and options, memory-mapped read-only.

    Raises:
      ValueError: If ``files`` is empty, a file is not UTF-8, or the corpus yields no tokens.
      FileNotFoundError: If a file does not exist.
    """
    paths = [Path(f).resolve() for f in files]
    if not paths:
        raise ValueError("tokenize_corpus needs at least one file")
    dtype = token_dtype(tokenizer.vocab_size)
    file_digests = []
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"corpus file not found: {path}")
        with open(path, "rb") as f:
            file_digests.append([str(path), hashlib.file_digest(f, "sha256").hexdigest()])
    payload = json.dumps({"version": _TOKEN_CACHE_VERSION, "tokenizer": tokenizer.fingerprint,
                          "add_bos": add_bos, "add_eos": add_eos, "dtype": dtype.name,
                          "files": file_digests})
    key = hashlib.sha256(payload.encode()).hexdigest()[:24]
    cache_path = Path(cache_dir) / f"tokens-{key}.{dtype.name}.bin"
    if cache_path.is_file():
        logger.info("reusing token cache %s", cache_path)
        return np.memmap(cache_path, dtype=dtype, mode="r")

    count = 0
    with atomic_writer(cache_path) as out:
        for path in paths:
            text = read_utf8(path)
            if not text:
                continue
            ids = np.asarray(tokenizer.encode(text, add_bos=add_bos, add_eos=add_eos), dtype=dtype)
            ids.tofile(out)
            count += ids.size
        if count == 0:
            raise ValueError(f"corpus of {len(paths)} files yields no tokens (all files are empty)")
    logger.info("tokenized %d files into %d tokens -> %s", len(paths), count, cache_path)
    return np.memmap(cache_path, dtype=dtype, mode="r")


__all__ = ["DEFAULT_CORPUS_MAX_BYTES", "default_corpus", "is_under", "resolve_corpus",
           "token_dtype", "tokenize_corpus"]
