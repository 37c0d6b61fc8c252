"""The inputs of a shard build: files, directories and globs -> typed sources -> pieces ->
documents.

A source is ``text`` (one document, or one per paragraph), ``jsonl``, ``parquet`` or ``hf`` (a
``datasets`` ``save_to_disk`` directory; one document per line or row). A piece is a contiguous
part of one source small enough for one shard, planned from the inputs alone.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from transformer_jax.data import corpus

logger = logging.getLogger(__name__)

KINDS = ("text", "jsonl", "parquet", "hf")
TEXT_DOCS = ("file", "paragraph")
_HF_MARKERS = ("state.json", "dataset_info.json")


class BadInput(ValueError):
    """An input file (or record) that cannot be read as its kind: one line naming it."""


@dataclasses.dataclass(frozen=True)
class Source:
    """One input: ``path`` read as ``kind``; ``size`` its bytes (for planning)."""

    path: str
    kind: str
    size: int


@dataclasses.dataclass(frozen=True)
class Piece:
    """``[start, stop)`` of a source: bytes (text, jsonl), row groups (parquet) or rows (hf)."""

    source: Source
    start: int
    stop: int
    size: int

    def key(self) -> list:
        """What identifies the piece's contents in a build's plan (path, size, mtime, range)."""
        stat = os.stat(self.source.path)
        return [self.source.path, self.source.kind, stat.st_size, stat.st_mtime_ns,
                self.start, self.stop]


def resolve_sources(patterns: Sequence[str],
                    exclude: Sequence[str | os.PathLike[str]] = ()) -> list[Source]:
    """Files, directories and globs -> sources, sorted by path, less what lies under
    ``exclude`` (logged); a saved HF dataset directory is ``hf``, other files as their suffix.
    FileNotFoundError for a pattern matching nothing (not excluded), ValueError for none."""
    if not patterns:
        raise ValueError("no input: pass --input FILE|DIR|GLOB")
    excluded = [Path(os.path.expanduser(os.fspath(e))).resolve() for e in exclude]
    found: dict[str, Source] = {}
    for pattern in patterns:
        path = Path(os.path.expanduser(pattern))
        dirs: list[Path] = []  # a saved dataset's split directories
        if path.is_dir() and (path / "dataset_dict.json").is_file():
            splits = json.loads((path / "dataset_dict.json").read_text())["splits"]
            dirs = [(path / split).resolve() for split in splits]
        elif path.is_dir() and all((path / m).is_file() for m in _HF_MARKERS):
            dirs = [path.resolve()]
        if dirs and all(corpus.is_under(d, excluded) for d in dirs):
            raise FileNotFoundError(f"--input {pattern!r} is a dataset under "
                                    f"{', '.join(map(str, excluded))}, which is left out of the "
                                    "inputs")
        for d in dirs:
            if corpus.is_under(d, excluded):
                logger.info("left the dataset %s under %s out of the inputs", d,
                            ", ".join(map(str, excluded)))
                continue
            size = sum(f.stat().st_size for f in d.glob("*.arrow"))
            found[str(d)] = Source(str(d), "hf", size)
        if dirs:
            continue
        for file in corpus.resolve_corpus([pattern], exclude=excluded):
            suffix = file.suffix.lower()
            kind = {".jsonl": "jsonl", ".parquet": "parquet"}.get(suffix, "text")
            found[str(file)] = Source(str(file), kind, file.stat().st_size)
    return [found[k] for k in sorted(found)]


def plan_pieces(sources: Sequence[Source], piece_bytes: int) -> list[Piece]:
    """Cuts each source into pieces of about ``piece_bytes`` (a text file stays whole; a jsonl
    file is cut at byte offsets, each line read by the piece it starts in)."""
    pieces = []
    for source in sources:
        units = _units(source)
        if source.kind == "text" or source.size <= piece_bytes:
            pieces.append(Piece(source, 0, units, source.size))
            continue
        count = min(units, math.ceil(source.size / piece_bytes))
        bounds = [round(i * units / count) for i in range(count + 1)]
        for start, stop in zip(bounds, bounds[1:], strict=False):
            if stop > start:
                pieces.append(Piece(source, start, stop,
                                    round(source.size * (stop - start) / units)))
    return pieces


def _units(source: Source) -> int:
    """How many addressable units the source has (bytes, row groups or rows)."""
    if source.kind in ("text", "jsonl"):
        return source.size
    if source.kind == "parquet":
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(source.path).metadata.num_row_groups
        except Exception as e:  # noqa: BLE001 - pyarrow raises several kinds
            raise BadInput(f"{source.path}: not a parquet file ({e})") from None
    return len(_hf_dataset(source.path))


def documents(piece: Piece, field: str, text_docs: str = "file") -> Iterator[str]:
    """The documents of a piece, in order (empty ones skipped).

    Raises:
      BadInput: ``PATH[:LINE|:ROW]: why`` for a file that is not its kind (binary, not UTF-8,
        not JSON) or a record without a string ``field``.
    """
    source = piece.source
    if source.kind == "text":
        yield from _text_documents(source.path, text_docs)
    elif source.kind == "jsonl":
        yield from _jsonl_documents(piece, field)
    elif source.kind == "parquet":
        yield from _parquet_documents(piece, field)
    else:
        dataset = _hf_dataset(source.path)
        if field not in dataset.column_names:
            raise BadInput(f"{source.path}: no column {field!r} (columns: "
                           f"{', '.join(dataset.column_names)}); pass --field")
        for i, text in enumerate(dataset[piece.start:piece.stop][field], start=piece.start):
            if text:
                yield _checked(text, f"{source.path}:row {i}", field)


def _text_documents(path: str, text_docs: str) -> Iterator[str]:
    data = Path(path).read_bytes()
    if b"\0" in data[:65536]:
        raise BadInput(f"{path}: a binary file (NUL bytes), not text; remove it from --input "
                       "or pass --skip-bad")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadInput(f"{path}: not UTF-8 text (byte {e.start})") from None
    if text_docs == "file":
        if text:
            yield text
        return
    for paragraph in text.split("\n\n"):
        if paragraph.strip():
            yield paragraph + "\n"


def _jsonl_documents(piece: Piece, field: str) -> Iterator[str]:
    path = piece.source.path
    with open(path, "rb") as f:
        if piece.start:
            f.seek(piece.start - 1)
            f.readline()  # the rest of the line the previous piece reads
        while f.tell() < piece.stop:
            offset = f.tell()
            line = f.readline()
            if not line:
                break
            if not line.strip():
                continue
            where = f"{path}:byte {offset}"
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise BadInput(f"{where}: not a JSON line ({e})") from None
            if not isinstance(record, dict) or field not in record:
                keys = ", ".join(record) if isinstance(record, dict) else type(record).__name__
                raise BadInput(f"{where}: no field {field!r} (has: {keys}); pass --field")
            if record[field]:
                yield _checked(record[field], where, field)


def _parquet_documents(piece: Piece, field: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    path = piece.source.path
    parquet = pq.ParquetFile(path)
    if field not in parquet.schema_arrow.names:
        raise BadInput(f"{path}: no column {field!r} (columns: "
                       f"{', '.join(parquet.schema_arrow.names)}); pass --field")
    table = parquet.read_row_groups(range(piece.start, piece.stop), columns=[field])
    for i, text in enumerate(table.column(field).to_pylist()):
        if text:
            yield _checked(text, f"{path}:row group {piece.start} + row {i}", field)


def _checked(text: object, where: str, field: str) -> str:
    if not isinstance(text, str):
        raise BadInput(f"{where}: field {field!r} is a {type(text).__name__}, not a string")
    return text


def _hf_dataset(path: str):
    import datasets

    try:
        return datasets.load_from_disk(path)
    except Exception as e:  # noqa: BLE001 - datasets raises several kinds
        raise BadInput(f"{path}: not a dataset saved by datasets.save_to_disk ({e})") from None


__all__ = ["KINDS", "TEXT_DOCS", "BadInput", "Piece", "Source", "documents", "plan_pieces",
           "resolve_sources"]
