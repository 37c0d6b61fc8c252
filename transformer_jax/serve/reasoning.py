"""Reasoning in a chat reply: the text a thinking model writes between ``<think>`` and
``</think>`` (Qwen3, DeepSeek-R1) goes to the message's ``reasoning_content``, the rest to its
``content`` (``serve --reasoning-parser qwen3`` or ``deepseek_r1``).

With no ``</think>``, a reply that opened with ``<think>``, or whose prompt did, is all
reasoning; any other reply is all content.
"""

from __future__ import annotations

from typing import Any

from transformer_jax.serving.text import held_prefix

START, END = "<think>", "</think>"
#: ``--reasoning-parser`` names (vLLM's) and the tags they read.
PARSERS = {"qwen3": (START, END), "deepseek_r1": (START, END)}

REASONING, CONTENT = "reasoning", "content"


def check_parser(name: str | None) -> None:
    """Raises ValueError naming the choices for an unknown ``--reasoning-parser``."""
    if name is not None and name not in PARSERS:
        raise ValueError(f"--reasoning-parser must be one of {sorted(PARSERS)}, got {name!r}")


def prompt_opens_thinking(prompt_text: str) -> bool:
    """Whether a rendered prompt ends inside a thinking block it opened."""
    return prompt_text.rstrip().endswith(START)


class ThinkSplitter:
    """Cuts a reply, fed as it streams, into reasoning and content pieces.

    Args:
      opened: the prompt opened the thinking block (``prompt_opens_thinking``).
    """

    def __init__(self, opened: bool = False) -> None:
        self.state = REASONING if opened else "start"
        self._buffer = ""
        self._after_end = False  # right after </think>: newlines still to drop

    def feed(self, text: str) -> list[tuple[str, str]]:
        """The pieces ``(REASONING | CONTENT, text)`` that ``text`` completes (text that may
        still become a tag is held)."""
        self._buffer += text
        out: list[tuple[str, str]] = []
        while True:
            if self.state == "start":
                head = self._buffer.lstrip()
                if head.startswith(START):
                    self._buffer, self.state = head[len(START):], REASONING
                elif head and not START.startswith(head):
                    self.state = CONTENT
                else:
                    return out  # only whitespace or a start of <think> so far
            elif self.state == REASONING:
                at = self._buffer.find(END)
                if at < 0:
                    cut = len(self._buffer) - held_prefix(self._buffer, END)
                    _add(out, REASONING, self._buffer[:cut])
                    self._buffer = self._buffer[cut:]
                    return out
                _add(out, REASONING, self._buffer[:at])
                self._buffer = self._buffer[at + len(END):]
                self.state, self._after_end = CONTENT, True
            else:
                if self._after_end:
                    self._buffer = self._buffer.lstrip("\n")
                    if not self._buffer:
                        return out
                    self._after_end = False
                _add(out, CONTENT, self._buffer)
                self._buffer = ""
                return out

    def finish(self) -> list[tuple[str, str]]:
        """The held text once the reply has ended."""
        text, self._buffer = self._buffer, ""  # (none right after </think>: feed drops it)
        # In state "start": whitespace or a cut <think>, content as written.
        kind = REASONING if self.state == REASONING else CONTENT
        return [(kind, text)] if text else []


def _add(out: list[tuple[str, str]], kind: str, text: str) -> None:
    if text:
        out.append((kind, text))


def split(text: str, opened: bool = False) -> tuple[str | None, str]:
    """A whole reply's ``(reasoning or None, content)``."""
    splitter = ThinkSplitter(opened)
    pieces = splitter.feed(text) + splitter.finish()
    reasoning = "".join(t for kind, t in pieces if kind == REASONING)
    content = "".join(t for kind, t in pieces if kind == CONTENT)
    thought = opened or text.lstrip().startswith(START)
    return (reasoning if thought else None), content


def deltas(pieces: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """Stream deltas of reasoning pieces: ``{"reasoning_content": text}`` each."""
    return [{"reasoning_content": t} for kind, t in pieces if kind == REASONING]


__all__ = ["END", "PARSERS", "START", "ThinkSplitter", "check_parser", "deltas",
           "prompt_opens_thinking", "split"]
