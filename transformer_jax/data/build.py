"""``transformer-jax data build``: inputs -> tokenized ArrayRecord shards + metadata.

Pieces of the inputs are grouped into shards of about ``--shard-mb``, each tokenized by one of
``--workers`` processes into ``train-/val-SSSSS.arrayrecord`` (a record per document),
``*.lengths.npy`` and, last, ``shard-SSSSS.json``, all atomic: a killed build redoes only the
shards without their json; ``metadata.json`` comes last (docs/data.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import multiprocessing
import numbers
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from transformer_jax import storage
from transformer_jax.data import sources as sources_lib
from transformer_jax.data.build_dir import FORMAT, MARKER, METADATA, claim, locked
from transformer_jax.data.corpus import token_dtype
from transformer_jax.storage.files import atomic_writer, replacing_directory
from transformer_jax.tokenizer import MODEL_TYPES, TextTokenizer, Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

VERSION = 1
TOKENIZER_DIR = "tokenizer"
SPLITS = ("train", "val")
_WRITER_OPTIONS = "group_size:1"


@dataclasses.dataclass(frozen=True)
class BuildOptions:
    """How inputs become shards (all part of each shard's plan: a change rebuilds it).

    Attributes:
      field: the text field of jsonl records, parquet rows and dataset rows.
      text_docs: ``"file"`` (a text file is one document) or ``"paragraph"`` (each one is).
      val_fraction: the share of documents held out, in ``[0, 1)``.
      shard_bytes: input bytes per shard (a text file is never split).
      add_bos, add_eos: put bos before / eos after each document.
      skip_bad: skip a bad input file (named in a warning and the metadata), not fail.
    """

    field: str = "text"
    text_docs: str = "file"
    val_fraction: float = 0.01
    shard_bytes: int = 64 << 20
    add_bos: bool = False
    add_eos: bool = True
    skip_bad: bool = False

    def __post_init__(self) -> None:
        if self.text_docs not in sources_lib.TEXT_DOCS:
            raise ValueError(f"text_docs must be one of {sources_lib.TEXT_DOCS}, got "
                             f"{self.text_docs!r}")
        if (not isinstance(self.val_fraction, numbers.Real)
                or not 0 <= self.val_fraction < 1):
            raise ValueError(f"val_fraction must be a number in [0, 1), got "
                             f"{self.val_fraction!r}")
        if (isinstance(self.shard_bytes, bool) or not isinstance(self.shard_bytes, numbers.Integral)
                or self.shard_bytes <= 0):
            raise ValueError(f"shard_bytes must be a positive whole number of bytes, got "
                             f"{self.shard_bytes!r}")


def shard_name(split: str, index: int) -> str:
    """``train-00003.arrayrecord``: the records of one split of shard ``index``."""
    return f"{split}-{index:05d}.arrayrecord"


def group_shards(pieces: Sequence[sources_lib.Piece], shard_bytes: int
                 ) -> list[list[sources_lib.Piece]]:
    """Consecutive pieces grouped into shards of at least ``shard_bytes`` (the last smaller)."""
    shards: list[list[sources_lib.Piece]] = [[]]
    size = 0
    for piece in pieces:
        if size >= shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(piece)
        size += piece.size
    return shards if shards[0] else []


def is_held_out(text: str, val_fraction: float) -> bool:
    """Whether a document is in the ``val`` split: a hash of its text below the fraction."""
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "little") < val_fraction * 2.0**64


def build(inputs: Sequence[str], out: str | os.PathLike[str], tokenizer: TextTokenizer, *,
          options: BuildOptions = BuildOptions(), workers: int = 1, progress: bool = True,
          overwrite: bool = False) -> dict[str, Any]:
    """Tokenizes the inputs into shards under ``out``; returns the metadata written to
    ``out/metadata.json``.

    Args:
      inputs: files, directories and globs (``sources.resolve_sources``), less ``out``.
      out: the build directory, local or a bucket (a finished shard of an earlier run is kept).
      tokenizer: the tokenizer (saved to ``out/tokenizer``).
      options: how documents are read and split.
      workers: tokenizing processes (at most one per shard to build).
      progress: show a tqdm bar (shards, tokens/s).
      overwrite: build into an ``out`` that is not this build's (``build_dir``).

    Raises:
      BadInput: a bad input file (one line naming it) without ``skip_bad``.
      FileExistsError: ``out`` is a file, another build's (without ``overwrite``) or locked.
      ValueError: no documents at all, or bad options.
    """
    if isinstance(workers, bool) or not isinstance(workers, numbers.Integral) or workers < 1:
        raise ValueError(f"workers must be a whole number >= 1, got {workers!r}")
    if storage.is_remote(out):
        return _build_remote(inputs, os.fspath(out).rstrip("/"), tokenizer, options=options,
                             workers=workers, progress=progress, overwrite=overwrite)
    out = Path(out).expanduser()
    srcs = sources_lib.resolve_sources(list(inputs), exclude=[out])
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out} is a file, not a directory")
    out.mkdir(parents=True, exist_ok=True)
    with locked(out):
        identity = {"format": FORMAT, "version": VERSION, "tokenizer": tokenizer.fingerprint,
                    "inputs": sorted({os.path.abspath(os.path.expanduser(os.fspath(i)))
                                      for i in inputs}),
                    "options": dataclasses.asdict(options)}
        claim(out, identity, overwrite)
        return _build_locked(srcs, out, tokenizer, options, workers, progress)


def _build_locked(srcs: list[sources_lib.Source], out: Path, tokenizer: TextTokenizer,
                  options: BuildOptions, workers: int, progress: bool) -> dict[str, Any]:
    """``build`` once ``out`` is claimed and locked."""
    pieces = sources_lib.plan_pieces(srcs, options.shard_bytes)
    shards = group_shards(pieces, options.shard_bytes)
    dtype = token_dtype(tokenizer.vocab_size)
    # Workers and training load the saved copy: its fingerprint (of its files) is recorded.
    tokenizer = _save_tokenizer(tokenizer, out / TOKENIZER_DIR)
    settings = {"tokenizer": tokenizer.fingerprint, "dtype": dtype.name,
                **dataclasses.asdict(options)}
    settings.pop("shard_bytes")
    tasks = [(i, [p.key() for p in shard], settings) for i, shard in enumerate(shards)]
    done = {i: _finished(out, i, _plan(keys, settings)) for i, keys, _ in tasks}
    todo = [t for t in tasks if done[t[0]] is None]
    beyond = _beyond(out, len(shards))
    if todo or beyond:
        # The shards change under it: a reader never sees it beside other shards.
        (out / METADATA).unlink(missing_ok=True)
    for path in beyond:
        path.unlink()
    used = max(1, min(workers, len(todo)))
    logger.info("%d inputs -> %d pieces -> %d shards (%d already built) with %d worker(s)%s",
                len(srcs), len(pieces), len(shards), len(shards) - len(todo), used,
                f" (--workers {workers}: one per shard to build)" if used < workers else "")
    from tqdm import tqdm

    bar = tqdm(total=len(shards), initial=len(shards) - len(todo), unit="shard",
               disable=not progress, dynamic_ncols=True, file=sys.stderr)
    start, tokens = time.perf_counter(), 0
    with _pool(used, str(out)) as imap:
        for record in imap(_build_shard, todo):
            done[record["index"]] = record
            tokens += record["train_tokens"] + record["val_tokens"]
            bar.update(1)
            bar.set_postfix_str(f"{tokens / (time.perf_counter() - start):,.0f} tokens/s",
                                refresh=False)
    bar.close()
    seconds = time.perf_counter() - start
    records = [done[i] for i in range(len(shards))]
    meta = _metadata(records, srcs, tokenizer, dtype, options)
    if not meta["train_docs"]:
        raise ValueError(f"the inputs {[s.path for s in srcs]} hold no documents for the "
                         "train split")
    with atomic_writer(out / METADATA) as f:
        f.write(json.dumps(meta, indent=1, sort_keys=True).encode())
    logger.info("built %s: %d shards, %d/%d docs and %d/%d tokens (train/val); %d tokens in "
                "%.1f s (%.0f tokens/s)", out, len(shards), meta["train_docs"],
                meta["val_docs"], meta["train_tokens"], meta["val_tokens"], tokens, seconds,
                tokens / max(seconds, 1e-9))
    meta["build_tokens"], meta["build_seconds"] = tokens, seconds  # not in the file
    return meta


def _build_remote(inputs: Sequence[str], url: str, tokenizer: TextTokenizer, **kw: Any
                  ) -> dict[str, Any]:
    """``build`` in a local staging copy of the bucket (so a build continued on another machine
    skips the shards uploaded), then uploaded, ``metadata.json`` last."""
    storage.check_bucket(url, "--out")
    local = (storage.local_copy(url, purpose="build") if storage.as_path(url).exists()
             else storage.staging_dir(url, "build"))
    try:
        meta = build(inputs, local, tokenizer, **kw)
    except FileExistsError as e:  # said of the bucket, not of its local copy
        raise FileExistsError(str(e).replace(str(local), url)) from None
    sent = storage.push(local, url, exclude=(METADATA,)) + storage.push(local, url)
    logger.info("uploaded %d file%s of the build to %s", sent, "" if sent == 1 else "s", url)
    return meta


def _plan(keys: list, settings: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps([VERSION, keys, settings]).encode()).hexdigest()[:24]


def _finished(out: Path, index: int, plan: str) -> dict[str, Any] | None:
    """The record of shard ``index`` when it was built from this plan and its files exist."""
    try:
        record = json.loads((out / f"shard-{index:05d}.json").read_text())
    except (OSError, ValueError):
        return None
    names = [shard_name(s, index) for s in SPLITS]
    names += [n.replace(".arrayrecord", ".lengths.npy") for n in names]
    if record.get("plan") != plan or not all((out / n).is_file() for n in names):
        return None
    return record


_SHARD_FILE = re.compile(r"(?:(?:train|val)-(\d{5})\.(?:arrayrecord|lengths\.npy)"
                         r"|shard-(\d{5})\.json)")


def _beyond(out: Path, count: int) -> list[Path]:
    """The files of shards ``count, count + 1, ...`` that a bigger earlier plan left."""
    matches = ((path, _SHARD_FILE.fullmatch(path.name)) for path in out.iterdir())
    return [path for path, m in matches if m and int(m.group(1) or m.group(2)) >= count]


# Per worker process: the build directory and its tokenizer, loaded once.
_WORKER: dict[str, Any] = {}


def _init_worker(out: str) -> None:
    logging.basicConfig(level=logging.WARNING)
    _WORKER["out"] = Path(out)
    _WORKER["tokenizer"] = load_tokenizer(Path(out) / TOKENIZER_DIR)


def _build_shard(task: tuple[int, list, dict[str, Any]]) -> dict[str, Any]:
    """Tokenizes one shard's pieces into its files (atomically) and returns its record."""
    from array_record.python.array_record_module import ArrayRecordWriter

    index, keys, settings = task
    out, tokenizer = _WORKER["out"], _WORKER["tokenizer"]
    if tokenizer.fingerprint != settings["tokenizer"]:
        raise RuntimeError(f"{out / TOKENIZER_DIR} changed during the build")
    dtype = np.dtype(settings["dtype"]).newbyteorder("<")
    tmp = {s: out / f".{shard_name(s, index)}.tmp{os.getpid()}" for s in SPLITS}
    writers = {s: ArrayRecordWriter(str(tmp[s]), _WRITER_OPTIONS) for s in SPLITS}
    lengths: dict[str, list[int]] = {s: [] for s in SPLITS}
    skipped = []
    try:
        for path, kind, size, _, start, stop in keys:
            piece = sources_lib.Piece(sources_lib.Source(path, kind, size), start, stop, size)
            try:
                # Read whole before any is written: skipping it leaves none of its documents.
                docs = list(sources_lib.documents(piece, settings["field"],
                                                  settings["text_docs"]))
            except sources_lib.BadInput as e:
                if not settings["skip_bad"]:
                    raise
                logger.warning("skipped %s", e)
                skipped.append(str(e))
                continue
            for text in docs:
                ids = np.asarray(tokenizer.encode(text, add_bos=settings["add_bos"],
                                                  add_eos=settings["add_eos"]), dtype=dtype)
                split = "val" if is_held_out(text, settings["val_fraction"]) else "train"
                writers[split].write(ids.tobytes())
                lengths[split].append(len(ids))
    finally:
        for writer in writers.values():
            writer.close()
    record = {"index": index, "plan": _plan(keys, settings), "skipped": skipped,
              "pieces": [k[:1] + k[4:] for k in keys]}
    for split in SPLITS:
        name = shard_name(split, index)
        with atomic_writer(out / name.replace(".arrayrecord", ".lengths.npy")) as f:
            np.save(f, np.asarray(lengths[split], dtype=np.int64))
        os.replace(tmp[split], out / name)
        record[f"{split}_docs"] = len(lengths[split])
        record[f"{split}_tokens"] = int(sum(lengths[split]))
        # Its size, so a reader finds a truncated file with a stat (``shard_checks``).
        record[f"{split}_bytes"] = (out / name).stat().st_size
    with atomic_writer(out / f"shard-{index:05d}.json") as f:
        f.write(json.dumps(record, sort_keys=True).encode())
    return record


@contextlib.contextmanager
def _pool(workers: int, out: str):
    """``imap`` over the tasks: in this process for one worker, else a spawned pool (a fork
    could copy locks held by tokenizer threads)."""
    if workers <= 1:
        _init_worker(out)
        yield lambda fn, tasks: map(fn, tasks)
        return
    with multiprocessing.get_context("spawn").Pool(workers, _init_worker, (out,)) as pool:
        yield lambda fn, tasks: pool.imap_unordered(fn, tasks)


def _metadata(records: list[dict[str, Any]], srcs: list[sources_lib.Source],
              tokenizer: TextTokenizer, dtype: np.dtype, options: BuildOptions
              ) -> dict[str, Any]:
    shards = [{k: v for k, v in r.items() if k != "plan"} for r in records]
    meta: dict[str, Any] = {
        "format": FORMAT, "version": VERSION, "dtype": dtype.name,
        "tokenizer": {"fingerprint": tokenizer.fingerprint, "vocab_size": tokenizer.vocab_size,
                      "dir": TOKENIZER_DIR},
        "options": dataclasses.asdict(options),
        "sources": [dataclasses.asdict(s) for s in srcs],
        "shards": shards,
        "skipped": [s for r in records for s in r["skipped"]],
    }
    for split in SPLITS:
        meta[f"{split}_docs"] = sum(r[f"{split}_docs"] for r in records)
        meta[f"{split}_tokens"] = sum(r[f"{split}_tokens"] for r in records)
    return meta


def _save_tokenizer(tokenizer: TextTokenizer, directory: Path) -> TextTokenizer:
    """Saves the tokenizer to ``directory`` (replaced whole unless it holds it); returns a copy."""
    with contextlib.suppress(OSError, ValueError):
        saved = load_tokenizer(directory)
        if saved.fingerprint == tokenizer.fingerprint:
            return saved
    with replacing_directory(directory, carry_over=lambda name: False) as tmp:
        tokenizer.save(tmp)
    return load_tokenizer(directory)


def resolve_tokenizer(spec: str, inputs: Sequence[str], vocab_size: int, cache_dir: str,
                      *, exclude: Sequence[str | os.PathLike[str]] = ()) -> TextTokenizer:
    """``--tokenizer``: a file or directory to load, or ``bpe``/``unigram``/``char`` to train
    (cached) on the text files among the inputs (less ``exclude``)."""
    if spec not in MODEL_TYPES:
        return load_tokenizer(Path(spec).expanduser())
    srcs = sources_lib.resolve_sources(list(inputs), exclude=exclude)
    text = [Path(s.path) for s in srcs if s.kind == "text"]
    if not text:
        raise ValueError(f"--tokenizer {spec} trains on the text files of --input, and there "
                         "are none: pass --tokenizer FILE|DIR")
    return Tokenizer.train_or_load(text, Path(cache_dir).expanduser(), vocab_size, spec)


__all__ = ["FORMAT", "MARKER", "METADATA", "SPLITS", "BuildOptions", "build", "group_shards",
           "is_held_out", "resolve_tokenizer", "shard_name"]
