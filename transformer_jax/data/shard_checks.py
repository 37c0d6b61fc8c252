"""What a reader of a shard build checks before it reads anything: the build's
``metadata.json`` and each split's files against it (``shards.TokenStream.open``), so that a
damaged build fails in one line naming the file before a run compiles, not when a batch reads it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from transformer_jax.data.build import FORMAT, METADATA, SPLITS


def read_metadata(path: str | Path) -> dict[str, Any]:
    """A build's metadata, checked to be one (its shard records included): FileNotFoundError
    without ``metadata.json`` (an unfinished build, or none), ValueError (one line naming the
    file) for one that does not parse, of another format or version, or malformed."""
    file = Path(path).expanduser() / METADATA
    if not file.is_file():
        raise FileNotFoundError(f"{path} is not a finished shard build (no {METADATA}); run "
                                "transformer-jax data build --out ... to finish it")
    try:
        meta = json.loads(file.read_bytes())
    except (OSError, ValueError) as e:  # ValueError: bad JSON or UTF-8
        raise ValueError(f"{file} is damaged (not readable JSON: {_line(e)}); "
                         f"{_rewrite(file)}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != 1:
        raise ValueError(f"{file} is not a {FORMAT} version 1 metadata file")
    problem = _metadata_problem(meta)
    if problem:
        raise ValueError(f"{file} is damaged ({problem}); {_rewrite(file)}")
    return meta


_SHARD_KEYS = ("index", *(f"{s}_{k}" for s in SPLITS for k in ("docs", "tokens")))
_SHARD_SIZES = tuple(f"{s}_bytes" for s in SPLITS)  # absent from builds of earlier versions


def _metadata_problem(meta: dict[str, Any]) -> str | None:
    """What is wrong with the fields of a build's metadata that reading it relies on."""
    try:
        if not isinstance(meta.get("dtype"), str):
            raise TypeError
        np.dtype(meta["dtype"])
    except TypeError:
        return f"dtype {meta.get('dtype')!r} is not a numpy dtype name"
    tokenizer = meta.get("tokenizer")
    if not isinstance(tokenizer, dict) or not isinstance(tokenizer.get("fingerprint"), str):
        return "no tokenizer fingerprint"
    shards = meta.get("shards")
    if not isinstance(shards, list):
        return "no list of shards"
    for i, shard in enumerate(shards):
        if not isinstance(shard, dict) or not all(
                type(shard.get(k)) is int and shard[k] >= 0 for k in _SHARD_KEYS):
            return f"shard record {i} is not {{{', '.join(_SHARD_KEYS)}}} of whole numbers"
        if any(k in shard and not (type(shard[k]) is int and shard[k] >= 0)
               for k in _SHARD_SIZES):
            return f"shard record {i} has a size that is not a whole number of bytes"
    return None


# The shard files already checked, by (path, size, mtime): a run opens each split more than once.
_CHECKED: set[tuple[str, int, int]] = set()


def check_files(file: Path, docs: int, tokens: int, size: int | None = None) -> np.ndarray:
    """Checks a shard split's ArrayRecord file (``size`` if recorded, ``docs`` records) and its
    ``.lengths.npy`` (``docs`` lengths summing to ``tokens``); returns those lengths [docs]
    int64. FileNotFoundError or ValueError, naming the file."""
    build = file.parent / METADATA
    lengths_file = file.with_name(file.name.replace(".arrayrecord", ".lengths.npy"))
    for path in (file, lengths_file):
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing ({build} lists it): the shard build is "
                                    f"damaged; {_fix(path)}")
    try:
        lengths = np.load(lengths_file, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"{lengths_file} does not load ({_line(e)}): the shard build is "
                         f"damaged; {_fix(lengths_file)}") from None
    if (lengths.ndim != 1 or lengths.dtype.kind not in "iu" or len(lengths) != docs
            or int(lengths.sum()) != tokens):
        raise ValueError(f"{lengths_file} does not list the {docs} document lengths "
                         f"({tokens} tokens) of {build}: the shard build is damaged; "
                         f"{_fix(lengths_file)}")
    stat = file.stat()
    if size is not None and stat.st_size != size:
        raise ValueError(f"{file} is {stat.st_size} bytes, not the {size} of {build}: it is "
                         f"truncated or damaged; {_fix(file)}")
    key = (str(file), stat.st_size, stat.st_mtime_ns)
    if key not in _CHECKED:
        from array_record.python.array_record_module import ArrayRecordReader

        try:
            reader = ArrayRecordReader(str(file), "readahead_buffer_size:0")
            try:
                held = reader.num_records()
            finally:
                reader.close()
        except (RuntimeError, OSError, ValueError) as e:
            detail = f" ({_line(e)})" if _line(e) else ""
            raise ValueError(f"{file} does not open as an ArrayRecord file{detail}: it is "
                             f"truncated or damaged; {_fix(file)}") from None
        if held != docs:
            raise ValueError(f"{file} holds {held} records ({stat.st_size} bytes), not the "
                             f"{docs} of {build}: it is truncated or damaged; {_fix(file)}")
        _CHECKED.add(key)
    return lengths.astype(np.int64, copy=False)


def _fix(path: Path) -> str:
    """How to repair a build whose file ``path`` is damaged or missing."""
    remove = "" if not path.exists() else f"remove {path.name} and "
    return (f"{remove}run the same transformer-jax data build --out {path.parent} again to "
            "rebuild that shard")


def _rewrite(metadata: Path) -> str:
    return f"run the same transformer-jax data build --out {metadata.parent} again to rewrite it"


def _line(error: BaseException) -> str:
    return " ".join(str(error).split())


__all__ = ["check_files", "read_metadata"]
