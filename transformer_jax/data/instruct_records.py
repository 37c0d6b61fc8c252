"""Instruction records: JSONL lines -> checked records -> token examples with a loss mask:
``{"prompt", "completion"}`` (the loss on the completion and eos) or ``{"messages": [...]}``
(rendered with the chat template, the loss on the assistant turns).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from transformer_jax.tokenizer import ChatTemplate, ChatTemplateError, TextTokenizer
from transformer_jax.tokenizer.prompt import encode_text

logger = logging.getLogger("transformer_jax.instruct")


class InstructionDataError(ValueError):
    """A bad instruction record; the message starts with ``FILE:LINE:``."""


@dataclasses.dataclass(frozen=True)
class Example:
    """One tokenized record: ``tokens`` [L] int32, ``loss`` [L] bool (whether each token is a
    completion/assistant token to predict), its 1-based ``line`` and ``head`` (``fit``)."""

    tokens: np.ndarray
    loss: np.ndarray
    line: int
    head: int = 0


def as_paths(path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list:
    """One path or several as a list."""
    return [path] if isinstance(path, str | os.PathLike) else list(path)


def describe_paths(paths: Sequence[str | os.PathLike[str]]) -> str:
    """``FILE`` for one file, ``"N files (FILE, ...)"`` for several (the start of an error)."""
    return str(paths[0]) if len(paths) == 1 else f"{len(paths)} files ({paths[0]}, ...)"


def read_jsonl(path: str | os.PathLike[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yields ``(line number, record)`` for each non-blank line of a JSONL file;
    InstructionDataError (``FILE:LINE: ...``) for a line that is not a UTF-8 JSON object."""
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
                raise InstructionDataError(f"{path}:{number}: a record must be a JSON object, "
                                           f"got {type(record).__name__}")
            _check_unicode(record, f"{path}:{number}")
            yield number, record


def _check_unicode(value: Any, where: str) -> None:
    """Raises for a string holding a lone surrogate (JSON allows ``"\\ud800"``; it is no text)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            bad = value[e.start : e.end].encode("unicode_escape").decode()
            raise InstructionDataError(
                f"{where}: a string holds a lone surrogate ({bad}), which is not valid Unicode "
                "text; write the character itself or its surrogate pair") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(key, where)
            _check_unicode(item, where)
    elif isinstance(value, list):
        for item in value:
            _check_unicode(item, where)


def encode_prompt_completion(prompt: str, completion: str, tokenizer: TextTokenizer,
                             add_eos: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Tokens [L] and loss flags [L] of a prompt/completion pair (loss on completion + eos)."""
    head = encode_text(tokenizer, prompt)  # bos as the tokenizer says, as generation does
    tail = tokenizer.encode(completion, add_eos=add_eos and tokenizer.eos_id >= 0)
    tokens = np.asarray(head + tail, dtype=np.int32)
    loss = np.zeros(len(tokens), dtype=bool)
    loss[len(head) :] = True
    return tokens, loss


def prompt_completion_example(prompt: str, completion: str, tokenizer: TextTokenizer,
                              add_eos: bool, line: int) -> Example:
    """``encode_prompt_completion`` as an ``Example`` whose head is the bos, if any."""
    tokens, loss = encode_prompt_completion(prompt, completion, tokenizer, add_eos)
    return Example(tokens, loss, line, int(tokenizer.add_bos_token and tokenizer.bos_id >= 0))


def chat_pieces(template: ChatTemplate, messages: Sequence[Mapping[str, Any]]
                ) -> list[tuple[str, bool]]:
    """Cuts a rendered conversation into ``(text, is_assistant)`` pieces that concatenate to
    it: assistant message ``i`` is its rendering beyond the one before it with the generation
    prompt. ChatTemplateError if the template fails or its prefixes do not nest."""
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
                "the conversation through it, so assistant tokens cannot be located")
        pieces.append((before[len(done) :], False))
        pieces.append((through[len(before) :], True))
        done = through
    full = template.render(messages)
    if not full.startswith(done):
        raise ChatTemplateError(
            "the template does not render the conversation's prefixes as prefixes of the whole")
    pieces.append((full[len(done) :], False))
    return [(text, is_assistant) for text, is_assistant in pieces if text]


def encode_chat(messages: Sequence[Mapping[str, Any]], tokenizer: TextTokenizer,
                template: ChatTemplate, scored_from: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Tokens [L] and loss flags [L] of a conversation: the loss on the assistant pieces after
    the first ``scored_from`` (a preference pair's prompt turns carry none)."""
    tokens: list[int] = []
    loss: list[bool] = []
    seen = 0
    for text, is_assistant in chat_pieces(template, messages):
        ids = tokenizer.encode(text)
        seen += is_assistant
        tokens.extend(ids)
        loss.extend([is_assistant and seen > scored_from] * len(ids))
    return np.asarray(tokens, dtype=np.int32), np.asarray(loss, dtype=bool)


def chat_example(messages: Sequence[Mapping[str, Any]], tokenizer: TextTokenizer,
                 template: ChatTemplate | None, where: str, line: int, scored_from: int = 0
                 ) -> tuple[Example, ChatTemplate]:
    """The ``encode_chat`` example of checked ``messages`` and the template used (``template``,
    else the tokenizer's); InstructionDataError (``where: ...``) if there is none or it fails."""
    try:
        if template is None:
            template = ChatTemplate.of(tokenizer)
    except (ValueError, ChatTemplateError) as e:
        raise InstructionDataError(f"{where}: chat record: {e}") from e
    try:
        tokens, loss = encode_chat(messages, tokenizer, template, scored_from)
        head = _chat_head(messages, tokenizer, template, tokens)
    except ChatTemplateError as e:
        raise InstructionDataError(f"{where}: {e}") from e
    return Example(tokens, loss, line, head), template


def load_examples(path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
                  tokenizer: TextTokenizer, *, add_eos: bool = True) -> list[Example]:
    """Reads and tokenizes every record of one or several JSONL files (in order); ``add_eos``
    ends prompt/completion examples with eos; records without a loss token are dropped (logged).

    Raises:
      FileNotFoundError: If a file does not exist.
      InstructionDataError: ``FILE:LINE: ...`` for a bad record or a failing chat template;
        also for files with no records.
    """
    paths = as_paths(path)
    template: ChatTemplate | None = None
    examples: list[Example] = []
    dropped = 0
    for file in paths:
        for line, record in read_jsonl(file):
            where = f"{file}:{line}"
            if "messages" in record:
                messages = _check_messages(record["messages"], where)
                example, template = chat_example(messages, tokenizer, template, where, line)
            elif "prompt" in record and "completion" in record:
                prompt, completion = record["prompt"], record["completion"]
                if not isinstance(prompt, str) or not isinstance(completion, str):
                    raise InstructionDataError(
                        f'{where}: "prompt" and "completion" must be strings')
                example = prompt_completion_example(prompt, completion, tokenizer, add_eos, line)
            else:
                hint = ("; preference pairs train with train.objective=dpo or orpo"
                        if "chosen" in record and "rejected" in record else "")
                raise InstructionDataError(
                    f'{where}: a record needs "prompt" and "completion" strings or a "messages" '
                    f"list; got keys {sorted(record)}{hint}")
            if not example.loss[1:].any():  # the first token is never a target
                dropped += 1
                continue
            examples.append(example)
    where = describe_paths(paths)
    if dropped:
        logger.warning("%s: %s no completion/assistant tokens; skipped", where,
                       count(dropped, "record has", "records have"))
    if not examples:
        raise InstructionDataError(f"{where}: no usable records")
    return examples


def count(n: int, one: str, many: str | None = None) -> str:
    """``"1 record"``, ``"3 records"``: ``n`` and the noun (plural ``many``, else ``one + "s"``)."""
    return f"{n} {one if n == 1 else (many or one + 's')}"


def _chat_head(messages: Sequence[Mapping[str, Any]], tokenizer: TextTokenizer,
               template: ChatTemplate, tokens: np.ndarray) -> int:
    """How many leading tokens of a chat example the template writes before the first
    message's content: the common prefix of ``tokens`` and that text's encoding."""
    content = messages[0]["content"]
    rendered = template.render(messages)
    at = rendered.find(content) if content else -1
    if at <= 0:
        return 0
    pairs = list(zip(tokenizer.encode(rendered[:at]), tokens.tolist(), strict=False))
    return next((k for k, (a, b) in enumerate(pairs) if a != b), len(pairs))


def _check_messages(messages: Any, where: str) -> list[dict[str, Any]]:
    """The messages of a chat record with each ``content`` as one string: a string, or the
    concatenated text parts ``{"type": "text", "text": "..."}``; anything else is an error."""
    if not isinstance(messages, list) or not messages:
        raise InstructionDataError(f'{where}: "messages" must be a non-empty list')
    out = []
    for k, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InstructionDataError(f'{where}: message {k} needs a string "role"')
        if "content" not in message:
            raise InstructionDataError(f'{where}: message {k} has no "content"')
        content = message["content"]
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text"
                        and isinstance(part.get("text"), str)):
                    raise InstructionDataError(
                        f'{where}: message {k} content part {j} must be {{"type": "text", '
                        f'"text": "..."}}, got {json.dumps(part)[:80]}')
            content = "".join(part["text"] for part in content)
        elif not isinstance(content, str):
            raise InstructionDataError(
                f'{where}: message {k} "content" must be a string or a list of text parts, '
                f"got {json.dumps(content)[:80]}")
        out.append({**message, "content": content})
    return out


__all__ = ["Example", "InstructionDataError", "as_paths", "chat_example", "chat_pieces", "count",
           "describe_paths", "encode_chat", "encode_prompt_completion", "load_examples",
           "prompt_completion_example", "read_jsonl"]
