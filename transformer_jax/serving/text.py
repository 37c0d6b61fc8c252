"""A request's text as its tokens arrive: incremental detokenisation and stop strings.

``IncrementalDetokenizer`` turns one token at a time into text deltas whose concatenation is
the text the new tokens add to the prompt; a delta ending inside a multi-byte character (U+FFFD)
is held until the next token completes it. ``StopMatcher`` holds back the text that could start
a stop string; the stop string itself is not released (OpenAI's ``stop``). ``TextStream`` is
both, per request.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from transformer_jax.tokenizer import detokenize

#: Prompt tokens decoded before the first new token, so that its text is read in context.
CONTEXT_TOKENS = 5
_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    """Text deltas of a growing token sequence.

    Args:
      tokenizer: a ``TextTokenizer`` (ids past its vocabulary are shown as ``<id>``).
      prompt: the prompt ids; its last ``CONTEXT_TOKENS`` are the first delta's context.
      skip_ids: ids whose text is never released (the request's stop tokens: eos is not text).
    """

    def __init__(self, tokenizer: Any, prompt: Sequence[int] = (),
                 skip_ids: Iterable[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.skip_ids = frozenset(skip_ids)
        self.ids = [int(i) for i in prompt[-CONTEXT_TOKENS:]]
        # ids[prefix:read] were released already and give the next delta its context;
        # ids[read:] are held (their text was not whole yet).
        self.prefix = 0
        self.read = len(self.ids)

    def feed(self, token: int) -> str:
        """Adds one token; returns the text now whole (possibly empty)."""
        if int(token) in self.skip_ids:
            return ""
        self.ids.append(int(token))
        return self._release(final=False)

    def flush(self) -> str:
        """The held text, whole or not (the sequence ended)."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if len(self.ids) == self.read:
            return ""
        before = detokenize(self.tokenizer, self.ids[self.prefix:self.read])
        text = detokenize(self.tokenizer, self.ids[self.prefix:])
        if text.startswith(before):
            delta = text[len(before):]
        elif final:  # the context reads differently once extended: the new tokens alone
            delta = detokenize(self.tokenizer, self.ids[self.read:])
        else:
            return ""
        # Hold a token that adds no text yet, or text ending inside a multi-byte character.
        if not final and (not delta or delta.endswith(_INCOMPLETE)):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return delta


def held_prefix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (it may become it)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class StopMatcher:
    """Cuts a text stream at the first of its stop strings.

    Args:
      stops: the stop strings (non-empty).
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError(f"stop strings must be non-empty strings, got {list(stops)!r}")
        self.stops = tuple(stops)
        self.held = ""
        self.stopped = False

    def feed(self, text: str) -> tuple[str, bool]:
        """Adds text; returns (the text now safe to release, whether a stop string matched).
        After a match everything is dropped."""
        if self.stopped:
            return "", True
        text = self.held + text
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.held, self.stopped = "", True
            return text[:cut], True
        keep = max((held_prefix(text, stop) for stop in self.stops), default=0)
        self.held = text[len(text) - keep:]
        return text[:len(text) - keep], False

    def flush(self) -> str:
        """The held text (the stream ended without a match)."""
        held, self.held = self.held, ""
        return held


class TextStream:
    """One request's text: detokenised, then cut at its stop strings.

    Args:
      tokenizer: a ``TextTokenizer``.
      prompt: the prompt ids.
      stops: stop strings (may be empty).
      skip_ids: token ids that add no text (the stop tokens).
    """

    def __init__(self, tokenizer: Any, prompt: Sequence[int], stops: Sequence[str] = (),
                 skip_ids: Iterable[int] = ()) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt, skip_ids)
        self.matcher = StopMatcher(stops) if stops else None
        self.text: list[str] = []

    @property
    def stopped(self) -> bool:
        return self.matcher is not None and self.matcher.stopped

    def feed(self, token: int) -> tuple[str, bool]:
        """One new token -> (text delta, whether a stop string matched)."""
        return self._emit(self.detokenizer.feed(token))

    def finish(self) -> str:
        """The last delta of a request that ended (not at a stop string)."""
        delta, stopped = self._emit(self.detokenizer.flush())
        if not stopped and self.matcher is not None:
            tail = self.matcher.flush()
            self.text.append(tail)
            delta += tail
        return delta

    def _emit(self, text: str) -> tuple[str, bool]:
        stopped = False
        if self.matcher is not None:
            text, stopped = self.matcher.feed(text)
        self.text.append(text)
        return text, stopped

    @property
    def full_text(self) -> str:
        """Everything released so far."""
        return "".join(self.text)
