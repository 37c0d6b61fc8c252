"""The OpenAI wire format: request models (validated strictly, naming the field) and errors.

Fields are OpenAI's plus vLLM's (``top_k``, ``min_p``, structured output); unused ones are
ignored. Every refusal is an ``APIError``, sent as OpenAI's error object.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class APIError(Exception):
    """A refused request: HTTP ``status`` and OpenAI's error object.

    Args:
      status: the HTTP status (400, 401, 404, 408, 413, 429, 503).
      message: one line saying what is wrong and with which value.
      param: the request field at fault (dotted path), or None.
      code: OpenAI's error code (``"context_length_exceeded"``, ``"invalid_api_key"``, ...).
      headers: extra response headers (``Retry-After``).
    """

    TYPES = {400: "invalid_request_error", 401: "authentication_error",
             404: "invalid_request_error", 408: "invalid_request_error",
             413: "invalid_request_error", 429: "rate_limit_exceeded",
             503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message,
                          "type": self.TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far


#: The most choices one request may ask for (``n``).
MAX_N = 16


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: the schema and its name (OpenAI's fields)."""

    model_config = ConfigDict(extra="allow")

    name: str = "response"
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Strict):
    """``response_format``: ``text`` (no constraint), ``json_object`` or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Sampling(_Strict):
    """The fields both endpoints share."""

    model: str
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: off (vLLM)
    min_p: float | None = Field(None, ge=0, le=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False  # vLLM's: do not stop at eos (nor at the chat turn's end)
    seed: int | None = Field(None, ge=0, lt=2 ** 32)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None  # vLLM's structured-output fields
    guided_regex: str | None = None
    guided_choice: list[str] | None = None

    @model_validator(mode="after")
    def _supported(self) -> _Sampling:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0:
                raise APIError(400, f"{name} is not supported (only 0), got "
                               f"{getattr(self, name)}", name)
        stops = self.stop_strings
        if any(not s for s in stops) or len(stops) > 16:
            raise APIError(400, f"stop must be at most 16 non-empty strings, got {self.stop!r}",
                           "stop")
        guided = self.guided_fields
        if len(guided) > 1:
            raise APIError(400, f"give one structured-output field, not {', '.join(guided)}",
                           guided[1])
        rf = self.response_format
        if rf is not None and rf.type == "json_schema" and rf.json_schema is None:
            raise APIError(400, "response_format of type json_schema needs json_schema",
                           "response_format")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream: true",
                           "stream_options")
        return self

    @property
    def guided_fields(self) -> list[str]:
        """The structured-output fields given (a ``response_format`` of type text is none)."""
        return [name for name in ("response_format", "guided_json", "guided_regex",
                                  "guided_choice")
                if getattr(self, name) is not None and not (
                    name == "response_format" and self.response_format.type == "text")]

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: one prompt, as text or token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=5)  # k: the token's and the k most likely
    echo: bool = False
    suffix: str | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            if len(p) != 1:
                raise APIError(400, f"prompt: {len(p)} prompts in one request are not "
                               "supported; send one request per prompt", "prompt")
            self.prompt = p[0]
        if not self.prompt:
            raise APIError(400, "prompt is empty", "prompt")
        for name in ("echo", "suffix"):
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported", name)
        return self


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class CalledFunction(_Strict):
    """``function`` of an assistant message's tool call: the name and the JSON arguments."""

    name: str
    arguments: str


class MessageToolCall(_Strict):
    """One of an assistant message's ``tool_calls`` (as a reply gave it)."""

    model_config = ConfigDict(strict=True, extra="allow")

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def as_dict(self) -> dict[str, Any]:
        """The message as the chat template sees it (text parts joined; a tool call's
        ``arguments`` as a dict, as vLLM gives them: templates write them with ``tojson``)."""
        out = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            out["content"] = "".join(part.text for part in self.content)
        for call in out.get("tool_calls", ()):
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        return out


class FunctionDef(_Strict):
    """A tool's ``function``: its name, description and parameters' JSON schema."""

    model_config = ConfigDict(strict=True, extra="allow")

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    """One of ``tools``: ``{"type": "function", "function": {...}}``."""

    type: Literal["function"]
    function: FunctionDef


class _NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    """``tool_choice`` naming the function to call: ``{"type": "function", "function":
    {"name": ...}}``."""

    type: Literal["function"]
    function: _NamedFunction


TOOL_CHOICES = ("none", "auto", "required")


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``: messages rendered with the checkpoint's chat template."""

    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = Field(None, min_length=1)
    tool_choice: Any = None  # one of TOOL_CHOICES or a NamedToolChoice (checked below)
    parallel_tool_calls: bool = True
    # vLLM's: further variables of the chat template (e.g. {"enable_thinking": false}).
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def tool_mode(self) -> str | NamedToolChoice:
        """``tool_choice`` as validated: ``"none"``, ``"auto"`` (the default with tools),
        ``"required"`` or the ``NamedToolChoice``."""
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice

    @model_validator(mode="after")
    def _tools(self) -> ChatCompletionRequest:
        reserved = sorted(set(self.chat_template_kwargs or ()) & {
            "messages", "tools", "documents", "add_generation_prompt"})
        if reserved:
            raise APIError(400, f"chat_template_kwargs: {', '.join(reserved)} are set by the "
                           "request itself", "chat_template_kwargs")
        names = [t.function.name for t in self.tools or ()]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise APIError(400, f"tools: two functions are named {name!r}",
                               f"tools.{i}.function.name")
        for i, tool in enumerate(self.tools or ()):
            schema = tool.function.parameters
            if schema is not None and schema.get("type", "object") != "object":
                raise APIError(400, f"tools.{i}.function.parameters: the schema of function "
                               f"{tool.function.name!r} must be of type 'object', got "
                               f"{schema.get('type')!r:.80}", f"tools.{i}.function.parameters")
        choice = self.tool_choice
        if isinstance(choice, dict):
            try:
                choice = self.tool_choice = NamedToolChoice.model_validate(choice)
            except ValidationError as e:
                err = validation_error(e.errors())
                raise APIError(400, f"tool_choice.{err.message}", "tool_choice."
                               + (err.param or "")) from None
        elif choice is not None and choice not in TOOL_CHOICES:
            raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or "
                           f"{{'type': 'function', 'function': {{'name': ...}}}}, got "
                           f"{choice!r:.80}", "tool_choice")
        if choice not in (None, "none") and not self.tools:
            raise APIError(400, "tool_choice needs tools", "tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise APIError(400, f"tool_choice: no tool is named {choice.function.name!r}; "
                           f"tools has {', '.join(map(repr, names))}", "tool_choice")
        guided, mode = self.guided_fields, self.tool_mode
        if mode != "none" and guided:
            shown = repr(mode) if isinstance(mode, str) else f"function {mode.function.name!r}"
            raise APIError(400, f"tools with tool_choice {shown} cannot be "
                           f"combined with {guided[0]}; pass tool_choice 'none' or leave out "
                           f"{guided[0]}", "tool_choice" if choice is not None else guided[0])
        for i, m in enumerate(self.messages):
            for j, call in enumerate(m.tool_calls or ()):
                where = f"messages.{i}.tool_calls.{j}.function.arguments"
                try:
                    arguments = json.loads(call.function.arguments)
                except json.JSONDecodeError as e:
                    raise APIError(400, f"{where}: not valid JSON: {e}", where) from None
                if not isinstance(arguments, dict):
                    raise APIError(400, f"{where}: must be a JSON object, got "
                                   f"{call.function.arguments!r:.80}", where)
            if m.tool_calls is not None and m.role != "assistant":
                raise APIError(400, f"messages.{i}: only assistant messages have tool_calls",
                               f"messages.{i}.tool_calls")
            if m.role == "tool" and m.tool_call_id is None:
                raise APIError(400, f"messages.{i}: a tool message needs tool_call_id",
                               f"messages.{i}.tool_call_id")
        return self


_SURROGATE = re.compile("[\ud800-\udfff]")
# What a body holding a lone surrogate must contain: a \\uD800-\\uDFFF escape, or the bytes
# UTF-8 would give one (json decodes bytes with "surrogatepass").
_MAY_HOLD_SURROGATE = re.compile(rb"\\[uU][dD][89a-fA-F]|\xed[\xa0-\xbf]")


def check_unicode(raw: bytes, data: Any) -> None:
    """Refuses a decoded JSON body with a lone surrogate (a ``"\\udc00"`` escape) in any
    string, key or value: no text can be encoded from it.

    Args:
      raw: the body as it came (a quick test: most bodies cannot hold one).
      data: the body decoded.

    Raises:
      APIError: 400 naming the field (dotted path) and the character's position.
    """
    if not _MAY_HOLD_SURROGATE.search(raw):
        return
    found = _find_surrogate(data, [])
    if found is not None:
        path, at, char = found
        param = ".".join(path) or None
        raise APIError(400, f"{param or 'body'}: the text is not valid Unicode: a lone "
                       f"surrogate \\u{ord(char):04x} at character {at} (a \\uD800-\\uDFFF "
                       "escape must be half of a pair)", param)


def _find_surrogate(data: Any, path: list[str]) -> tuple[list[str], int, str] | None:
    if isinstance(data, str):
        m = _SURROGATE.search(data)
        return None if m is None else (path, m.start(), m.group())
    items = (data.items() if isinstance(data, dict)
             else enumerate(data) if isinstance(data, list) else ())
    for key, value in items:
        m = _SURROGATE.search(key) if isinstance(key, str) else None
        if m is not None:
            return [*path, ascii(key)], m.start(), m.group()
        found = _find_surrogate(value, [*path, str(key)])
        if found is not None:
            return found
    return None


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """The first pydantic / FastAPI validation error as an ``APIError`` naming its field."""
    if not errors:
        return APIError(400, "invalid request")
    err = errors[0]
    if err.get("type") == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {err.get('ctx', {}).get('error', '')}"
                        .rstrip(": "), None, "invalid_json")
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    # Union members add their type names to the path (prompt.str, prompt.list[int]).
    loc = [x for x in loc if not any(c in x for c in "[]") and x not in
           ("str", "int", "float", "bool", "function-after")]
    param = ".".join(loc) or None
    value = err.get("input")
    shown = "" if isinstance(value, dict) else f", got {value!r}"
    return APIError(400, f"{param or 'body'}: {err.get('msg', 'invalid')}{shown}"[:500], param)
