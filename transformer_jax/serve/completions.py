"""From a validated OpenAI request to the engine's input, and from its events to OpenAI's
response objects and stream chunks.

A text prompt is encoded as ``generate`` encodes it (``tokenizer.prompt.encode_text``: bos when
the tokenizer adds it); chat messages are rendered with the checkpoint's chat template and its
generation prompt (``encode_chat_prompt``). Generation stops at eos (and, for chat, at the
token that closes the assistant's turn, ``chat_turn_end_id``), at ``stop`` strings (not
returned) and at the token limit: ``max_tokens`` (``max_completion_tokens`` for chat; default
16 for completions, the rest of the context for chat). The defaults of the sampling fields are
OpenAI's (temperature 1, top_p 1); without ``seed`` a request draws a random one.

With ``n`` > 1 the request runs as n engine requests, choice i with seed ``seed + i`` (mod
2**32), so each choice equals the same request sent alone with that seed; the prompt's full pages
are computed once and found in the prefix cache by the others (``Choices``).

A chat with ``tools`` renders them through the template; the reply's tool calls are parsed in
the template's format (``serve.tools``: content and ``tool_calls``, finish reason
``"tool_calls"``), and ``tool_choice`` ``"required"`` or a named function is enforced by a
grammar. ``ModelInfo.tool_parser``, when the server sets one, overrides the template's parser.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
import uuid
from typing import Any

from transformer_jax.decode.prompts import validate_prompts
from transformer_jax.serve import tools
from transformer_jax.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest
from transformer_jax.serving import SamplingParams, TokenEvent
from transformer_jax.serving.grammar import Grammar
from transformer_jax.tokenizer import detokenize
from transformer_jax.tokenizer.chat import ChatTemplateError, template_source
from transformer_jax.tokenizer.prompt import chat_turn_end_id, encode_chat_prompt, encode_text


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What the endpoints need to know of the served model."""

    name: str
    vocab_size: int
    max_len: int
    tokenizer: Any
    turn_end: int | None = None  # the token closing an assistant turn (chat stops there)
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    adapters: tuple[str, ...] = ()  # the LoRA adapters' names, each also a model to ask for
    tool_parser: str | None = None  # the tool calls' format (``serve.tools``); None: the
    # chat template's
    stop_ids: tuple[int, ...] = ()  # the checkpoint's generation_config eos ids (every request
    # stops there but with ignore_eos)

    @classmethod
    def of(cls, name: str, config: Any, tokenizer: Any, adapters: tuple[str, ...] = (),
           tool_parser: str | None = None, stop_ids: tuple[int, ...] = ()) -> ModelInfo:
        chat = tokenizer is not None and bool(tokenizer.chat_template)
        return cls(name, config.vocab_size, config.max_seq_len, tokenizer,
                   chat_turn_end_id(tokenizer) if chat else None, adapters=tuple(adapters),
                   tool_parser=tool_parser,
                   stop_ids=tuple(i for i in stop_ids if 0 <= i < config.vocab_size))

    def adapter_of(self, model: str) -> str | None:
        """The adapter a request's ``model`` names (None: the base).

        Raises:
          APIError: 404 ``model_not_found`` (OpenAI's answer) for a model not served here.
        """
        if model == self.name:
            return None
        if model in self.adapters:
            return model
        served = ", ".join(repr(m) for m in (self.name, *self.adapters))
        raise APIError(404, f"the model {model!r} does not exist; this server serves {served}",
                       "model", "model_not_found")


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A request ready for the engine: its prompt ids and sampling parameters."""

    prompt: list[int]
    params: SamplingParams
    chat: bool
    n: int = 1
    tool_parser: str | None = None  # the reply's tool calls' format (``serve.tools``), or None

    def choice(self, i: int) -> SamplingParams:
        """The parameters of choice i: the request's, with seed ``seed + i`` (mod 2**32)."""
        return dataclasses.replace(self.params, seed=(self.params.seed + i) % 2 ** 32)


def prepare(req: CompletionRequest | ChatCompletionRequest, model: ModelInfo) -> Prepared:
    """The prompt ids and ``SamplingParams`` of a request.

    Raises:
      APIError: 400 naming the field: unknown model, a prompt the tokenizer or the model
        cannot take, a chat without a template, prompt + max_tokens above the context.
    """
    adapter = model.adapter_of(req.model)
    tok = model.tokenizer
    chat = isinstance(req, ChatCompletionRequest)
    if chat:
        prompt, where = _chat_prompt(req, tok), "messages"
    else:
        prompt, where = _completion_prompt(req, model), "prompt"
    parser = tools.reply_parser(req, template_source(tok, tools.template_tools(req)),
                                model.tool_parser) if chat else None
    limit = req.token_limit if chat else req.max_tokens
    room = model.max_len - len(prompt)
    if room <= 0 or (limit or 0) > room:
        asked = f" + max_tokens {limit}" if limit else ""
        raise APIError(400, f"the prompt has {len(prompt)} tokens{asked}: more than the model's "
                       f"context of {model.max_len} tokens",
                       where if room <= 0 or not limit else
                       ("max_completion_tokens" if chat and req.max_completion_tokens else
                        "max_tokens"), "context_length_exceeded")
    stop_ids = list(req.stop_token_ids or [])
    if tok is not None and tok.eos_id >= 0 and not req.ignore_eos:
        stop_ids.append(tok.eos_id)
    if chat and model.turn_end is not None and not req.ignore_eos:
        stop_ids.append(model.turn_end)
    if not req.ignore_eos:
        stop_ids.extend(model.stop_ids)
    if any(not 0 <= i < model.vocab_size for i in stop_ids):
        raise APIError(400, f"stop_token_ids must be ids in [0, {model.vocab_size}), got "
                       f"{req.stop_token_ids}", "stop_token_ids")
    if req.stop_strings and tok is None:
        raise APIError(400, "stop strings need the model's tokenizer; this checkpoint has "
                       "none", "stop")
    top_k = req.top_k if req.top_k and req.top_k > 0 else None
    if top_k is not None and top_k > model.vocab_size:
        raise APIError(400, f"top_k must be at most the vocabulary size {model.vocab_size}, "
                       f"got {top_k}", "top_k")
    params = SamplingParams(
        max_tokens=limit or room, stop_token_ids=tuple(dict.fromkeys(stop_ids)),
        temperature=1.0 if req.temperature is None else req.temperature, top_k=top_k,
        top_p=req.top_p, min_p=req.min_p or None,
        seed=secrets.randbelow(2 ** 32) if req.seed is None else req.seed,
        logprobs=bool(req.logprobs is not None and req.logprobs is not False),
        top_logprobs=min(_top_asked(req), model.vocab_size),
        grammar=_grammar(req, model, parser),
        stop=req.stop_strings, adapter=adapter)
    return Prepared(prompt, params, chat, req.n, parser)


def _grammar(req: CompletionRequest | ChatCompletionRequest, model: ModelInfo,
             tool_parser: str | None = None) -> Grammar | None:
    """The request's structured-output grammar (``response_format`` or vLLM's ``guided_*``),
    checked to compile, or the grammar enforcing its ``tool_choice`` (in ``tool_parser``'s
    format), or None.

    Raises:
      APIError: 400 naming the field, for a grammar that does not compile or a model without
        a tokenizer.
    """
    if tool_parser is not None:
        enforced = tools.tool_grammar(req, tool_parser)
        if enforced is not None:  # (protocol refuses it beside response_format / guided_*)
            return enforced
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        field, grammar = "response_format", Grammar("json_object")
    elif rf is not None and rf.type == "json_schema":
        field, grammar = "response_format", Grammar("json_schema", rf.json_schema.schema_)
    elif req.guided_json is not None:
        field, grammar = "guided_json", Grammar("json_schema", req.guided_json)
    elif req.guided_regex is not None:
        field, grammar = "guided_regex", Grammar("regex", req.guided_regex)
    elif req.guided_choice is not None:
        field, grammar = "guided_choice", Grammar("choice", tuple(req.guided_choice))
    else:
        return None
    if model.tokenizer is None:
        raise APIError(400, f"{field} needs the model's tokenizer; this checkpoint has none",
                       field)
    try:
        grammar.check()
    except (ValueError, TypeError) as e:  # (json text that does not parse included)
        raise APIError(400, f"{field}: {e}", field) from None
    return grammar


def _top_asked(req: CompletionRequest | ChatCompletionRequest) -> int:
    """How many alternatives a request asks for per token: chat's ``top_logprobs``, the
    completions' ``logprobs: k``."""
    if isinstance(req, ChatCompletionRequest):
        return req.top_logprobs or 0
    return req.logprobs or 0


def _completion_prompt(req: CompletionRequest, model: ModelInfo) -> list[int]:
    if isinstance(req.prompt, str):
        if model.tokenizer is None:
            raise APIError(400, "text prompts need the model's tokenizer; this checkpoint has "
                           "none: send token ids", "prompt")
        try:
            return encode_text(releasing_gil(model.tokenizer), req.prompt)
        except (UnicodeError, TypeError) as e:  # a lone surrogate (app.parse refuses
            # them before; HF tokenizers raise TypeError for one)
            raise APIError(400, f"prompt: the text is not valid Unicode: {_reason(e)}",
                           "prompt") from None
    try:
        (ids,) = validate_prompts([req.prompt], model.vocab_size)
    except ValueError as e:
        raise APIError(400, f"prompt: {e}", "prompt") from None
    return ids.tolist()


def _chat_prompt(req: ChatCompletionRequest, tokenizer: Any) -> list[int]:
    if tokenizer is None or not tokenizer.chat_template:
        raise APIError(400, "this model has no chat template: use /v1/completions",
                       "messages")
    try:
        return encode_chat_prompt(releasing_gil(tokenizer), [m.as_dict() for m in req.messages],
                                  tools=tools.template_tools(req))
    except (ChatTemplateError, TypeError) as e:
        raise APIError(400, f"messages: {e}", "messages") from None
    except UnicodeError as e:
        raise APIError(400, f"messages: the text is not valid Unicode: {_reason(e)}",
                       "messages") from None


class _ReleasingGIL:
    """A HF tokenizer (``HFTokenizer``) whose ``encode`` lets other threads run meanwhile.

    ``tokenizers.Tokenizer.encode`` holds the GIL for the whole text (seconds for a long
    prompt: the event loop would stop for as long, even with the encoding on a worker thread);
    its ``encode_batch`` releases it and gives the same ids. Everything else is the wrapped
    tokenizer's.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.wrapped = tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.wrapped, name)

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """``HFTokenizer.encode``, through ``encode_batch``."""
        tok = self.wrapped
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        if (add_bos and tok.bos_id < 0) or (add_eos and tok.eos_id < 0):
            return tok.encode(text, add_bos, add_eos)  # its error
        ids = tok.backend.encode_batch([text], add_special_tokens=False)[0].ids if text else []
        return [tok.bos_id] * add_bos + ids + [tok.eos_id] * add_eos


def releasing_gil(tokenizer: Any) -> Any:
    """``tokenizer``, seen through ``_ReleasingGIL`` when it is a HF one (a ``backend`` that
    is a ``tokenizers.Tokenizer``); others as they are."""
    import tokenizers

    if isinstance(getattr(tokenizer, "backend", None), tokenizers.Tokenizer):
        return _ReleasingGIL(tokenizer)
    return tokenizer


def _reason(error: Exception) -> str:
    """A Unicode error's message without the character it failed on (which may be a lone
    surrogate, itself unencodable)."""
    return str(error).encode("ascii", "backslashreplace").decode()


# Responses ---------------------------------------------------------------------------------------

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
        self.token_ids: list[int] = []
        self.token_logprobs: list[float] = []
        self.token_tops: list[Any] = []
        self.finish_reason: str | None = None
        # The reply's tool calls, parsed as the stream goes (``serve.tools``), and their count.
        self.tool_parser = prepared.tool_parser if self.chat else None
        self._calls = tools.make_parser(self.tool_parser) if self.tool_parser else None
        self._calls_sent = 0

    def add(self, events: list[TokenEvent]) -> tuple[str, list[TokenEvent]]:
        """Takes a step's events; returns their text and the events with a token."""
        tokens = [e for e in events if e.token is not None]
        text = "".join(e.text or "" for e in events)
        self.completion_tokens += len(tokens)
        self.text.append(text)
        self.token_ids += [e.token for e in tokens]
        self.token_logprobs += [e.logprob for e in tokens]
        self.token_tops += [e.top_logprobs for e in tokens]
        for e in events:
            self.finish_reason = e.finish_reason or self.finish_reason
        return text, tokens

    @property
    def usage(self) -> dict[str, int]:
        """The request's usage (of all its choices: the prompt counted once)."""
        if self.group is not None:
            return self.group.usage
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def _head(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else \
            "text_completion"
        return {"id": self.id, "object": kind, "created": self.created,
                "model": self.model.name}

    def _piece(self, token: int) -> str:
        tok = self.model.tokenizer
        return detokenize(tok, [token]) if tok is not None else f"<{token}>"

    def _logprobs(self, tokens: list[int], logprobs: list[float], tops: list[Any]
                  ) -> dict[str, Any] | None:
        """The ``logprobs`` object of ``tokens`` (``tops``: each one's (id, log-probability)
        alternatives, or None), in the endpoint's format."""
        if not self.logprobs:
            return None
        pieces = [self._piece(t) for t in tokens]
        alternatives = [[(self._piece(i), lp) for i, lp in top or ()] for top in tops]
        if self.chat:
            return {"content": [
                {"token": p, "logprob": lp, "bytes": list(p.encode()),
                 "top_logprobs": [{"token": a, "logprob": alp, "bytes": list(a.encode())}
                                  for a, alp in alt]}
                for p, lp, alt in zip(pieces, logprobs, alternatives, strict=True)]}
        offsets, at = [], 0
        for p in pieces:
            offsets.append(at)
            at += len(p)
        # A dict per token, as OpenAI's: two ids that decode alike keep the likelier one.
        top = [dict(reversed(alt)) for alt in alternatives]
        top = [dict(sorted(t.items(), key=lambda kv: -kv[1])) for t in top]
        return {"tokens": pieces, "token_logprobs": logprobs,
                "top_logprobs": top if any(tops) else None, "text_offset": offsets}

    def choice(self) -> dict[str, Any]:
        """This choice of the whole (non-streamed) response."""
        logprobs = self._logprobs(self.token_ids, self.token_logprobs, self.token_tops)
        text = "".join(self.text)
        choice: dict[str, Any] = {"index": self.index, "logprobs": logprobs,
                                  "finish_reason": self.finish_reason}
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
        return choice

    def final(self) -> dict[str, Any]:
        """The whole (non-streamed) response of a one-choice request."""
        return {**self._head(False), "choices": [self.choice()], "usage": self.usage}

    def chunk(self, text: str, tokens: list[TokenEvent], finish_reason: str | None,
              first: bool = False, usage: bool = False) -> dict[str, Any]:
        """One stream chunk of ``text`` (the first one of a chat opens the assistant role),
        with the usage so far when ``usage``."""
        logprobs = self._logprobs([e.token for e in tokens], [e.logprob for e in tokens],
                                  [e.top_logprobs for e in tokens])
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
        """The stream chunks of one step's ``text`` (none when there is nothing to send).

        With tools, the text goes through the reply's tool-call parser: content deltas for the
        text known to be no call, and each call once whole, as OpenAI streams it: a delta with
        its ``index``, ``id``, ``type`` and name (``arguments`` ""), then one with its
        arguments. The step's logprobs ride on its first chunk, the finish reason (``"tool_calls"``
        for ``"stop"`` once calls were sent) and the usage on its last.
        """
        if self._calls is None:
            if not (text or first or finish_reason is not None):
                return []
            return [self.chunk(text, tokens, finish_reason, first, usage)]
        pieces = self._calls.feed(text)
        if finish_reason is not None:
            pieces += self._calls.finish()
        deltas = tools.stream_deltas(pieces, self._calls_sent)
        self._calls_sent += sum(isinstance(p, tools.ToolCall) for p in pieces)
        if first:
            deltas[:1] = [{"role": "assistant", **(deltas[0] if deltas else {})}]
        logprobs = self._logprobs([e.token for e in tokens], [e.logprob for e in tokens],
                                  [e.top_logprobs for e in tokens])
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

    @property
    def usage(self) -> dict[str, int]:
        prompt = self.responses[0].prompt_tokens
        done = sum(r.completion_tokens for r in self.responses)
        return {"prompt_tokens": prompt, "completion_tokens": done,
                "total_tokens": prompt + done}

    def final(self) -> dict[str, Any]:
        """The whole (non-streamed) response."""
        return {**self.responses[0]._head(False),
                "choices": [r.choice() for r in self.responses], "usage": self.usage}
