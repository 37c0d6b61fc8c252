"""From the engine's events of one request to OpenAI's response objects and stream chunks
(``Response``; ``Choices`` for the n choices of one request)."""

from __future__ import annotations

import itertools
import time
import uuid
from typing import Any

from transformer_jax.serve import reasoning, tools
from transformer_jax.serve.prepared import ModelInfo, Prepared
from transformer_jax.serving import TokenEvent
from transformer_jax.tokenizer import detokenize


class Response:
    """Builds one request's OpenAI objects from its engine events.

    Args:
      prepared: the request as the engine runs it.
      model: the served model.
    """

    def __init__(self, prepared: Prepared, model: ModelInfo, index: int = 0) -> None:
        self.chat = prepared.chat
        self.model = model
        self.index = index
        self.group: Choices | None = None
        self.logprobs = prepared.params.logprobs
        self.prompt_tokens = len(prepared.prompt)
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.completion_tokens = 0
        self.text: list[str] = []
        self.tokens: list[TokenEvent] = []  # the events with a token
        self.finish_reason: str | None = None
        self.tool_parser = prepared.tool_parser if self.chat else None
        self._calls = tools.make_parser(self.tool_parser) if self.tool_parser else None
        self._calls_sent = 0
        self.thinking = prepared.thinking if self.chat else None
        self._think = None if self.thinking is None else reasoning.ThinkSplitter(self.thinking)

    def add(self, events: list[TokenEvent]) -> tuple[str, list[TokenEvent]]:
        """Takes a step's events; returns their text and the events with a token."""
        tokens = [e for e in events if e.token is not None]
        text = "".join(e.text or "" for e in events)
        self.completion_tokens += len(tokens)
        self.text.append(text)
        self.tokens += tokens
        for e in events:
            self.finish_reason = e.finish_reason or self.finish_reason
        return text, tokens

    @property
    def usage(self) -> dict[str, int]:
        """The request's usage (of all its choices: the prompt counted once)."""
        done = sum(r.completion_tokens for r in (self.group.responses if self.group else [self]))
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": done,
                "total_tokens": self.prompt_tokens + done}

    def _head(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else \
            "text_completion"
        return {"id": self.id, "object": kind, "created": self.created,
                "model": self.model.name}

    def _piece(self, token: int) -> str:
        tok = self.model.tokenizer
        return detokenize(tok, [token]) if tok is not None else f"<{token}>"

    def _logprobs(self, tokens: list[TokenEvent]) -> dict[str, Any] | None:
        """The ``logprobs`` object of ``tokens`` (events with a token; their ``top_logprobs``:
        the (id, log-probability) alternatives, or None), in the endpoint's format."""
        if not self.logprobs:
            return None
        pieces = [self._piece(e.token) for e in tokens]
        logprobs = [e.logprob for e in tokens]
        alternatives = [[(self._piece(i), lp) for i, lp in e.top_logprobs or ()] for e in tokens]
        if self.chat:
            return {"content": [
                {"token": p, "logprob": lp, "bytes": list(p.encode()),
                 "top_logprobs": [{"token": a, "logprob": alp, "bytes": list(a.encode())}
                                  for a, alp in alt]}
                for p, lp, alt in zip(pieces, logprobs, alternatives, strict=True)]}
        offsets = [0, *itertools.accumulate(len(p) for p in pieces)][:len(pieces)]
        # A dict per token, as OpenAI's: two ids that decode alike keep the likelier one.
        top = [dict(reversed(alt)) for alt in alternatives]
        top = [dict(sorted(t.items(), key=lambda kv: -kv[1])) for t in top]
        return {"tokens": pieces, "token_logprobs": logprobs,
                "top_logprobs": top if any(e.top_logprobs for e in tokens) else None,
                "text_offset": offsets}

    def choice(self) -> dict[str, Any]:
        """This choice of the whole (non-streamed) response."""
        logprobs = self._logprobs(self.tokens)
        text = "".join(self.text)
        choice: dict[str, Any] = {"index": self.index, "logprobs": logprobs,
                                  "finish_reason": self.finish_reason}
        thought = None
        if self.thinking is not None:
            thought, text = reasoning.split(text, self.thinking)
        if self.chat and self.tool_parser:
            content, calls = tools.parse_reply(text, self.tool_parser)
            choice["message"] = {"role": "assistant", "content": content or None if calls
                                 else content}
            if calls:
                choice["message"]["tool_calls"] = [c.as_openai() for c in calls]
                choice["finish_reason"] = _with_calls(self.finish_reason)
        elif self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if self.thinking is not None:
            choice["message"]["reasoning_content"] = thought
        return choice

    def final(self) -> dict[str, Any]:
        """The whole (non-streamed) response of a one-choice request."""
        return {**self._head(False), "choices": [self.choice()], "usage": self.usage}

    def chunk(self, text: str, tokens: list[TokenEvent], finish_reason: str | None,
              first: bool = False, usage: bool = False) -> dict[str, Any]:
        """One stream chunk of ``text`` (the first one of a chat opens the assistant role),
        with the usage so far when ``usage``."""
        logprobs = self._logprobs(tokens)
        choice: dict[str, Any] = {"index": self.index, "logprobs": logprobs,
                                  "finish_reason": finish_reason}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text or first:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text
        return {**self._head(True), "choices": [choice],
                "usage": self.usage if usage else None}

    def chunks(self, text: str, tokens: list[TokenEvent], finish_reason: str | None,
               first: bool = False, usage: bool = False) -> list[dict[str, Any]]:
        """The stream chunks of one step's ``text`` (none when there is nothing to send): through
        the tool-call parser (``tools.stream_deltas``) and the reasoning parser (``<think>`` as
        ``reasoning_content`` deltas) if any; the logprobs on the first chunk, the finish reason
        (``"tool_calls"`` for ``"stop"`` once calls were sent) and the usage on the last.
        """
        thought: list[dict[str, Any]] = []
        if self._think is not None:
            cut = self._think.feed(text)
            if finish_reason is not None:
                cut += self._think.finish()
            thought = reasoning.deltas(cut)
            text = "".join(t for kind, t in cut if kind == reasoning.CONTENT)
        if self._calls is None and not thought:
            if not (text or first or finish_reason is not None):
                return []
            return [self.chunk(text, tokens, finish_reason, first, usage)]
        if self._calls is None:
            pieces: list[Any] = [text] if text else []
        else:
            pieces = self._calls.feed(text)
            if finish_reason is not None:
                pieces += self._calls.finish()
        deltas = thought + tools.stream_deltas(pieces, self._calls_sent)
        self._calls_sent += sum(isinstance(p, tools.ToolCall) for p in pieces)
        if first:
            deltas[:1] = [{"role": "assistant", **(deltas[0] if deltas else {})}]
        logprobs = self._logprobs(tokens)
        if not deltas and (finish_reason is not None or (logprobs and tokens)):
            deltas.append({})
        if finish_reason is not None and self._calls_sent:
            finish_reason = _with_calls(finish_reason)
        out = []
        for k, delta in enumerate(deltas):
            last = k == len(deltas) - 1
            choice = {"index": self.index, "logprobs": logprobs if k == 0 else None,
                      "finish_reason": finish_reason if last else None, "delta": delta}
            out.append({**self._head(True), "choices": [choice],
                        "usage": self.usage if usage and last else None})
        return out

    def usage_chunk(self) -> dict[str, Any]:
        """The last chunk of a stream with ``stream_options.include_usage``."""
        return {**self._head(True), "choices": [], "usage": self.usage}


def _with_calls(finish_reason: str | None) -> str | None:
    """A reply's finish reason once it made tool calls: ``"tool_calls"`` for ``"stop"``
    (a reply cut at the token limit, or otherwise ended, keeps its reason)."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


class Choices:
    """The n choices of one request, a ``Response`` each: one id, the prompt counted once in
    the usage, the choices indexed 0..n-1 (in the stream, each chunk names its choice).

    Args:
      prepared: the request as the engine runs it (``prepared.n`` choices).
      model: the served model.
    """

    def __init__(self, prepared: Prepared, model: ModelInfo) -> None:
        self.responses = [Response(prepared, model, i) for i in range(prepared.n)]
        first = self.responses[0]
        for r in self.responses:
            r.id, r.created, r.group = first.id, first.created, self

    def final(self) -> dict[str, Any]:
        """The whole (non-streamed) response."""
        first = self.responses[0]
        return {**first._head(False), "choices": [r.choice() for r in self.responses],
                "usage": first.usage}


__all__ = ["Choices", "Response"]
