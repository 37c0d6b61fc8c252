"""Preference data: JSONL pairs -> token examples (chosen, rejected) -> packed rows -> batches.

Each side is encoded as SFT's records are (the loss on the answer only); both sides of a pair
share one row (``PreferenceRows``). Batches are pure in (seed, step), as SFT's.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from transformer_jax.data.batches import StepBatches
from transformer_jax.data.instruct import (
    HostBatch,
    PackedData,
    best_fit_rows,
    fit,
    row_indices,
    rows_to_batch,
    with_mask,
)
from transformer_jax.data.instruct_records import (
    Example,
    InstructionDataError,
    _check_messages,
    as_paths,
    chat_example,
    count,
    describe_paths,
    prompt_completion_example,
    read_jsonl,
)
from transformer_jax.tokenizer import ChatTemplate, TextTokenizer

logger = logging.getLogger(__name__)

#: The keys of a preference record.
PAIR_KEYS = ("prompt", "chosen", "rejected")


@dataclasses.dataclass(frozen=True, eq=False)
class PreferenceRows:
    """Pairs packed into R rows (``rows``; pair k is segments 2k + 1 and 2k + 2), ``pair_ids``
    [R, M] int32 the index of each row's k-th pair (-1: none); ``step_rows`` is 0, or S when
    rows ``[g S, (g + 1) S)`` hold group g (``group_pairs``)."""

    rows: PackedData
    pair_ids: np.ndarray
    num_pairs: int
    step_rows: int = 0

    @property
    def row_pairs(self) -> np.ndarray:
        """[R] how many pairs each row holds."""
        return (self.pair_ids >= 0).sum(axis=1)

    @property
    def pairs_per_row(self) -> int:
        """M, the most pairs one row holds."""
        return self.pair_ids.shape[1]

    def take(self, index: np.ndarray) -> PreferenceRows:
        """The rows ``index`` (in that order; not grouped by step)."""
        return PreferenceRows(self.rows.take(index), self.pair_ids[index], self.num_pairs)


def is_preference_file(path: str | os.PathLike[str]) -> bool:
    """Whether the first record of a JSONL file has the keys of a pair (``PAIR_KEYS``)."""
    for _, record in read_jsonl(path):
        return all(k in record for k in PAIR_KEYS)
    return False


def _answer(value: Any, where: str, side: str) -> list[dict[str, Any]]:
    """A chat record's ``chosen``/``rejected`` as a list of messages."""
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not value:
        raise InstructionDataError(f'{where}: "{side}" must be a string, a message or a '
                                   "non-empty list of messages")
    return value


def load_pairs(path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
               tokenizer: TextTokenizer, *, add_eos: bool = True
               ) -> list[tuple[Example, Example]]:
    """``(chosen, rejected)`` examples of every pair of one or several JSONL files, in order.
    InstructionDataError (``FILE:LINE: ...``) for a bad record or a side with no loss token;
    also for no pairs, or only pairs whose sides are equal (some: a warning names them)."""
    paths = as_paths(path)
    template: ChatTemplate | None = None
    pairs: list[tuple[Example, Example]] = []
    same: list[str] = []  # FILE:LINE of pairs whose sides are equal
    for file in paths:
        for line, record in read_jsonl(file):
            where = f"{file}:{line}"
            missing = [k for k in PAIR_KEYS if k not in record]
            if missing:
                raise InstructionDataError(
                    f'{where}: a preference record needs "prompt", "chosen" and "rejected"; '
                    f"missing {missing} (got keys {sorted(record)})")
            prompt, sides = record["prompt"], []
            if isinstance(prompt, list):
                messages = _check_messages(prompt, where)
                in_prompt = sum(m.get("role") == "assistant" for m in messages)
            elif not isinstance(prompt, str):
                raise InstructionDataError(f'{where}: "prompt" must be a string or a list of '
                                           f"messages, got {type(prompt).__name__}")
            for side in ("chosen", "rejected"):
                if isinstance(prompt, str):
                    if not isinstance(record[side], str):
                        raise InstructionDataError(
                            f'{where}: with a text "prompt", "{side}" must be a string')
                    sides.append(prompt_completion_example(prompt, record[side], tokenizer,
                                                           add_eos, line))
                    continue
                answer = _check_messages(_answer(record[side], where, side), where)
                # The answer's assistant turns carry the loss, the prompt's none.
                example, template = chat_example([*messages, *answer], tokenizer, template,
                                                 where, line, scored_from=in_prompt)
                sides.append(example)
            for side, example in zip(("chosen", "rejected"), sides, strict=True):
                if not example.loss[1:].any():
                    raise InstructionDataError(f'{where}: "{side}" has no tokens to score '
                                               "(empty, or no assistant turn)")
            if np.array_equal(sides[0].tokens, sides[1].tokens):
                same.append(where)
            pairs.append((sides[0], sides[1]))
    if not pairs:
        raise InstructionDataError(f"{describe_paths(paths)}: no preference records")
    _check_ties(same, len(pairs))
    return pairs


def _check_ties(same: list[str], num_pairs: int, limit: int = 3) -> None:
    """Warns of pairs whose sides are the same tokens; InstructionDataError if all are."""
    if not same:
        return
    what = 'the same tokens in "chosen" and "rejected": the pair has no preference to learn'
    if len(same) == num_pairs:
        raise InstructionDataError(f"{same[0]}: every pair has {what}")
    more = f" and {len(same) - limit} more" if len(same) > limit else ""
    logger.warning("%s of %d have %s (%s%s)", count(len(same), "pair"), num_pairs, what,
                   ", ".join(same[:limit]), more)


def fit_pair(chosen: Example, rejected: Example, capacity: int
             ) -> tuple[tuple[Example, Example] | None, bool]:
    """Both sides cut by ``instruct.fit`` to share ``capacity`` tokens (the shorter side keeps
    its length when it fits in half, the other gets the rest; else each gets half): ``(pair,
    or None when a side lost every loss token; whether anything was cut)``."""
    a, b = len(chosen.tokens), len(rejected.tokens)
    if a + b <= capacity:
        return (chosen, rejected), False
    first = a if a <= capacity // 2 else capacity - min(b, capacity // 2)
    c, r = (fit(e, n)[0] for e, n in zip((chosen, rejected), (first, capacity - first),
                                         strict=True))
    return (None if c is None or r is None else (c, r)), True


Pair = tuple[int, tuple[Example, Example]]  # (pair id, (chosen, rejected))


def _pack_groups(groups: Sequence[Sequence[Pair]], capacity: int, pad_id: int,
                 multiple: int = 0) -> tuple[PackedData, np.ndarray, int]:
    """Each group's pairs packed into rows of ``capacity`` tokens, with ``multiple`` padded to S
    rows (``group_pairs``); returns ``(rows, pair_ids [R, M], S or 0)``."""
    layouts = [best_fit_rows([len(c.tokens) + len(r.tokens) for _, (c, r) in group], capacity)
               for group in groups]
    step_rows = -(-max(map(len, layouts)) // multiple) * multiple if multiple else 0
    num_rows = len(groups) * step_rows if multiple else sum(map(len, layouts))
    shape = (num_rows, capacity)
    tokens = np.full(shape, pad_id, np.int32)
    segment_ids, positions = np.zeros(shape, np.int32), np.zeros(shape, np.int32)
    loss_tokens = np.zeros(shape, bool)
    width = max(len(members) for layout in layouts for members in layout)
    pair_ids = np.full((num_rows, width), -1, np.int32)
    first = 0  # the group's first row
    for group, layout in zip(groups, layouts, strict=True):
        for row, members in enumerate(layout, start=first):
            at = 0
            for slot, item in enumerate(members):
                pair_ids[row, slot], pair = group[item]
                for side, example in enumerate(pair):
                    span = slice(at, at + len(example.tokens))
                    tokens[row, span] = example.tokens
                    segment_ids[row, span] = 2 * slot + 1 + side
                    positions[row, span] = np.arange(len(example.tokens))
                    loss_tokens[row, span] = example.loss
                    at = span.stop
        first += step_rows or len(layout)
    num_sides = 2 * sum(map(len, groups))
    return (PackedData(tokens, segment_ids, positions, loss_tokens, num_sides), pair_ids,
            step_rows)


def pack_pairs(pairs: Sequence[tuple[Example, Example]], seq_len: int, pad_id: int = 0
               ) -> PreferenceRows:
    """Packs pairs into rows of ``seq_len + 1`` tokens, both sides of a pair in one row;
    ValueError for a non-positive ``seq_len`` or when no pair fits."""
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    capacity = seq_len + 1
    kept: list[Pair] = []
    cut = dropped = 0
    for i, (chosen, rejected) in enumerate(pairs):
        pair, was_cut = fit_pair(chosen, rejected, capacity)
        cut += was_cut and pair is not None
        if pair is None:
            dropped += 1
        else:
            kept.append((i, pair))
    if cut or dropped:
        logger.warning("%s of %s longer than seq_len + 1 = %d tokens: %d cut to fit, %d "
                       "dropped (a side kept no loss token)", cut + dropped,
                       count(len(pairs), "pair"), capacity, cut, dropped)
    if not kept:
        raise ValueError(f"none of the {count(len(pairs), 'pair')} fits both sides with a "
                         f"scored token in seq_len + 1 = {capacity} tokens; raise train.seq_len")
    rows, pair_ids, _ = _pack_groups([kept], capacity, pad_id)
    used = sum(len(c.tokens) + len(r.tokens) for _, (c, r) in kept)
    logger.info("packed %s into %s of %d tokens (%.1f%% padding, at most %d pairs a row)",
                count(len(kept), "pair"), count(rows.num_rows, "row"), capacity,
                100.0 * (1.0 - used / rows.tokens.size), pair_ids.shape[1])
    packed = dataclasses.replace(rows, num_truncated=cut, num_dropped=dropped)
    return PreferenceRows(packed, pair_ids, len(pairs))


def group_pairs(data: PreferenceRows, pairs_per_step: int, seed: int, multiple: int = 1
                ) -> PreferenceRows:
    """The pairs of ``data`` permuted once by ``seed`` and grouped so that a step trains on
    exactly ``pairs_per_step`` pairs: group g packed into rows ``[g S, (g + 1) S)``, S the most
    rows a group takes rounded up to ``multiple``. ValueError for arguments below 1."""
    if pairs_per_step < 1 or multiple < 1:
        raise ValueError(f"pairs_per_step ({pairs_per_step}) and multiple ({multiple}) must "
                         "be >= 1")
    rows = data.rows
    # Where each (row, segment) ends: a pair k spans segments 2k + 1 and 2k + 2, in order.
    sizes = np.stack([np.bincount(seg, minlength=2 * data.pairs_per_row + 1)
                      for seg in rows.segment_ids])
    ends = np.cumsum(sizes[:, 1:], axis=1)  # [R, 2M]: where segment s + 1 ends
    pairs: list[Pair] = []
    for r, k in zip(*np.nonzero(data.pair_ids >= 0), strict=True):
        a, b, c = ends[r, 2 * k - 1] if k else 0, ends[r, 2 * k], ends[r, 2 * k + 1]
        sides = [Example(rows.tokens[r, i:j], rows.loss_tokens[r, i:j], 0)
                 for i, j in ((a, b), (b, c))]
        pairs.append((int(data.pair_ids[r, k]), (sides[0], sides[1])))
    pairs.sort(key=lambda pair: pair[0])
    order = np.random.default_rng([seed, 0x9A125]).permutation(len(pairs))
    groups = [[pairs[p] for p in order[i:i + pairs_per_step]]
              for i in range(0, len(order), pairs_per_step)]
    pad = rows.tokens[rows.segment_ids == 0]  # pack_pairs' pad_id, where any row has room
    packed, pair_ids, step_rows = _pack_groups(groups, rows.tokens.shape[1],
                                               int(pad[0]) if pad.size else 0, multiple)
    packed = dataclasses.replace(packed, num_truncated=rows.num_truncated,
                                 num_dropped=rows.num_dropped)
    return PreferenceRows(packed, pair_ids, data.num_pairs, step_rows)


def load_preference_data(path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
                         tokenizer: TextTokenizer, seq_len: int) -> PreferenceRows:
    """Reads, tokenizes and packs JSONL preference files."""
    pairs = load_pairs(path, tokenizer)
    try:
        return pack_pairs(pairs, seq_len, tokenizer.pad_id)
    except ValueError as e:
        raise ValueError(f"{as_paths(path)[0]}: {e}") from None


def pair_batch(data: PreferenceRows, rows: np.ndarray, reference: np.ndarray | None = None
               ) -> HostBatch:
    """The batch of packed rows ``rows`` [B]: ``rows_to_batch``'s keys (with ``mask``),
    ``sequence_mask`` [B, T] (every target in its segment: ORPO's NLL), ``pair_ids`` [B, M] and,
    given ``reference`` [num_pairs, 2], ``ref_logps`` [B, M, 2] float32 (0 where no pair)."""
    batch = with_mask(rows_to_batch(data.rows, rows))
    segments = data.rows.segment_ids[rows]
    batch["sequence_mask"] = ((segments[:, 1:] == segments[:, :-1])
                              & (segments[:, :-1] > 0)).astype(np.float32)
    ids = data.pair_ids[rows]
    batch["pair_ids"] = ids
    if reference is not None:
        batch["ref_logps"] = np.where((ids >= 0)[..., None], reference[np.maximum(ids, 0)],
                                      0.0).astype(np.float32)
    return batch


@dataclasses.dataclass(frozen=True, eq=False)
class PairBatches(StepBatches):
    """Deterministic batches of packed pair rows (as ``instruct.PackedBatches``), with the
    stored ``reference`` log-probs [num_pairs, 2] of full fine-tuning DPO, or None."""

    data: PreferenceRows
    batch_size: int
    seed: int = 0
    process_index: int = 0
    process_count: int = 1
    reference: np.ndarray | None = None

    def __post_init__(self) -> None:
        self._check_split()
        step_rows = self.data.step_rows
        if step_rows and self.batch_size != step_rows:
            raise ValueError(f"pairs grouped by step take {step_rows} rows a step, not "
                             f"batch_size={self.batch_size}")

    def get(self, step: int) -> HostBatch:
        """This process's part of the batch for ``step``, each key [B / P, ...]; with pairs
        grouped by step, the rows of group ``row_indices(seed, step, 1, groups)``."""
        data, size = self.data, self.batch_size
        if data.step_rows:
            group = row_indices(self.seed, step, 1, data.rows.num_rows // size)[0]
            rows = group * size + np.arange(size)
        else:
            rows = row_indices(self.seed, step, size, data.rows.num_rows)
        return pair_batch(data, self._mine(rows), self.reference)


__all__ = ["PAIR_KEYS", "PairBatches", "PreferenceRows", "fit_pair", "group_pairs",
           "is_preference_file", "load_pairs", "load_preference_data", "pack_pairs", "pair_batch"]
