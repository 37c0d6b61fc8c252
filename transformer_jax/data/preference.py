"""Preference data: JSONL pairs -> token examples (chosen, rejected) -> packed rows -> batches.

A ``.jsonl`` file holds one pair per line, either

* text: ``{"prompt": "...", "chosen": "...", "rejected": "..."}``, each side encoded as SFT's
  prompt/completion records are (``[bos] + prompt + completion + [eos]``, the loss on the
  completion and its eos); or
* chat: ``{"prompt": [messages], "chosen": ..., "rejected": ...}`` where each answer is a
  string (one assistant turn), a message dict or a list of messages; ``prompt + answer`` is
  rendered with the tokenizer's chat template and cut into pieces exactly as SFT's
  ``messages`` records are (``instruct_records.chat_pieces``), the loss on the answer's
  assistant turns only (assistant turns inside the prompt carry none).

**Long pairs.** Both sides of a pair share one row of ``seq_len + 1`` tokens. A pair longer
than a row is cut with SFT's rule (``instruct.fit``: the prompt's start first, after the
template's head, then the answer's end), each side given a share of the row: the shorter
side keeps its length when it fits in half a row, the other gets the rest; else each gets
half. A pair that loses all loss tokens of either side is dropped; one log line counts them.

**Packing.** Pairs are placed into rows by best-fit-decreasing bin packing (``best_fit_rows``,
deterministic). Pair k of a row holds segments ``2k + 1`` (chosen) and ``2k + 2`` (rejected),
``positions`` restart at 0 for each, so attention masked by segment never crosses them.
``pair_ids`` [R, M] name the pairs of each row by their index in the files (-1 = none; M is the
most pairs any row holds), so a loss sums log-probs per (pair, side) and a stored reference
is looked up per pair.

**Batches** are a pure function of (seed, step) as SFT's (``instruct.row_indices``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence
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
    _chat_head,
    _check_messages,
    chat_pieces,
    count,
    encode_prompt_completion,
    read_jsonl,
)
from transformer_jax.tokenizer import ChatTemplate, ChatTemplateError, TextTokenizer

logger = logging.getLogger(__name__)

#: The keys of a preference record.
PAIR_KEYS = ("prompt", "chosen", "rejected")


@dataclasses.dataclass(frozen=True, eq=False)
class PreferenceRows:
    """Pairs packed into R rows of ``seq_len + 1`` tokens.

    Attributes:
      rows: the packed tokens, segment ids, positions and loss flags (``instruct.PackedData``;
        pair k of a row is segments 2k + 1 and 2k + 2).
      pair_ids: [R, M] int32, the index of each row's k-th pair among all pairs, -1 for none.
      num_pairs: how many pairs the files gave (pair ids run over ``range(num_pairs)``).
      step_rows: 0, or S when the rows are grouped by step (``group_pairs``): rows
        ``[g S, (g + 1) S)`` hold group g's pairs, and a batch is one group.
    """

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
        r = self.rows
        segment_ids = r.segment_ids[index]
        rows = PackedData(r.tokens[index], segment_ids, r.positions[index],
                          r.loss_tokens[index], num_examples=int(segment_ids.max(axis=1).sum()))
        return PreferenceRows(rows, self.pair_ids[index], self.num_pairs)


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


def encode_answer(prompt: Sequence[Mapping[str, Any]], answer: Sequence[Mapping[str, Any]],
                  tokenizer: TextTokenizer, template: ChatTemplate) -> Example:
    """Tokens and loss flags of ``prompt + answer`` rendered by the chat template, the loss on
    the answer's assistant turns only (``chat_pieces`` cuts the rendering as SFT does).

    Raises:
      ChatTemplateError: the template fails or does not render prefixes as prefixes.
    """
    messages = [*prompt, *answer]
    in_prompt = sum(m.get("role") == "assistant" for m in prompt)
    tokens: list[int] = []
    loss: list[bool] = []
    seen = 0
    for text, is_assistant in chat_pieces(template, messages):
        ids = tokenizer.encode(text)
        if is_assistant:
            seen += 1
        tokens.extend(ids)
        loss.extend([is_assistant and seen > in_prompt] * len(ids))
    out = np.asarray(tokens, dtype=np.int32)
    return Example(out, np.asarray(loss, dtype=bool), 0,
                   _chat_head(messages, tokenizer, template, out))


def load_pairs(path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
               tokenizer: TextTokenizer, *, add_eos: bool = True
               ) -> list[tuple[Example, Example]]:
    """Reads and tokenizes every pair of one or several JSONL files (in order).

    Returns:
      ``(chosen, rejected)`` examples per record, ``line`` set to the record's line.

    Raises:
      FileNotFoundError: a missing file.
      InstructionDataError: ``FILE:LINE: ...`` for a record without the three keys, of the
        wrong types, whose template fails, or a side with no loss token; also for no pairs,
        or for pairs whose sides are all equal (some equal ones: a warning names them).
    """
    paths = [path] if isinstance(path, str | os.PathLike) else list(path)
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
            prompt = record["prompt"]
            if isinstance(prompt, str):
                sides = []
                for side in ("chosen", "rejected"):
                    if not isinstance(record[side], str):
                        raise InstructionDataError(
                            f'{where}: with a text "prompt", "{side}" must be a string')
                    tokens, loss = encode_prompt_completion(prompt, record[side], tokenizer,
                                                            add_eos)
                    sides.append(Example(tokens, loss, line, int(
                        tokenizer.add_bos_token and tokenizer.bos_id >= 0)))
            elif isinstance(prompt, list):
                messages = _check_messages(prompt, where)
                if template is None:
                    try:
                        template = ChatTemplate.of(tokenizer)
                    except (ValueError, ChatTemplateError) as e:
                        raise InstructionDataError(f"{where}: chat record: {e}") from e
                sides = []
                for side in ("chosen", "rejected"):
                    answer = _check_messages(_answer(record[side], where, side), where)
                    try:
                        example = encode_answer(messages, answer, tokenizer, template)
                    except ChatTemplateError as e:
                        raise InstructionDataError(f"{where}: {e}") from e
                    sides.append(dataclasses.replace(example, line=line))
            else:
                raise InstructionDataError(f'{where}: "prompt" must be a string or a list of '
                                           f"messages, got {type(prompt).__name__}")
            for side, example in zip(("chosen", "rejected"), sides, strict=True):
                if not example.loss[1:].any():
                    raise InstructionDataError(f'{where}: "{side}" has no tokens to score '
                                               "(empty, or no assistant turn)")
            if np.array_equal(sides[0].tokens, sides[1].tokens):
                same.append(where)
            pairs.append((sides[0], sides[1]))
    if not pairs:
        where = paths[0] if len(paths) == 1 else f"{len(paths)} files ({paths[0]}, ...)"
        raise InstructionDataError(f"{where}: no preference records")
    _check_ties(same, len(pairs))
    return pairs


def _check_ties(same: list[str], num_pairs: int, limit: int = 3) -> None:
    """Warns of pairs whose two sides are the same tokens (``FILE:LINE`` of the first few):
    their preference loss is constant, so they teach nothing and dilute the batch; raises
    InstructionDataError when every pair is one."""
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
    """Both sides cut to share ``capacity`` tokens (see the module docstring).

    Returns:
      ``(pair or None when a side lost every loss token, whether anything was cut)``.
    """
    a, b = len(chosen.tokens), len(rejected.tokens)
    if a + b <= capacity:
        return (chosen, rejected), False
    half = capacity // 2
    if a <= half:
        budgets = (a, capacity - a)
    elif b <= half:
        budgets = (capacity - b, b)
    else:
        budgets = (capacity - half, half)
    out = [fit(e, n)[0] for e, n in zip((chosen, rejected), budgets, strict=True)]
    if out[0] is None or out[1] is None:
        return None, True
    return (out[0], out[1]), True


def pack_pairs(pairs: Sequence[tuple[Example, Example]], seq_len: int, pad_id: int = 0
               ) -> PreferenceRows:
    """Packs pairs into rows of ``seq_len + 1`` tokens, both sides of a pair in one row.

    Raises:
      ValueError: on a non-positive ``seq_len`` or when no pair fits.
    """
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    capacity = seq_len + 1
    kept: list[tuple[int, tuple[Example, Example]]] = []
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
    lengths = [len(c.tokens) + len(r.tokens) for _, (c, r) in kept]
    rows = best_fit_rows(lengths, capacity)
    m = max(len(members) for members in rows)
    shape = (len(rows), capacity)
    tokens = np.full(shape, pad_id, dtype=np.int32)
    segment_ids = np.zeros(shape, dtype=np.int32)
    positions = np.zeros(shape, dtype=np.int32)
    loss_tokens = np.zeros(shape, dtype=bool)
    pair_ids = np.full((len(rows), m), -1, dtype=np.int32)
    for r, members in enumerate(rows):
        start = 0
        for k, item in enumerate(members):
            index, pair = kept[item]
            pair_ids[r, k] = index
            for side, example in enumerate(pair):
                n = len(example.tokens)
                tokens[r, start:start + n] = example.tokens
                segment_ids[r, start:start + n] = 2 * k + 1 + side
                positions[r, start:start + n] = np.arange(n)
                loss_tokens[r, start:start + n] = example.loss
                start += n
    logger.info("packed %s into %s of %d tokens (%.1f%% padding, at most %d pairs a row)",
                count(len(kept), "pair"), count(len(rows), "row"), capacity,
                100.0 * (1.0 - sum(lengths) / (len(rows) * capacity)), m)
    packed = PackedData(tokens, segment_ids, positions, loss_tokens, 2 * len(kept), cut,
                        dropped)
    return PreferenceRows(packed, pair_ids, len(pairs))


def group_pairs(data: PreferenceRows, pairs_per_step: int, seed: int, multiple: int = 1
                ) -> PreferenceRows:
    """The pairs of ``data`` grouped by step, so that a step trains on exactly
    ``pairs_per_step`` pairs (TRL's batch) and the batches keep one shape.

    The pairs (in pair-id order) are permuted once by ``seed`` and cut into groups of N =
    ``pairs_per_step`` (the last holds the rest); each group is packed into rows of the same
    length (``best_fit_rows``; both sides of a pair in one row, as ``pack_pairs``) and padded
    with empty rows to S, the most rows a group takes rounded up to ``multiple`` (the
    devices x micro-batches the batch splits over). Each epoch visits every group once
    (``PairBatches``), so the groups, not the pairs, are reshuffled between epochs.

    Returns:
      Rows ``[g S, (g + 1) S)`` of group g, ``step_rows`` = S.

    Raises:
      ValueError: ``pairs_per_step`` or ``multiple`` below 1.
    """
    if pairs_per_step < 1 or multiple < 1:
        raise ValueError(f"pairs_per_step ({pairs_per_step}) and multiple ({multiple}) must "
                         "be >= 1")
    rows = data.rows
    capacity = rows.tokens.shape[1]
    m = data.pair_ids.shape[1]
    # Tokens of each (row, segment): a pair k spans segments 2k + 1 and 2k + 2, in order.
    sizes = np.stack([np.bincount(seg, minlength=2 * m + 1) for seg in rows.segment_ids])
    ends = np.cumsum(sizes[:, 1:], axis=1)  # [R, 2M]: where segment s + 1 ends
    row, k = np.nonzero(data.pair_ids >= 0)
    ids = data.pair_ids[row, k]
    in_order = np.argsort(ids, kind="stable")
    row, k, ids = row[in_order], k[in_order], ids[in_order]
    start = np.where(k > 0, ends[row, np.maximum(2 * k - 1, 0)], 0)
    length = ends[row, 2 * k + 1] - start
    order = np.random.default_rng([seed, 0x9A125]).permutation(len(ids))
    groups = [order[i:i + pairs_per_step] for i in range(0, len(order), pairs_per_step)]
    layouts = [best_fit_rows(length[g].tolist(), capacity) for g in groups]
    step_rows = -(-max(map(len, layouts)) // multiple) * multiple
    width = max(len(members) for layout in layouts for members in layout)
    shape = (len(groups) * step_rows, capacity)
    pad = rows.tokens[rows.segment_ids == 0]  # pack_pairs' pad_id, where any row has room
    tokens = np.full(shape, pad[0] if pad.size else 0, np.int32)
    segment_ids, positions = np.zeros(shape, np.int32), np.zeros(shape, np.int32)
    loss_tokens = np.zeros(shape, bool)
    pair_ids = np.full((shape[0], width), -1, np.int32)
    for g, (group, layout) in enumerate(zip(groups, layouts, strict=True)):
        for j, members in enumerate(layout):
            out, at = g * step_rows + j, 0
            for slot, item in enumerate(members):
                p = group[item]
                r, n, first = row[p], length[p], start[p]
                span = slice(first, first + n)
                tokens[out, at:at + n] = rows.tokens[r, span]
                positions[out, at:at + n] = rows.positions[r, span]
                loss_tokens[out, at:at + n] = rows.loss_tokens[r, span]
                # Segment 2k + 1 / 2k + 2 of the source row becomes 2 slot + 1 / 2 slot + 2.
                segment_ids[out, at:at + n] = rows.segment_ids[r, span] - 2 * (k[p] - slot)
                pair_ids[out, slot] = ids[p]
                at += n
    packed = PackedData(tokens, segment_ids, positions, loss_tokens, 2 * len(ids),
                        rows.num_truncated, rows.num_dropped)
    return PreferenceRows(packed, pair_ids, data.num_pairs, step_rows)


def load_preference_data(path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
                         tokenizer: TextTokenizer, seq_len: int) -> PreferenceRows:
    """Reads, tokenizes and packs JSONL preference files (see the module docstring)."""
    pairs = load_pairs(path, tokenizer)
    try:
        return pack_pairs(pairs, seq_len, tokenizer.pad_id)
    except ValueError as e:
        paths = [path] if isinstance(path, str | os.PathLike) else list(path)
        raise ValueError(f"{paths[0]}: {e}") from None


def pair_batch(data: PreferenceRows, rows: np.ndarray, reference: np.ndarray | None = None
               ) -> HostBatch:
    """The batch of packed rows ``rows`` [B]: SFT's keys (``instruct.rows_to_batch`` with
    ``mask``) plus ``sequence_mask`` [B, T] (1 on every target of the input's segment, prompt
    included: ORPO's NLL), ``pair_ids`` [B, M] and, given a stored ``reference`` [num_pairs, 2],
    ``ref_logps`` [B, M, 2] float32 (chosen, rejected; 0 where there is no pair)."""
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
    """Deterministic batches of packed pair rows (as ``instruct.PackedBatches``).

    Attributes:
      data: the packed pairs.
      batch_size: global B, divisible by ``process_count``.
      seed: data seed.
      process_index: this process's index p.
      process_count: number of processes P.
      reference: stored reference log-probs [num_pairs, 2] (full fine-tuning DPO), or None.
    """

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
        """This process's part of the batch for ``step``: each key [B / P, ...]; pairs grouped
        by step: the rows of group ``row_indices(seed, step, 1, groups)`` (each epoch visits
        every group once)."""
        data, size = self.data, self.batch_size
        if data.step_rows:
            group = row_indices(self.seed, step, 1, data.rows.num_rows // size)[0]
            rows = group * size + np.arange(size)
        else:
            rows = row_indices(self.seed, step, size, data.rows.num_rows)
        return pair_batch(data, self._mine(rows), self.reference)


__all__ = ["PAIR_KEYS", "PairBatches", "PreferenceRows", "encode_answer", "fit_pair",
           "group_pairs", "is_preference_file", "load_pairs", "load_preference_data", "pack_pairs",
           "pair_batch"]
