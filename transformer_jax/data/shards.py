"""Training batches from shard builds: packed rows or windows, and mixtures.

A split of builds is a token stream, cut into rows of T + 1 tokens by ``pack`` (in Grain's
global shuffle order) or read as random windows by ``concat``; a mixture draws each row's
source by weight. All is a pure function of (seed, step); a process reads its own rows only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from transformer_jax import storage
from transformer_jax.data.batches import (
    HostBatch,
    StepBatches,
    batch_offsets,
    check_non_negative,
    eval_row_batches,
)
from transformer_jax.data.build import METADATA, SPLITS, TOKENIZER_DIR, shard_name
from transformer_jax.data.shard_checks import check_files, read_metadata

PACKING = ("pack", "concat")
_MIX_STREAM = 1  # the rng stream of the mixture's draws


def is_build(path: str | Path) -> bool:
    """Whether ``path`` is a shard build directory (holds its ``metadata.json``);
    FileNotFoundError for an unfinished one, which would otherwise be read as text files."""
    path = storage.as_path(path)
    if (path / METADATA).is_file():
        return True
    if path.is_dir() and next(path.glob("shard-[0-9]*.json"), None) is not None:
        read_metadata(path)  # raises, naming the build command
    return False


@dataclasses.dataclass(frozen=True, eq=False)
class TokenStream:
    """One split of builds: the documents of the ArrayRecord files ``paths`` (``counts``
    documents each, of ``lengths`` [D] tokens) one after another."""

    paths: tuple[str, ...]
    counts: tuple[int, ...]
    lengths: np.ndarray
    dtype: np.dtype

    def __post_init__(self) -> None:
        object.__setattr__(self, "_ends", np.cumsum(self.lengths))
        object.__setattr__(self, "_file_starts", np.cumsum((0, *self.counts)))
        object.__setattr__(self, "_readers", {})

    def records(self, docs: np.ndarray) -> list[bytes]:
        """The records of documents ``docs`` (sorted, unique) [n], in that order: one batched
        read per file (Grain's ``__getitems__`` starts a thread pool a call, 5 ms a batch)."""
        from array_record.python.array_record_module import ArrayRecordReader

        files = np.searchsorted(self._file_starts, docs, side="right") - 1
        out: list[bytes] = []
        for f in np.unique(files).tolist():
            if f not in self._readers:  # random access: no read-ahead
                self._readers[f] = ArrayRecordReader(self.paths[f], "readahead_buffer_size:0")
            positions = (docs[files == f] - self._file_starts[f]).tolist()
            out.extend(self._readers[f].read(positions))
        return out

    @classmethod
    def open(cls, builds: Sequence[str | Path], split: str) -> TokenStream:
        """The ``split`` (``train``/``val``) of the builds, in order, every file checked first
        (``check_files``: a damaged build fails here)."""
        paths, counts, lengths, dtypes = [], [], [], set()
        for build in builds:
            build = Path(build).expanduser()
            meta = read_metadata(build)
            dtypes.add(meta["dtype"])
            for shard in meta["shards"]:
                if shard[f"{split}_docs"]:  # an empty ArrayRecord file is left out
                    file = build / shard_name(split, shard["index"])
                    paths.append(str(file))
                    counts.append(shard[f"{split}_docs"])
                    lengths.append(check_files(file, shard[f"{split}_docs"],
                                               shard[f"{split}_tokens"],
                                               shard.get(f"{split}_bytes")))
        if len(dtypes) != 1:
            raise ValueError(f"the builds {list(builds)} have different token dtypes {dtypes}")
        lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
        return cls(tuple(paths), tuple(counts), lengths, np.dtype(dtypes.pop()).newbyteorder("<"))

    @property
    def num_tokens(self) -> int:
        """N, the stream's length."""
        return int(self._ends[-1]) if len(self._ends) else 0

    def read(self, starts: Sequence[int] | np.ndarray, size: int
             ) -> tuple[np.ndarray, np.ndarray]:
        """Tokens ``[start, start + size)`` for each start (int32) and the document index of
        each token (int64), both [R, size]; each record is read once."""
        starts = np.asarray(starts, dtype=np.int64)
        first = np.searchsorted(self._ends, starts, side="right")
        last = np.searchsorted(self._ends, starts + size, side="left")
        docs = np.unique(np.concatenate([np.arange(a, b + 1) for a, b in zip(first, last,
                                                                            strict=True)]))
        records = dict(zip(docs.tolist(), self.records(docs), strict=True))
        tokens = np.empty((len(starts), size), dtype=np.int32)
        doc_ids = np.empty((len(starts), size), dtype=np.int64)
        for r, (a, b) in enumerate(zip(first.tolist(), last.tolist(), strict=True)):
            span = np.concatenate([np.frombuffer(records[d], self.dtype) for d in range(a, b + 1)])
            begin = int(starts[r]) - (int(self._ends[a - 1]) if a else 0)
            tokens[r] = span[begin:begin + size]
            doc_ids[r] = np.repeat(np.arange(a, b + 1), self.lengths[a:b + 1])[begin:begin + size]
        return tokens, doc_ids


def packed_rows(stream: TokenStream, rows: Sequence[int] | np.ndarray, width: int) -> HostBatch:
    """Rows of the packed stream -> the batch: ``inputs``, ``targets``, ``segment_ids`` (1, 2,
    ... per document part), ``positions`` (from 0 per segment) and ``mask`` (1.0 where the
    target is in the input's segment), each [R, width - 1]."""
    tokens, docs = stream.read(np.asarray(rows, dtype=np.int64) * width, width)
    starts = np.concatenate([np.ones((len(docs), 1), bool), docs[:, 1:] != docs[:, :-1]], 1)
    segments = np.cumsum(starts, axis=1).astype(np.int32)
    index = np.arange(width)[None, :]
    first = np.maximum.accumulate(np.where(starts, index, 0), axis=1)
    positions = (index - first).astype(np.int32)
    mask = segments[:, 1:] == segments[:, :-1]
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
            "segment_ids": segments[:, :-1], "positions": positions[:, :-1],
            "mask": mask.astype(np.float32)}


def windows_batch(stream: TokenStream, offsets: np.ndarray, seq_len: int) -> HostBatch:
    """The windows of T + 1 tokens at ``offsets`` [B]: ``inputs``/``targets`` [B, T]."""
    windows = stream.read(offsets, seq_len + 1)[0]
    return {"inputs": windows[:, :-1], "targets": windows[:, 1:]}


class Rows:
    """The order of a stream's packed rows: Grain's ``MapDataset.range(R).shuffle().repeat()``
    (a new permutation each epoch, O(1) memory)."""

    def __init__(self, stream: TokenStream, seq_len: int, seed: int):
        import grain

        self.stream, self.width = stream, seq_len + 1
        self.num_rows = stream.num_tokens // self.width
        if self.num_rows == 0:
            raise ValueError(f"{stream.num_tokens} tokens do not fill one packed row of "
                             f"train.seq_len + 1 = {self.width} tokens")
        self.order = grain.MapDataset.range(self.num_rows).shuffle(seed=seed).repeat()


@dataclasses.dataclass(frozen=True)
class Mixture:
    """Named sources (each a list of build directories) and their weights."""

    names: tuple[str, ...]
    builds: tuple[tuple[str, ...], ...]
    weights: tuple[float, ...]

    @classmethod
    def parse(cls, path: str, mixture: str) -> Mixture:
        """``data.mixture`` (``name=PATH:weight,...``), or one source of all of ``data.path``;
        reads no file. ValueError naming ``data.mixture`` for a malformed entry or weights."""
        if not mixture:
            return cls(("data",), (tuple(p.strip() for p in path.split(",") if p.strip()),),
                       (1.0,))
        names, builds, weights = [], [], []
        for entry in (e.strip() for e in mixture.split(",") if e.strip()):
            name, eq, rest = entry.partition("=")
            where, colon, weight = rest.rpartition(":")
            try:
                value = float(weight) if colon else float("nan")
            except ValueError:
                value = float("nan")
            if not eq or not name or not where or not colon:
                raise ValueError(f"data.mixture entry {entry!r} is not NAME=PATH:WEIGHT "
                                 "(WEIGHT a finite number > 0)")
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"data.mixture entry {entry!r}: the weight {weight!r} is not "
                                 "a finite number > 0 (the weights are relative, e.g. "
                                 "a=DIR:3,b=DIR:1)")
            if name in names:
                raise ValueError(f"data.mixture names {name!r} twice")
            names.append(name)
            builds.append(tuple(where.split("+")))
            weights.append(value)
        total = sum(weights)
        if not math.isfinite(total):
            raise ValueError(f"data.mixture weights {', '.join(map(repr, weights))} sum to "
                             f"{total}: their sum must be a finite number (they are relative: "
                             "1,1 reads the same as 1e308,1e308 would)")
        return cls(tuple(names), tuple(builds), tuple(w / total for w in weights))

    def fetched(self) -> Mixture:
        """This mixture with every build on object storage replaced by its ``local_copy``."""
        return dataclasses.replace(self, builds=tuple(
            tuple(str(storage.local_copy(b, purpose="data")) for b in source)
            for source in self.builds))


def mixture_sources(seed: int, step: int, batch_size: int, weights: Sequence[float]
                    ) -> np.ndarray:
    """The source of each row of the global batch of (seed, step): [B] int64 in ``[0, K)``."""
    if len(weights) == 1:
        return np.zeros(batch_size, dtype=np.int64)
    rng = np.random.default_rng([seed, step, _MIX_STREAM])
    return rng.choice(len(weights), size=batch_size, p=np.asarray(weights))


@dataclasses.dataclass(frozen=True, eq=False)
class ShardBatches(StepBatches):
    """This process's rows of the global batch of (seed, step), read from the shard builds of
    ``mixture``, rows of ``seq_len`` T, ``packing`` ``"pack"`` or ``"concat"``."""

    mixture: Mixture
    seq_len: int
    batch_size: int
    packing: str = "pack"
    seed: int = 0
    process_index: int = 0
    process_count: int = 1

    def __post_init__(self) -> None:
        self._check_split()
        if self.packing not in PACKING:
            raise ValueError(f"data.packing must be one of {PACKING}, got {self.packing!r}")
        streams = [TokenStream.open(b, "train") for b in self.mixture.builds]
        for name, stream in zip(self.mixture.names, streams, strict=True):
            if stream.num_tokens <= self.seq_len + 1:
                raise ValueError(f"data source {name!r} has {stream.num_tokens} train tokens, "
                                 f"fewer than train.seq_len + 1 = {self.seq_len + 1}")
        object.__setattr__(self, "streams", streams)
        if self.packing == "pack":
            rows = [Rows(s, self.seq_len, seed=(self.seed * 1_000_003 + k) % 2**32)
                    for k, s in enumerate(streams)]
            object.__setattr__(self, "rows", rows)

    def sources(self, step: int) -> np.ndarray:
        """The source index of each global row of ``step``, [B]."""
        return mixture_sources(self.seed, step, self.batch_size, self.mixture.weights)

    def get(self, step: int) -> HostBatch:
        """``{inputs, targets[, segment_ids, positions, mask]}``, each [B / P, T]."""
        step = check_non_negative("step", step)
        slots = self._mine(np.arange(step * self.batch_size, (step + 1) * self.batch_size))
        sources = self._mine(self.sources(step))
        if self.packing == "pack":
            return _by_source(sources, slots, lambda k, i: packed_rows(
                self.streams[k], [self.rows[k].order[int(j)] for j in i], self.seq_len + 1))
        offsets = np.empty(len(slots), dtype=np.int64)
        for k, stream in enumerate(self.streams):
            drawn = (batch_offsets(self.seed, step, self.batch_size, stream.num_tokens,
                                   self.seq_len) if k == 0 else
                     np.random.default_rng([self.seed, step, _MIX_STREAM + 1 + k]).integers(
                         0, stream.num_tokens - self.seq_len, size=self.batch_size))
            offsets[sources == k] = self._mine(drawn)[sources == k]
        return _by_source(sources, offsets,
                          lambda k, o: windows_batch(self.streams[k], o, self.seq_len))


def _by_source(sources: np.ndarray, keys: np.ndarray,
               read: Callable[[int, np.ndarray], HostBatch]) -> HostBatch:
    """The batch whose row ``j`` is row ``keys[j]`` of source ``sources[j]``: one
    ``read(k, keys of source k)`` per source, the rows put back in order."""
    parts = {int(k): read(int(k), keys[sources == k]) for k in np.unique(sources)}
    out = {name: np.empty((len(sources), *first.shape[1:]), first.dtype)
           for name, first in next(iter(parts.values())).items()}
    for k, part in parts.items():
        for name in out:
            out[name][sources == k] = part[name]
    return out


def eval_rows(stream: TokenStream, packing: str, seq_len: int) -> int:
    """How many validation rows the stream holds: packed rows of T + 1, or windows (``concat``)."""
    if packing == "pack":
        return stream.num_tokens // (seq_len + 1)
    return max(stream.num_tokens - 1, 0) // seq_len


def eval_batches(stream: TokenStream, packing: str, batch_size: int, seq_len: int,
                 max_batches: int | None = None, *, process_index: int = 0,
                 process_count: int = 1, pad: bool = False) -> Iterator[HostBatch]:
    """Validation batches in order: packed rows (or windows ``[w T, w T + T]``) through
    ``eval_row_batches``; ``pad`` keeps a last incomplete batch. Checked when called:
    ValueError when not one batch fills (with ``pad``: not one row)."""
    local = batch_size // process_count
    width = seq_len + 1 if packing == "pack" else seq_len
    rows = eval_rows(stream, packing, seq_len)
    count = -(-rows // batch_size) if pad else rows // batch_size
    if count == 0:
        raise ValueError(f"the {stream.num_tokens} validation tokens of the shards do not fill "
                         f"one eval batch of {1 if pad else batch_size} rows of {width} tokens "
                         f"({packing})")

    def read(index: np.ndarray) -> HostBatch:
        if packing == "pack":
            return packed_rows(stream, index, width)
        return windows_batch(stream, index * seq_len, seq_len)

    return eval_row_batches(rows, batch_size, max_batches, read, process_index, local, pad)


def eval_tokens(stream: TokenStream, packing: str, seq_len: int) -> int:
    """The validation size ``eval_batching`` reads (``R T + 1`` tokens for R packed rows)."""
    if packing != "pack":
        return stream.num_tokens
    rows = eval_rows(stream, packing, seq_len)
    return rows * seq_len + 1 if rows else 0


def check_tokenizer(builds: Sequence[str], fingerprint: str, where: str) -> None:
    """Raises ValueError when a build's tokenizer is not the run's (one line naming both)."""
    for build in builds:
        theirs = read_metadata(build)["tokenizer"]["fingerprint"]
        if theirs != fingerprint:
            raise ValueError(f"{where} (fingerprint {fingerprint[:12]}) is not the tokenizer "
                             f"of the shards in {build} (fingerprint {theirs[:12]}); use "
                             f"{Path(build) / TOKENIZER_DIR} or rebuild the shards")


def fingerprint(builds: Sequence[str], reading: Any = None) -> str:
    """A digest of the builds' shard records and of how they are read (``reading``, e.g. the
    packing and the mixture's weights): what a resumed run must read the same."""
    digest = hashlib.sha256(json.dumps(reading).encode())
    for build in builds:
        meta = read_metadata(build)
        digest.update(json.dumps([meta["tokenizer"], meta["shards"]], sort_keys=True).encode())
    return digest.hexdigest()


__all__ = ["PACKING", "SPLITS", "Mixture", "Rows", "ShardBatches", "TokenStream", "check_files",
           "check_tokenizer", "eval_batches", "eval_rows", "eval_tokens", "fingerprint",
           "is_build", "mixture_sources", "packed_rows", "read_metadata", "windows_batch"]
