"""Training a SentencePiece model on a corpus: corpus -> trainer sentences -> model bytes, with
identity normalization, every space kept, UTF-8 byte fallback and ids ``unk=0, bos=1, eos=2,
pad=3``; ``cached_model_path`` is ``Tokenizer.train_or_load``'s cache key."""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import logging
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

import sentencepiece as spm

logger = logging.getLogger(__name__)

ModelType = Literal["bpe", "unigram", "char"]
MODEL_TYPES: tuple[str, ...] = ("bpe", "unigram", "char")

UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
_NUM_SPECIAL = 4
_NUM_BYTE_PIECES = 256
# SentencePiece's space inside pieces: the same character in input text would decode as one.
SPACE_MARKER = "\u2581"

# Bump when the training recipe changes so that train_or_load does not reuse stale models.
_TRAIN_RECIPE_VERSION = 1

# At most 4096 UTF-8 bytes: SentencePiece skips sentences over max_sentence_length (4192).
_MAX_SENTENCE_CHARS = 1024

# A line terminator run and the line's text: the terminator *starts* a training sentence, as
# the trainer strips trailing "\r"/"\n" (which would keep newlines out of the vocabulary).
_SEGMENT_RE = re.compile(r"[\r\n]*[^\r\n]+|[\r\n]+")

# Trainer options that this module must control for the id layout and I/O to be right.
_RESERVED_TRAINER_OPTIONS = frozenset({"input", "model_prefix", "model_writer",
                                       "sentence_iterator", "sentence_reader", "model_type",
                                       "vocab_size", "unk_id", "bos_id", "eos_id", "pad_id"})

Source = os.PathLike[str] | Iterable[str] | Iterable[os.PathLike[str]]


def train_model(files: list[Path] | None, texts: list[str] | None, vocab_size: int,
                model_type: str, /, *, byte_fallback: bool | None = None,
                character_coverage: float | None = None, num_threads: int | None = None,
                **trainer_options: Any) -> bytes:
    """The bytes of a ``.model`` file trained on ``files`` (UTF-8, one document each) or
    ``texts`` (one of them None, as ``split_source`` gives); the rest, ValueError included, as
    ``Tokenizer.train``."""
    if model_type not in MODEL_TYPES:
        raise ValueError(f"unknown model_type {model_type!r}; expected one of {MODEL_TYPES}")
    reserved = sorted(_RESERVED_TRAINER_OPTIONS & trainer_options.keys())
    if reserved:
        raise ValueError(f"trainer options {reserved} are fixed by Tokenizer.train")
    is_char = model_type == "char"
    if byte_fallback is None:
        byte_fallback = not is_char
    if is_char and byte_fallback:
        raise ValueError("byte_fallback=True is not supported for model_type='char'")
    if character_coverage is None:
        character_coverage = 1.0 if is_char else 0.9995
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool):
        raise ValueError(f"vocab_size must be an int, got {vocab_size!r}")
    min_size = _NUM_SPECIAL + 1 + (_NUM_BYTE_PIECES if byte_fallback else 0)
    if not is_char and vocab_size < min_size:
        raise ValueError(f"vocab_size={vocab_size} is too small for model_type={model_type!r} "
                         f"with byte_fallback={byte_fallback}: need at least {min_size}")

    def documents() -> Iterator[str]:
        return map(read_utf8, files) if files is not None else iter(texts or ())

    options: dict[str, Any] = {
        "model_type": model_type, "vocab_size": vocab_size, "unk_id": UNK_ID, "bos_id": BOS_ID,
        "eos_id": EOS_ID, "pad_id": PAD_ID, "byte_fallback": byte_fallback,
        "character_coverage": character_coverage, "normalization_rule_name": "identity",
        "remove_extra_whitespaces": False, "add_dummy_prefix": False,
        "allow_whitespace_only_pieces": True, "split_digits": True,
        # A small corpus may not support the requested size; a smaller vocab beats an error.
        "hard_vocab_limit": False,
        "num_threads": num_threads or min(16, os.cpu_count() or 1), "minloglevel": 1,
    }
    if is_char:
        chars = set(itertools.chain.from_iterable(documents()))
        unrepresentable = chars & {"\x00", SPACE_MARKER}
        if unrepresentable:
            logger.warning("char tokenizer cannot represent %s in the corpus: NUL becomes unk "
                           "and U+2581 decodes as a space", sorted(unrepresentable))
        # Every corpus character in the vocabulary (the space is stored as the marker).
        chars -= {" ", "\x00", SPACE_MARKER}
        options["required_chars"] = "".join(sorted(chars))
        options["use_all_vocab"] = True
    options.update(trainer_options)

    sentences = _training_sentences(documents())
    first = next(sentences, None)
    if first is None:
        raise ValueError("cannot train a tokenizer on an empty corpus (no non-empty text)")
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(sentence_iterator=itertools.chain([first], sentences),
                                       model_writer=model, **options)
    except RuntimeError as e:
        raise ValueError(f"SentencePiece training failed (model_type={model_type!r}, "
                         f"vocab_size={vocab_size}): {e}") from e
    return model.getvalue()


def cached_model_path(cache_dir: str | os.PathLike[str], files: list[Path] | None,
                      texts: list[str] | None, vocab_size: int, model_type: str,
                      options: dict[str, Any]) -> Path:
    """Where ``Tokenizer.train_or_load`` caches the model: a file named by a hash of the corpus
    contents, ``vocab_size``, ``model_type``, ``options`` and the recipe version."""
    payload = json.dumps({"recipe": _TRAIN_RECIPE_VERSION,
                          "corpus": _corpus_fingerprint(files, texts), "vocab_size": vocab_size,
                          "model_type": model_type,
                          "options": {k: repr(v) for k, v in sorted(options.items())}},
                         sort_keys=True)
    key = hashlib.sha256(payload.encode()).hexdigest()[:16]
    return Path(cache_dir) / f"tokenizer-{model_type}-{vocab_size}-{key}.model"


def read_utf8(path: str | os.PathLike[str]) -> str:
    """Reads a file as strict UTF-8 (ValueError if it is not), line endings as stored."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not valid UTF-8: {e}") from e


def split_source(source: Source) -> tuple[list[Path] | None, list[str] | None]:
    """Turns a corpus argument into (files, None) or (None, texts)."""
    if isinstance(source, os.PathLike):
        return [Path(source)], None
    if isinstance(source, str | bytes):
        raise TypeError("source must be an iterable of documents or of file paths, not a single "
                        "str; pass [text] for one document or pathlib.Path(...) for one file")
    items = list(source)
    if not items:
        raise ValueError("cannot train a tokenizer on an empty corpus (no documents or files)")
    if all(isinstance(item, os.PathLike) for item in items):
        files = [Path(item) for item in items]
        if missing := [file for file in files if not file.is_file()]:
            raise FileNotFoundError(f"corpus file not found: {missing[0]}")
        return files, None
    if all(isinstance(item, str) for item in items):
        for item in items:
            # Guards against passing file names as str, which would train on the names.
            if len(item) < 4096 and "\n" not in item and os.path.isfile(item):
                raise ValueError(f"document {item!r} is the name of an existing file; plain str "
                                 "items are treated as text, pass pathlib.Path objects to train "
                                 "on files")
        return None, items
    kinds = sorted({type(item).__name__ for item in items})
    raise TypeError(f"source items must be all str documents or all paths, got {kinds}")


def _corpus_fingerprint(files: list[Path] | None, texts: list[str] | None) -> str:
    digest = hashlib.sha256()
    if files is not None:
        for file in files:
            with open(file, "rb") as f:
                digest.update(hashlib.file_digest(f, "sha256").digest())
    else:
        for text in texts or ():
            data = text.encode("utf-8", "surrogatepass")
            # Length prefix keeps ["ab", "c"] and ["a", "bc"] apart.
            digest.update(len(data).to_bytes(8, "little"))
            digest.update(data)
    return digest.hexdigest()


def _training_sentences(documents: Iterable[str]) -> Iterator[str]:
    """Cuts documents into trainer sentences that start with their line terminator."""
    for doc in documents:
        for segment in _SEGMENT_RE.findall(doc):
            if not segment.strip("\r\n"):
                continue  # The trainer would strip it to nothing.
            for start in range(0, len(segment), _MAX_SENTENCE_CHARS):
                yield segment[start : start + _MAX_SENTENCE_CHARS]
