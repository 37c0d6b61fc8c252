"""Instruction data: JSONL records -> token examples with a loss mask -> packed rows -> batches.

Records (``instruct_records``) are cut to a row of ``seq_len + 1`` tokens by ``fit`` and packed
by best-fit decreasing, each example its own segment (``segment_ids``, ``positions``). Global
row ``j`` of step ``s`` is packed row ``perm_e[(s B + j) % R]`` of epoch ``e = (s B + j) // R``,
``perm_e`` a permutation from ``np.random.default_rng([seed, e])``.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import logging
import operator
import os
from collections.abc import Iterator, Sequence

import numpy as np

from transformer_jax.data.batches import (
    HostBatch,
    StepBatches,
    check_non_negative,
    eval_row_batches,
)
from transformer_jax.data.instruct_records import (
    Example,
    InstructionDataError,
    as_paths,
    chat_pieces,
    count,
    describe_paths,
    encode_chat,
    encode_prompt_completion,
    load_examples,
    read_jsonl,
)
from transformer_jax.tokenizer import TextTokenizer

logger = logging.getLogger(__name__)


def fit(example: Example, capacity: int) -> tuple[Example | None, str]:
    """``example`` cut to at most ``capacity`` tokens: the prompt loses tokens from its start
    (after ``example.head``), then the end is cut. Returns ``(example or None, what happened)``:
    ``"kept"``, ``"start"``, ``"end"``, ``"both"`` (what was cut) or ``"dropped"`` (no target)."""
    n = len(example.tokens)
    if n <= capacity:
        return example, "kept"
    targets = np.flatnonzero(example.loss[1:]) + 1
    first = int(targets[0]) if len(targets) else n
    head = min(example.head, first - 1)
    cut = min(n - capacity, max(first - 1 - head, 0))
    keep = np.r_[0:head, head + cut:n][:capacity]
    loss = example.loss[keep]
    if not loss[1:].any():
        return None, "dropped"
    kind = {(True, False): "start", (False, True): "end", (True, True): "both"}[
        (cut > 0, n - cut > capacity)]
    return dataclasses.replace(example, tokens=example.tokens[keep], loss=loss), kind


@dataclasses.dataclass(frozen=True, eq=False)
class PackedData:
    """Examples packed into R rows: ``tokens``, ``segment_ids`` (1, 2, ... per example; 0:
    padding) and ``positions`` [R, T + 1] int32, ``loss_tokens`` [R, T + 1] bool; of the
    ``num_examples`` packed, ``num_truncated`` were cut by ``fit``; ``num_dropped`` left out."""

    tokens: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray
    loss_tokens: np.ndarray
    num_examples: int
    num_truncated: int = 0
    num_dropped: int = 0

    @property
    def seq_len(self) -> int:
        """T, the length of a batch row's inputs and targets."""
        return self.tokens.shape[1] - 1

    @property
    def num_rows(self) -> int:
        """R, the number of packed rows."""
        return self.tokens.shape[0]

    def take(self, index: np.ndarray) -> PackedData:
        """The rows ``index`` [R'] (in that order), counting the examples they hold."""
        segment_ids = self.segment_ids[index]
        return PackedData(self.tokens[index], segment_ids, self.positions[index],
                          self.loss_tokens[index], int(segment_ids.max(axis=1).sum()))


def best_fit_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Best-fit-decreasing packing of items of ``lengths[i] <= capacity`` slots (longest first,
    ties by index); returns the rows, each the indices of its items in placement order."""
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row), sorted
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        k = bisect.bisect_left(free, (lengths[i], -1))
        if k < len(free):
            room, row = free.pop(k)
        else:
            room, row = capacity, len(rows)
            rows.append([])
        rows[row].append(i)
        if room - lengths[i] > 0:
            bisect.insort(free, (room - lengths[i], row))
    return rows


def packed_layout(lengths: Sequence[int], capacity: int
                  ) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int]]]:
    """Where items of ``lengths`` go in rows of ``capacity`` (``best_fit_rows``): ``segment_ids``
    and ``positions`` [R, capacity] int32, and per item its ``(row, first slot)``."""
    rows = best_fit_rows(lengths, capacity)
    segment_ids = np.zeros((len(rows), capacity), dtype=np.int32)
    positions = np.zeros((len(rows), capacity), dtype=np.int32)
    slots: list[tuple[int, int]] = [(0, 0)] * len(lengths)
    for r, members in enumerate(rows):
        start = 0
        for segment, i in enumerate(members, start=1):
            n = lengths[i]
            segment_ids[r, start : start + n] = segment
            positions[r, start : start + n] = np.arange(n)
            slots[i] = (r, start)
            start += n
    return segment_ids, positions, slots


def pack(examples: Sequence[Example], seq_len: int, pad_id: int = 0) -> PackedData:
    """Packs examples into rows of ``seq_len + 1`` tokens (best-fit decreasing); longer ones
    are cut by ``fit`` or dropped (one warning). ValueError for a non-positive ``seq_len``, no
    examples, or none with a loss token that fits."""
    seq_len = operator.index(seq_len)
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    if not examples:
        raise ValueError("no examples to pack")
    capacity = seq_len + 1
    results = [fit(example, capacity) for example in examples]
    kinds = collections.Counter(kind for _, kind in results)
    fitted = [kept for kept, _ in results if kept is not None]
    long = len(examples) - kinds["kept"]
    if long:
        logger.warning(
            "%d of %s %s longer than seq_len + 1 = %d tokens: the prompt's start was cut from "
            "%d (after the template's head), the completion's end from %d, and %d were dropped "
            "(no completion/assistant token fits)", long, count(len(examples), "example"),
            "is" if long == 1 else "are", capacity, kinds["start"] + kinds["both"],
            kinds["end"] + kinds["both"], kinds["dropped"])
    if not fitted:
        raise ValueError(
            f"none of the {count(len(examples), 'example')} has a completion/assistant token "
            f"within seq_len + 1 = {capacity} tokens; raise train.seq_len")
    examples = fitted
    lengths = [len(e.tokens) for e in examples]
    segment_ids, positions, slots = packed_layout(lengths, capacity)
    tokens = np.full(segment_ids.shape, pad_id, dtype=np.int32)
    loss_tokens = np.zeros(segment_ids.shape, dtype=bool)
    for example, (r, start) in zip(examples, slots, strict=True):
        tokens[r, start : start + len(example.tokens)] = example.tokens
        loss_tokens[r, start : start + len(example.tokens)] = example.loss
    rows = segment_ids.shape[0]
    logger.info("packed %s into %s of %d tokens (%.1f%% padding)", count(len(examples), "example"),
                count(rows, "row"), capacity, 100.0 * (1.0 - sum(lengths) / (rows * capacity)))
    return PackedData(tokens, segment_ids, positions, loss_tokens, len(examples),
                      long - kinds["dropped"], kinds["dropped"])


def load_instruction_data(path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
                          tokenizer: TextTokenizer, seq_len: int, *, add_eos: bool = True
                          ) -> PackedData:
    """``load_examples`` (and its errors) packed into rows of ``seq_len + 1`` tokens, for
    ``PackedBatches``; ValueError when no record keeps a loss token within a row."""
    examples = load_examples(path, tokenizer, add_eos=add_eos)
    try:
        return pack(examples, seq_len, tokenizer.pad_id)
    except ValueError as e:
        raise ValueError(f"{describe_paths(as_paths(path))}: {e}") from None


def row_indices(seed: int, step: int, batch_size: int, num_rows: int) -> np.ndarray:
    """Packed-row indices [B] int64 of the global batch for (seed, step): every epoch (R
    consecutive global rows) visits each row once, permuted by ``default_rng([seed, epoch])``."""
    seed, step = check_non_negative("seed", seed), check_non_negative("step", step)
    if batch_size <= 0 or num_rows <= 0:
        raise ValueError(f"batch_size ({batch_size}) and num_rows ({num_rows}) must be positive")
    flat = step * batch_size + np.arange(batch_size, dtype=np.int64)
    epochs, within = np.divmod(flat, num_rows)
    out = np.empty(batch_size, dtype=np.int64)
    for epoch in np.unique(epochs):
        order = np.random.default_rng([seed, int(epoch)]).permutation(num_rows)
        selected = epochs == epoch
        out[selected] = order[within[selected]]
    return out


def rows_to_batch(data: PackedData, rows: np.ndarray) -> HostBatch:
    """The batch of the packed rows ``rows`` [B]: ``inputs``, ``targets``, ``segment_ids``,
    ``positions`` (int32) and ``loss_mask`` (float32: targets to score), each [B, T]."""
    tokens = data.tokens[rows]
    segments = data.segment_ids[rows]
    same_example = (segments[:, 1:] == segments[:, :-1]) & (segments[:, :-1] > 0)
    loss_mask = data.loss_tokens[rows][:, 1:] & same_example
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": segments[:, :-1],
            "positions": data.positions[rows][:, :-1], "loss_mask": loss_mask.astype(np.float32)}


@dataclasses.dataclass(frozen=True, eq=False)
class PackedBatches(StepBatches):
    """Deterministic batches of the packed rows ``data`` (``StepBatches``: pure in (seed,
    step); process p of P takes its block of the global batch's B rows)."""

    data: PackedData
    batch_size: int
    seed: int = 0
    process_index: int = 0
    process_count: int = 1

    def __post_init__(self) -> None:
        self._check_split()

    def get(self, step: int) -> HostBatch:
        """This process's part of the batch for ``step`` (``rows_to_batch``), [B / P, T]."""
        rows = row_indices(self.seed, step, self.batch_size, self.data.num_rows)
        return rows_to_batch(self.data, self._mine(rows))


def with_mask(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``instruct``'s ``loss_mask`` as the train/eval step's ``mask``."""
    batch = dict(batch)
    batch["mask"] = batch.pop("loss_mask")
    return batch


def packed_eval_batches(rows: PackedData, batch_size: int, max_batches: int | None,
                        process_index: int, process_count: int
                        ) -> Iterator[dict[str, np.ndarray]]:
    """Every row once, in order, in batches of ``batch_size`` (``eval_row_batches``, padded)."""
    return eval_row_batches(rows.num_rows, batch_size, max_batches,
                            lambda index: with_mask(rows_to_batch(rows, index)), process_index,
                            batch_size // process_count, pad=True)

__all__ = ["HostBatch", "Example", "InstructionDataError", "PackedBatches", "PackedData",
           "best_fit_rows", "chat_pieces", "count", "encode_chat", "encode_prompt_completion",
           "fit", "load_examples", "load_instruction_data", "pack", "packed_layout", "read_jsonl",
           "row_indices", "packed_eval_batches", "rows_to_batch", "with_mask"]
