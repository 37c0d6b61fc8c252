"""Held-out evaluation sets of a run (``train.eval_sets=name=PATH,...``): loss in nats per token
and bits per byte, at every evaluation.

A set is a text file (one document) or a ``.jsonl`` file (a ``"text"`` per line), each document
predicted from bos (else eos, else its first token) in windows of ``seq_len + 1`` tokens.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from transformer_jax.data.instruct import PackedData, pack, packed_eval_batches
from transformer_jax.data.instruct_records import Example, InstructionDataError, read_jsonl
from transformer_jax.tokenizer import TextTokenizer

FIELD = "train.eval_sets"
_NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclasses.dataclass(frozen=True)
class EvalSet:
    """One evaluation set, packed: ``rows`` its windows, ``num_tokens`` the predicted tokens
    and ``num_bytes`` the UTF-8 bytes of their text (the denominator of bits per byte)."""

    name: str
    path: Path
    rows: PackedData
    num_documents: int
    num_tokens: int
    num_bytes: int

    def batches(self, batch_size: int, process_index: int = 0, process_count: int = 1,
                **_: Any) -> Iterator[dict[str, np.ndarray]]:
        """This process's share of every row of the set, in batches (``packed_eval_batches``)."""
        return packed_eval_batches(self.rows, batch_size, None, process_index, process_count)

    def bits_per_byte(self, loss: float) -> float:
        """Bits per byte of a mean loss in nats per token over this set."""
        return bits_per_byte(loss, self.num_tokens, self.num_bytes)


def bits_per_byte(nats_per_token: float, num_tokens: int, num_bytes: int) -> float:
    """``nats_per_token * num_tokens / (ln 2 * num_bytes)``."""
    return nats_per_token * num_tokens / (math.log(2) * num_bytes)


def parse_eval_sets(spec: str) -> list[tuple[str, Path]]:
    """``"a=PATH,b=PATH"`` -> ``[("a", Path), ("b", Path)]``, checking only the syntax:
    ValueError for an item without ``=``, a bad or repeated name, or an empty path."""
    out: list[tuple[str, Path]] = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        name, eq, path = (s.strip() for s in item.partition("="))
        if not eq or not path:
            raise ValueError(f"{FIELD}: {item!r} is not NAME=PATH")
        if not _NAME.fullmatch(name):
            raise ValueError(f"{FIELD}: name {name!r} of {item!r} must be letters, digits, "
                             "'_', '.' or '-'")
        if name in (n for n, _ in out):
            raise ValueError(f"{FIELD}: the name {name!r} is given twice")
        out.append((name, Path(path).expanduser()))
    return out


def read_documents(name: str, path: Path) -> list[str]:
    """The documents of a set's file: a ``.jsonl`` file's ``"text"`` fields, or the whole text;
    errors (no file, not UTF-8, a line without a string ``"text"``, no text) name the file."""
    where = f"{FIELD}: {name}={path}"
    if not path.is_file():
        raise FileNotFoundError(f"{where}: no such file")
    if path.suffix == ".jsonl":
        docs = []
        try:
            for line, record in read_jsonl(path):
                text = record.get("text")
                if not isinstance(text, str):
                    raise ValueError(f"{where}:{line}: needs a string \"text\" field")
                docs.append(text)
        except InstructionDataError as e:
            raise ValueError(f"{FIELD}: {name}={e}") from None
    else:
        try:
            docs = [path.read_text(encoding="utf-8")]
        except UnicodeDecodeError as e:
            raise ValueError(f"{where}: not valid UTF-8 text ({e})") from None
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise ValueError(f"{where}: the file holds no text")
    return docs


def document_windows(ids: Sequence[int], prefix: int | None, seq_len: int) -> list[Example]:
    """A document's windows of at most ``seq_len + 1`` tokens, overlapping by one, whose
    ``loss`` marks each token predicted (all but the first: the prefix, or the first id)."""
    seq = np.asarray(([prefix] if prefix is not None else []) + list(ids), np.int32)
    windows = [seq[start:start + seq_len + 1] for start in range(0, max(len(seq) - 1, 0), seq_len)]
    return [Example(tokens, np.arange(len(tokens)) > 0, line=0) for tokens in windows]


def load_eval_set(name: str, path: Path, tokenizer: TextTokenizer, seq_len: int) -> EvalSet:
    """Reads, tokenizes and packs one set (see the module's docstring)."""
    docs = read_documents(name, path)
    prefix = next((t for t in (tokenizer.bos_id, tokenizer.eos_id) if t >= 0), None)
    windows, tokens, num_bytes = [], 0, 0
    for doc in docs:
        ids = tokenizer.encode(doc)
        predicted = ids if prefix is not None else ids[1:]
        windows += document_windows(ids, prefix, seq_len)
        tokens += len(predicted)
        num_bytes += len(tokenizer.decode(predicted).encode("utf-8"))
    if not tokens or not num_bytes:
        raise ValueError(f"{FIELD}: {name}={path}: no token to predict (one token per "
                         "document, and no bos or eos to start from)")
    return EvalSet(name, path, pack(windows, seq_len, max(tokenizer.pad_id, 0)), len(docs),
                   tokens, num_bytes)


def load_eval_sets(spec: str, tokenizer: TextTokenizer, seq_len: int) -> list[EvalSet]:
    """Every set of ``train.eval_sets`` (empty: none); errors name the field and the file."""
    return [load_eval_set(name, path, tokenizer, seq_len) for name, path in parse_eval_sets(spec)]


def evaluate_sets(evaluate: Callable[[Iterator[dict[str, np.ndarray]]], float],
                  sets: Sequence[EvalSet], batching: dict[str, Any]
                  ) -> dict[str, tuple[float, float]]:
    """``{name: (nats per token, bits per byte)}``; ``evaluate(batches)`` gives a mean loss."""
    out = {}
    for s in sets:
        loss = evaluate(s.batches(**batching))
        out[s.name] = (loss, s.bits_per_byte(loss))
    return out


__all__ = ["EvalSet", "bits_per_byte", "document_windows", "evaluate_sets", "load_eval_set",
           "load_eval_sets", "parse_eval_sets", "read_documents"]
