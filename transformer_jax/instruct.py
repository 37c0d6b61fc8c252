"""Instruction data: JSONL records -> token examples with a loss mask -> packed rows -> batches.

A ``.jsonl`` file holds one record per line, either

* ``{"prompt": "...", "completion": "..."}``: tokens are ``[bos] + encode(prompt) +
  encode(completion) + [eos]`` (bos when the tokenizer's ``add_bos_token`` says so); the loss is on
  the completion and the eos; or
* ``{"messages": [{"role": "system"|"user"|"assistant"|..., "content": "..."}, ...]}``: the
  conversation is rendered with the tokenizer's own chat template (as transformers'
  ``apply_chat_template`` does; no bos is added beyond what the template writes) and the loss is
  on the assistant turns.

**Which chat tokens are assistant tokens.** For each assistant message ``i`` the template renders
the conversation before it with the generation prompt (``P_i``: everything up to where the model
starts writing) and the conversation through it without (``S_i``). The assistant text is
``S_i[len(P_i):]``: the reply plus whatever the template closes the turn with (e.g.
``<|im_end|>``, ``</s>``), so the model learns to end its turn. The rendered text is cut at these
boundaries into prompt and assistant pieces, and each piece is encoded on its own; this is how
the model sees the text at inference, where the prompt ``P_i`` is encoded and the reply is
generated after it. A template whose ``P_i`` or ``S_i`` is not a prefix of the next rendering
(e.g. one that rewrites earlier turns) cannot be masked this way and raises an error naming the
record.

**Packing.** Each example (at most ``seq_len + 1`` tokens; longer ones are truncated, with a
logged count) is placed into rows of ``seq_len + 1`` tokens by best-fit-decreasing bin packing
(deterministic). ``segment_ids`` number the examples in a row 1, 2, ... (0 = padding) and
``positions`` restart at 0 for each example, so attention masked by segment never crosses
examples. A batch row's inputs are the row's first ``seq_len`` tokens and its targets the last
``seq_len``.

**Batches** are a pure function of (seed, step): global row ``j`` of step ``s`` is packed row
``perm_e[(s * B + j) % R]`` of epoch ``e = (s * B + j) // R``, with ``perm_e`` a permutation of
the R rows drawn from ``np.random.default_rng([seed, e])``.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import logging
import operator
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from transformer_jax.data import check_non_negative
from transformer_jax.tokenizer import ChatTemplate, ChatTemplateError, TextTokenizer
from transformer_jax.tokenizer.prompt import encode_text

logger = logging.getLogger(__name__)

Batch = dict[str, np.ndarray]


class InstructionDataError(ValueError):
    """A bad instruction record; the message starts with ``FILE:LINE:``."""


@dataclasses.dataclass(frozen=True)
class Example:
    """One tokenized record.

    Attributes:
      tokens: Token ids, shape [L], int32.
      loss: Whether each token is a completion/assistant token to be predicted, shape [L], bool.
      line: The record's line number in its file (1-based).
    """

    tokens: np.ndarray
    loss: np.ndarray
    line: int


@dataclasses.dataclass(frozen=True, eq=False)
class PackedData:
    """Examples packed into R rows of ``seq_len + 1`` tokens.

    Attributes:
      tokens: Token ids, shape [R, T + 1], int32 (padding is ``pad_id``).
      segment_ids: Example number within the row, 1, 2, ...; 0 for padding; [R, T + 1] int32.
      positions: Position of each token within its example (0 for padding), [R, T + 1] int32.
      loss_tokens: Whether each token is a completion/assistant token, [R, T + 1] bool.
      num_examples: How many examples were packed.
      num_truncated: How many of them were cut to ``T + 1`` tokens.
    """

    tokens: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray
    loss_tokens: np.ndarray
    num_examples: int
    num_truncated: int = 0

    @property
    def seq_len(self) -> int:
        """T, the length of a batch row's inputs and targets."""
        return self.tokens.shape[1] - 1

    @property
    def num_rows(self) -> int:
        """R, the number of packed rows."""
        return self.tokens.shape[0]


# ------------------------------------------------------------------------------------ records


def read_jsonl(path: str | os.PathLike[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yields ``(line number, record)`` for each non-blank line of a JSONL file.

    Raises:
      FileNotFoundError: If the file does not exist.
      InstructionDataError: ``FILE:LINE: ...`` for a line that is not a JSON object or not UTF-8.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"instruction data file not found: {path}")
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise InstructionDataError(f"{path}:{number}: not valid UTF-8: {e}") from e
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise InstructionDataError(f"{path}:{number}: not valid JSON: {e}") from e
            if not isinstance(record, dict):
                raise InstructionDataError(
                    f"{path}:{number}: a record must be a JSON object, got {type(record).__name__}"
                )
            yield number, record


def encode_prompt_completion(
    prompt: str, completion: str, tokenizer: TextTokenizer, add_eos: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """Tokens [L] and loss flags [L] of a prompt/completion pair (loss on completion + eos)."""
    head = encode_text(tokenizer, prompt)  # bos as the tokenizer says, as generation does
    tail = tokenizer.encode(completion, add_eos=add_eos and tokenizer.eos_id >= 0)
    tokens = np.asarray(head + tail, dtype=np.int32)
    loss = np.zeros(len(tokens), dtype=bool)
    loss[len(head) :] = True
    return tokens, loss


def chat_pieces(
    template: ChatTemplate, messages: Sequence[Mapping[str, Any]]
) -> list[tuple[str, bool]]:
    """Cuts a rendered conversation into ``(text, is_assistant)`` pieces, in order.

    See the module docstring for the method. The pieces concatenate to the full rendering.

    Raises:
      ChatTemplateError: If the template fails, or its renderings of the conversation's
        prefixes are not prefixes of each other.
    """
    pieces: list[tuple[str, bool]] = []
    done = ""  # the rendering covered by pieces so far
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = template.render(messages[:i], add_generation_prompt=True) if i else ""
        through = template.render(messages[: i + 1])
        if not before.startswith(done) or not through.startswith(before):
            raise ChatTemplateError(
                f"the template does not render the conversation up to message {i} as a prefix of "
                "the conversation through it, so assistant tokens cannot be located"
            )
        pieces.append((before[len(done) :], False))
        pieces.append((through[len(before) :], True))
        done = through
    full = template.render(messages)
    if not full.startswith(done):
        raise ChatTemplateError(
            "the template does not render the conversation's prefixes as prefixes of the whole"
        )
    pieces.append((full[len(done) :], False))
    return [(text, is_assistant) for text, is_assistant in pieces if text]


def encode_chat(
    messages: Sequence[Mapping[str, Any]], tokenizer: TextTokenizer, template: ChatTemplate
) -> tuple[np.ndarray, np.ndarray]:
    """Tokens [L] and loss flags [L] of a conversation (loss on the assistant pieces)."""
    tokens: list[int] = []
    loss: list[bool] = []
    for text, is_assistant in chat_pieces(template, messages):
        ids = tokenizer.encode(text)
        tokens.extend(ids)
        loss.extend([is_assistant] * len(ids))
    return np.asarray(tokens, dtype=np.int32), np.asarray(loss, dtype=bool)


def load_examples(
    path: str | os.PathLike[str], tokenizer: TextTokenizer, *, add_eos: bool = True
) -> list[Example]:
    """Reads and tokenizes every record of a JSONL file.

    Args:
      path: The ``.jsonl`` file.
      tokenizer: Encodes the text; its chat template renders ``messages`` records.
      add_eos: End prompt/completion examples with eos (chat examples end as the template says).

    Returns:
      The examples in file order; records without any loss token are dropped (logged).

    Raises:
      FileNotFoundError: If the file does not exist.
      InstructionDataError: ``FILE:LINE: ...`` for bad JSON, a record without the fields, or a
        chat template that fails on the record; also for a file with no records.
    """
    template: ChatTemplate | None = None
    examples: list[Example] = []
    dropped = 0
    for line, record in read_jsonl(path):
        where = f"{path}:{line}"
        if "messages" in record:
            messages = _check_messages(record["messages"], where)
            if template is None:
                try:
                    template = ChatTemplate.of(tokenizer)
                except (ValueError, ChatTemplateError) as e:
                    raise InstructionDataError(f"{where}: chat record: {e}") from e
            try:
                tokens, loss = encode_chat(messages, tokenizer, template)
            except ChatTemplateError as e:
                raise InstructionDataError(f"{where}: {e}") from e
        elif "prompt" in record and "completion" in record:
            prompt, completion = record["prompt"], record["completion"]
            if not isinstance(prompt, str) or not isinstance(completion, str):
                raise InstructionDataError(f'{where}: "prompt" and "completion" must be strings')
            tokens, loss = encode_prompt_completion(prompt, completion, tokenizer, add_eos)
        else:
            raise InstructionDataError(
                f'{where}: a record needs "prompt" and "completion" strings or a "messages" '
                f"list; got keys {sorted(record)}"
            )
        if not loss[1:].any():  # the first token is never a target
            dropped += 1
            continue
        examples.append(Example(tokens, loss, line))
    if dropped:
        logger.warning("%s: %d records have no completion/assistant tokens; skipped", path, dropped)
    if not examples:
        raise InstructionDataError(f"{path}: no usable records")
    return examples


def _check_messages(messages: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise InstructionDataError(f'{where}: "messages" must be a non-empty list')
    for k, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InstructionDataError(f'{where}: message {k} needs a string "role"')
        if "content" not in message:
            raise InstructionDataError(f'{where}: message {k} has no "content"')
    return messages


# ------------------------------------------------------------------------------------ packing


def pack(examples: Sequence[Example], seq_len: int, pad_id: int = 0) -> PackedData:
    """Packs examples into rows of ``seq_len + 1`` tokens (best-fit decreasing).

    Args:
      examples: Tokenized examples.
      seq_len: T; rows hold T + 1 tokens (inputs are the first T, targets the last T).
      pad_id: Token id written into padding.

    Returns:
      The packed rows. Examples over T + 1 tokens are truncated, with a logged warning.

    Raises:
      ValueError: On a non-positive ``seq_len`` or no examples.
    """
    seq_len = operator.index(seq_len)
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    if not examples:
        raise ValueError("no examples to pack")
    capacity = seq_len + 1
    lengths = [min(len(e.tokens), capacity) for e in examples]
    truncated = sum(len(e.tokens) > capacity for e in examples)
    if truncated:
        logger.warning(
            "%d of %d examples are longer than seq_len + 1 = %d tokens and were truncated",
            truncated,
            len(examples),
            capacity,
        )
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row), sorted
    for i in sorted(range(len(examples)), key=lambda i: (-lengths[i], i)):
        k = bisect.bisect_left(free, (lengths[i], -1))
        if k < len(free):
            room, row = free.pop(k)
        else:
            room, row = capacity, len(rows)
            rows.append([])
        rows[row].append(i)
        if room - lengths[i] > 0:
            bisect.insort(free, (room - lengths[i], row))

    shape = (len(rows), capacity)
    tokens = np.full(shape, pad_id, dtype=np.int32)
    segment_ids = np.zeros(shape, dtype=np.int32)
    positions = np.zeros(shape, dtype=np.int32)
    loss_tokens = np.zeros(shape, dtype=bool)
    for r, members in enumerate(rows):
        start = 0
        for segment, i in enumerate(members, start=1):
            n = lengths[i]
            tokens[r, start : start + n] = examples[i].tokens[:n]
            loss_tokens[r, start : start + n] = examples[i].loss[:n]
            segment_ids[r, start : start + n] = segment
            positions[r, start : start + n] = np.arange(n)
            start += n
    logger.info(
        "packed %d examples into %d rows of %d tokens (%.1f%% padding)",
        len(examples),
        len(rows),
        capacity,
        100.0 * (1.0 - sum(lengths) / (len(rows) * capacity)),
    )
    return PackedData(tokens, segment_ids, positions, loss_tokens, len(examples), truncated)


def load_instruction_data(
    path: str | os.PathLike[str],
    tokenizer: TextTokenizer,
    seq_len: int,
    *,
    add_eos: bool = True,
) -> PackedData:
    """Reads, tokenizes and packs a JSONL instruction file (see the module docstring).

    Args:
      path: The ``.jsonl`` file of prompt/completion or messages records.
      tokenizer: The model's tokenizer (with its chat template for ``messages`` records).
      seq_len: T, the training sequence length.
      add_eos: End prompt/completion examples with eos.

    Returns:
      The packed data, ready for ``PackedBatches``.

    Raises:
      FileNotFoundError: If the file does not exist.
      InstructionDataError: ``FILE:LINE: ...`` for a bad record (see ``load_examples``).
    """
    examples = load_examples(path, tokenizer, add_eos=add_eos)
    return pack(examples, seq_len, tokenizer.pad_id)


# ------------------------------------------------------------------------------------ batches


def row_indices(seed: int, step: int, batch_size: int, num_rows: int) -> np.ndarray:
    """Packed-row indices of the global batch for (seed, step), shape [B], int64.

    Every epoch (R consecutive global rows) visits each packed row once, in the order of a
    permutation drawn from ``np.random.default_rng([seed, epoch])``.
    """
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


def rows_to_batch(data: PackedData, rows: np.ndarray) -> Batch:
    """The batch of the given packed rows.

    Args:
      data: Packed rows.
      rows: Row indices, shape [B].

    Returns:
      ``inputs``, ``targets`` (int32), ``segment_ids``, ``positions`` (int32; of the inputs) and
      ``loss_mask`` (float32: 1.0 where ``targets`` is a completion/assistant token of the same
      example as the input, else 0.0), each [B, T].
    """
    tokens = data.tokens[rows]
    segments = data.segment_ids[rows]
    same_example = (segments[:, 1:] == segments[:, :-1]) & (segments[:, :-1] > 0)
    loss_mask = data.loss_tokens[rows][:, 1:] & same_example
    return {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "segment_ids": segments[:, :-1],
        "positions": data.positions[rows][:, :-1],
        "loss_mask": loss_mask.astype(np.float32),
    }


@dataclasses.dataclass(frozen=True, eq=False)
class PackedBatches:
    """Deterministic batches of packed instruction rows; ``get(step)`` is pure in (seed, step).

    Process ``p`` of ``P`` gets rows ``[p * B / P, (p + 1) * B / P)`` of the global batch.

    Attributes:
      data: The packed rows.
      batch_size: Global batch size B, divisible by ``process_count``.
      seed: Data seed.
      process_index: This process's index p.
      process_count: Number of processes P.
    """

    data: PackedData
    batch_size: int
    seed: int = 0
    process_index: int = 0
    process_count: int = 1

    def __post_init__(self) -> None:
        check_non_negative("seed", self.seed)
        if self.batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {self.batch_size}")
        if self.process_count <= 0 or not 0 <= self.process_index < self.process_count:
            raise ValueError(
                f"process_index={self.process_index} is outside [0, {self.process_count})"
            )
        if self.batch_size % self.process_count:
            raise ValueError(
                f"batch_size={self.batch_size} is not divisible by "
                f"process_count={self.process_count}"
            )

    def get(self, step: int) -> Batch:
        """This process's part of the batch for ``step``: each key [B / P, T] (see
        ``rows_to_batch``)."""
        rows = row_indices(self.seed, step, self.batch_size, self.data.num_rows)
        local = self.batch_size // self.process_count
        mine = rows[self.process_index * local : (self.process_index + 1) * local]
        return rows_to_batch(self.data, mine)

    def iterate(self, start_step: int = 0) -> Iterator[Batch]:
        """Yields ``get(step)`` for ``step = start_step, start_step + 1, ...`` without end."""
        step = check_non_negative("start_step", start_step)
        while True:
            yield self.get(step)
            step += 1



__all__ = [
    "Batch",
    "Example",
    "InstructionDataError",
    "PackedBatches",
    "PackedData",
    "chat_pieces",
    "encode_chat",
    "encode_prompt_completion",
    "load_examples",
    "load_instruction_data",
    "pack",
    "read_jsonl",
    "row_indices",
    "rows_to_batch",
]
