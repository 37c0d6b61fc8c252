"""Tool calls: the reply's calls parsed from the text the model writes, and the grammar that
makes it write one when ``tool_choice`` asks for it.

The parser follows the chat template's format, ``"hermes"`` or ``"llama3_json"``, and reads the
text as it streams (the pieces joined equal ``parse_reply`` of the whole text). ``tool_choice``
``"required"`` or a named function is enforced by an llguidance grammar (``tool_grammar``), in
``JSON_CALLS`` where the template shows no format.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from typing import Any

from transformer_jax.serve.protocol import APIError, ChatCompletionRequest
from transformer_jax.serving.grammar import Grammar, token_ref
from transformer_jax.serving.text import held_prefix

PARSERS = ("hermes", "llama3_json")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
#: The format of enforced calls where the template shows none (module docstring).
JSON_CALLS = "json"
#: The schema of a function given without ``parameters``: no arguments (OpenAI's meaning).
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def new_call_id() -> str:
    """A fresh tool-call id, ``call_`` and 24 random hex digits (OpenAI's shape)."""
    return "call_" + secrets.token_hex(12)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One parsed call: the function's name and its arguments as JSON text (an object)."""

    name: str
    arguments: str
    id: str = dataclasses.field(default_factory=new_call_id, compare=False)

    def as_openai(self) -> dict[str, Any]:
        """The call as a reply's ``message.tool_calls`` entry."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


Piece = str | ToolCall


def parser_for_template(template: str | None) -> str | None:
    """The parser (one of ``PARSERS``) of the tool calls a chat template's model writes, from
    the template's text; None when it shows neither format."""
    if not template:
        return None
    if HERMES_OPEN in template:
        return "hermes"
    if PYTHON_TAG in template or '"parameters"' in template:
        return "llama3_json"
    return None


def call_of(obj: Any) -> ToolCall | None:
    """The call a decoded JSON value is, or None: an object with a non-empty string ``name``
    and an object ``arguments`` (or ``parameters``; also as JSON text)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters"))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class ToolCallParser:
    """Splits a reply's text, fed as it streams, into content text and ``ToolCall``s.

    ``feed`` returns what is known so far; ``finish`` (at the end of the reply) the rest.
    """

    def feed(self, text: str) -> list[Piece]:
        """The pieces ``text`` (the next part of the reply) completes."""
        raise NotImplementedError

    def finish(self) -> list[Piece]:
        """The pieces still held back, at the end of the reply."""
        raise NotImplementedError


class HermesParser(ToolCallParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks among text."""

    def __init__(self) -> None:
        self._buf = ""
        self._in_call = False
        self._after_call = False  # whitespace right after a call is not content
        self._ws = ""  # the whitespace before the open block (content if it is no call)

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        out: list[Piece] = []
        while True:
            if self._in_call:
                end = self._buf.find(HERMES_CLOSE)
                if end < 0:
                    return out
                body, self._buf = self._buf[:end], self._buf[end + len(HERMES_CLOSE):]
                out += self._block(body, HERMES_CLOSE)
                continue
            if self._after_call:
                self._buf = self._buf.lstrip()
                if not self._buf:
                    return out
                self._after_call = False
            start = self._buf.find(HERMES_OPEN)
            if start >= 0:
                before = self._buf[:start]
                text_part = before.rstrip()
                self._ws = before[len(text_part):]
                if text_part:
                    out.append(text_part)
                self._buf, self._in_call = self._buf[start + len(HERMES_OPEN):], True
                continue
            held = len(self._buf) - held_prefix(self._buf, HERMES_OPEN)
            sure = self._buf[:held].rstrip()  # trailing whitespace may precede a call
            if sure:
                out.append(sure)
            self._buf = self._buf[len(sure):]
            return out

    def _block(self, body: str, close: str) -> list[Piece]:
        """A block's pieces: its call, or its text as written."""
        self._in_call = False
        try:
            call = call_of(json.loads(body))
        except json.JSONDecodeError:
            call = None
        ws, self._ws = self._ws, ""
        if call is None:
            return [ws + HERMES_OPEN + body + close]
        self._after_call = True
        return [call]

    def finish(self) -> list[Piece]:
        out = self.feed("")
        if self._in_call:  # never closed: a call if its JSON is whole
            out += self._block(self._buf, "")
        elif self._buf:
            out.append(self._buf)
        self._buf, self._after_call = "", False
        return out


class Llama3JsonParser(ToolCallParser):
    """A reply of JSON calls ``{"name": ..., "parameters": {...}}`` separated by ``;``
    (optionally after ``<|python_tag|>``), or else text."""

    def __init__(self) -> None:
        self._buf = ""
        self._state = "start"  # "start" (undecided), "calls", or "text"
        self._calls = 0
        self._decoder = json.JSONDecoder()

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        if self._state == "start":
            head = self._buf.lstrip()
            if not head or (PYTHON_TAG.startswith(head) and head != PYTHON_TAG):
                return []  # whitespace, or what may become the tag
            self._state = "calls" if head.startswith((PYTHON_TAG, "{")) else "text"
        if self._state == "text":
            out, self._buf = self._buf, ""
            return [out] if out else []
        return self._calls_in(final=False)

    def _calls_in(self, final: bool) -> list[Piece]:
        """The calls whole in the buffer; once something is not one, the rest is text."""
        out: list[Piece] = []
        while True:
            rest = self._buf.lstrip()
            if self._calls == 0 and rest.startswith(PYTHON_TAG):
                rest = rest[len(PYTHON_TAG):].lstrip()
            if self._calls and rest.startswith(";"):
                rest = rest[1:].lstrip()
            if not rest:
                return out
            call, end = None, 0
            if rest.startswith("{"):
                try:
                    obj, end = self._decoder.raw_decode(rest)
                    call = call_of(obj)
                except json.JSONDecodeError:
                    if not final:
                        return out  # maybe not whole yet
            if call is None:  # not a call: all that follows is text
                text = self._buf if self._calls == 0 else rest
                self._buf, self._state = "", "text"
                return [*out, text]
            out.append(call)
            self._calls += 1
            self._buf = rest[end:]

    def finish(self) -> list[Piece]:
        if self._state == "calls":
            out = self._calls_in(final=True)
        else:
            out = [self._buf] if self._buf else []
        self._buf, self._state, self._calls = "", "start", 0
        return out


class JsonCallsParser(ToolCallParser):
    """An enforced call's reply where the template shows no format (``JSON_CALLS``): a JSON
    list of calls, or with ``name`` that function's arguments; parsed once whole (``finish``)."""

    def __init__(self, name: str | None = None) -> None:
        self._name = name
        self._buf = ""

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        return []

    def finish(self) -> list[Piece]:
        text, self._buf = self._buf, ""
        if self._name is None:
            return _listed_calls(text)
        call = call_of({"name": self._name, "arguments": text})
        return [call] if call is not None else [text] if text else []


def _listed_calls(text: str) -> list[Piece]:
    """The calls of a JSON list of them, in order, then whatever follows the last whole one
    (a list cut short, or text that is no list) as text."""
    decoder = json.JSONDecoder()
    calls: list[Piece] = []
    rest = text.lstrip()
    if not rest.startswith("["):
        return [text] if text else []
    rest = rest[1:]
    while True:
        item = rest.lstrip()
        try:
            obj, end = decoder.raw_decode(item)
        except json.JSONDecodeError:
            break
        call = call_of(obj)
        if call is None:
            break
        calls.append(call)
        rest = item[end:].lstrip()
        if rest.startswith("]") and not rest[1:].strip():
            return calls
        if not rest.startswith(","):
            break
        rest = rest[1:]
    tail = rest.strip() if calls else text
    return [*calls, tail] if tail else calls


def make_parser(kind: str) -> ToolCallParser:
    """A fresh streaming parser of ``kind`` (``reply_parser``'s)."""
    if kind in PARSERS:
        return HermesParser() if kind == "hermes" else Llama3JsonParser()
    if kind == JSON_CALLS or kind.startswith(JSON_CALLS + ":"):
        return JsonCallsParser(kind.partition(":")[2] or None)
    raise ValueError(f"tool-call parser must be one of {PARSERS}, got {kind!r}")


def parse_reply(text: str, kind: str) -> tuple[str, list[ToolCall]]:
    """A whole reply's content (the text outside the calls) and its calls."""
    parser = make_parser(kind)
    pieces = parser.feed(text) + parser.finish()
    return ("".join(p for p in pieces if isinstance(p, str)),
            [p for p in pieces if isinstance(p, ToolCall)])


def stream_deltas(pieces: list[Piece], first_index: int) -> list[dict[str, Any]]:
    """The chat stream's deltas of parsed pieces, as OpenAI streams them: a run of text one
    ``content`` delta; each call a delta with its ``index`` (from ``first_index``), ``id``,
    ``type`` and name (``arguments`` ""), then one with its arguments."""
    deltas: list[dict[str, Any]] = []
    index = first_index
    for piece in pieces:
        if isinstance(piece, str):
            if deltas and set(deltas[-1]) == {"content"}:
                deltas[-1]["content"] += piece
            else:
                deltas.append({"content": piece})
            continue
        deltas.append({"tool_calls": [{"index": index, "id": piece.id, "type": "function",
                                       "function": {"name": piece.name, "arguments": ""}}]})
        deltas.append({"tool_calls": [{"index": index,
                                       "function": {"arguments": piece.arguments}}]})
        index += 1
    return deltas


def template_tools(req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The request's ``tools`` as the chat template's ``tools`` (OpenAI's format), or None."""
    if not req.tools:
        return None
    return [tool.model_dump(exclude_none=True) for tool in req.tools]


def reply_parser(req: ChatCompletionRequest, template: str | None,
                 choice: str | None = None) -> str | None:
    """The parser of the request's reply (None: no tools, or ``tool_choice`` ``"none"``),
    after checking that every tool's ``parameters`` compile.

    Args:
      req: the validated request.
      template: the checkpoint's chat template (its text picks the parser).
      choice: the server's parser (one of ``PARSERS``), over the template's; None: pick.

    Returns:
      One of ``PARSERS``, else ``JSON_CALLS`` (``"required"``) or ``JSON_CALLS:NAME``.

    Raises:
      APIError: 400 naming ``tools.i.function.parameters`` for a schema that does not compile,
        or ``tools`` for ``"auto"`` when the template writes no format this server parses.
    """
    if not req.tools:
        return None
    for i, tool in enumerate(req.tools):
        where = f"tools.{i}.function.parameters"
        try:
            Grammar("json_schema", arguments_schema(tool.function.parameters)).check()
        except (ValueError, TypeError) as e:
            raise APIError(400, f"{where}: the schema of function {tool.function.name!r} "
                           f"does not compile: {e}", where) from None
    if req.tool_mode == "none":
        return None
    kind = choice or parser_for_template(template)
    mode = req.tool_mode
    if kind is None and mode == "required":
        return JSON_CALLS
    if kind is None and not isinstance(mode, str):  # a named function
        return f"{JSON_CALLS}:{mode.function.name}"
    if kind is None:
        raise APIError(400, "tools: this model's chat template writes no tool-call format "
                       f"this server parses ({', '.join(PARSERS)}), which tool_choice 'auto' "
                       "needs; send tool_choice 'required' or a named function (enforced "
                       "calls), or 'none' to render the tools without parsing the reply",
                       "tools")
    return kind


def arguments_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """A tool's ``parameters`` as the schema its arguments are generated by: no arguments
    when absent; compact JSON (llguidance's ``whitespace_flexible`` off unless it says)."""
    schema = dict(NO_PARAMETERS if parameters is None else parameters)
    schema["x-guidance"] = {"whitespace_flexible": False, **schema.get("x-guidance", {})}
    return schema


def tool_grammar(req: ChatCompletionRequest, kind: str,
                 added: dict[str, int] | None = None) -> Grammar | None:
    """The grammar enforcing ``tool_choice`` ``"required"`` (calls; one without
    ``parallel_tool_calls``) or a named function in ``kind``'s format; None for the others.

    Args:
      req: the validated request.
      kind: the reply's format.
      added: {text: id} of the tokenizer's added tokens (``grammar.added_token_ids``): a
        wrapper tag among them may also be that one token.

    Raises:
      APIError: 400 naming ``tool_choice`` if the grammar does not compile.
    """
    mode = req.tool_mode
    if mode in ("auto", "none"):
        return None
    tools = [t.function for t in req.tools or ()]
    if kind.startswith(JSON_CALLS + ":"):  # the reply is the named function's arguments
        (named,) = [f for f in tools if f.name == mode.function.name]
        return _checked(Grammar("json_schema", arguments_schema(named.parameters)))
    named = None if isinstance(mode, str) else mode.function.name  # None: "required"
    rules = [_call_rule(kind, f.name, f.parameters, added or {}) for f in tools
             if named in (None, f.name)]
    many = named is None and req.parallel_tool_calls
    separator = json.dumps({"hermes": "\n", JSON_CALLS: ", "}.get(kind, "; "))
    calls = f"call ({separator} call)*" if many else "call"
    lines = ["%llguidance {}",
             f'start: "[" {calls} "]"' if kind == JSON_CALLS else f"start: {calls}",
             "call: " + " | ".join(f"f_{i}" for i in range(len(rules)))]
    lines += [f"f_{i}: {rule}" for i, rule in enumerate(rules)]
    return _checked(Grammar("lark", "\n".join(lines) + "\n"))


def _checked(grammar: Grammar) -> Grammar:
    """``grammar``, or APIError (400 naming ``tool_choice``) if it does not compile."""
    try:
        grammar.check()
    except ValueError as e:
        raise APIError(400, f"tool_choice: the tools' grammar does not compile: {e}",
                       "tool_choice") from None
    return grammar


def _call_rule(kind: str, name: str, parameters: dict[str, Any] | None,
               added: dict[str, int]) -> str:
    """The Lark rule of one call of ``name`` in ``kind``'s format, as the family writes it
    (a wrapper tag in ``added`` also as its one token)."""
    key = "parameters" if kind == "llama3_json" else "arguments"
    head = json.dumps(f'{{"name": {json.dumps(name)}, "{key}": ')
    tail = json.dumps("}")
    if kind == "hermes":
        head = f'{_tag(HERMES_OPEN, added)} "\\n" {head}'
        tail = json.dumps("}\n") + " " + _tag(HERMES_CLOSE, added)
    schema = json.dumps(arguments_schema(parameters), ensure_ascii=False)
    return f"{head} %json {schema} {tail}"


def _tag(tag: str, added: dict[str, int]) -> str:
    """The Lark of a wrapper tag: its text, or the added token that is it."""
    text = json.dumps(tag)
    return f"({text} | {token_ref(added[tag])})" if tag in added else text


__all__ = ["JSON_CALLS", "PARSERS", "HermesParser", "JsonCallsParser", "Llama3JsonParser",
           "ToolCall", "ToolCallParser", "arguments_schema", "call_of", "make_parser",
           "new_call_id", "parse_reply", "parser_for_template", "reply_parser", "stream_deltas",
           "template_tools", "tool_grammar"]
