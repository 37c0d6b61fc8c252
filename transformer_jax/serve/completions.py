"""From a validated OpenAI request to the engine's input (``prepare``: prompt ids and
``SamplingParams``): text encoded as ``generate`` does, chat messages rendered with the chat
template (tools too, ``serve.tools``), stops at eos, the turn's end and ``stop`` strings.
"""

from __future__ import annotations

import secrets
from typing import Any

from transformer_jax.decode.prompts import validate_prompts
from transformer_jax.serve import reasoning, tools
from transformer_jax.serve.prepared import ModelInfo, Prepared
from transformer_jax.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest
from transformer_jax.serve.response import Choices, Response
from transformer_jax.serving import SamplingParams
from transformer_jax.serving.grammar import Grammar, added_token_ids
from transformer_jax.tokenizer import detokenize
from transformer_jax.tokenizer.base import TokenizerBackend
from transformer_jax.tokenizer.chat import ChatTemplateError, template_source
from transformer_jax.tokenizer.prompt import encode_chat_prompt, encode_text


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
    if not req.ignore_eos:  # eos, the chat turn's end, the checkpoint's generation_config ids
        eos = tok.eos_id if tok is not None and tok.eos_id >= 0 else None
        stop_ids += [i for i in (eos, model.turn_end if chat else None) if i is not None]
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
        # Alternatives per token: chat's top_logprobs, the completions' logprobs: k.
        top_logprobs=min((req.top_logprobs if chat else req.logprobs) or 0, model.vocab_size),
        grammar=_grammar(req, model, parser),
        stop=req.stop_strings, adapter=adapter, speculative=model.speculative)
    thinking = None
    if chat and model.reasoning_parser is not None:  # the prompt's end: a <think> it opened?
        thinking = reasoning.prompt_opens_thinking(detokenize(tok, prompt[-16:]))
    return Prepared(prompt, params, chat, req.n, parser, thinking)


def _grammar(req: CompletionRequest | ChatCompletionRequest, model: ModelInfo,
             tool_parser: str | None = None) -> Grammar | None:
    """The grammar enforcing the request's ``tool_choice`` (in ``tool_parser``'s format), or its
    structured output (``response_format``, ``guided_*``) checked to compile, or None; APIError
    400 naming the field for a grammar that does not compile or a model without a tokenizer."""
    if tool_parser is not None:
        enforced = tools.tool_grammar(req, tool_parser, added_token_ids(model.tokenizer))
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


def _completion_prompt(req: CompletionRequest, model: ModelInfo) -> list[int]:
    if isinstance(req.prompt, str):
        if model.tokenizer is None:
            raise APIError(400, "text prompts need the model's tokenizer; this checkpoint has "
                           "none: send token ids", "prompt")
        try:
            return encode_text(releasing_gil(model.tokenizer), req.prompt)
        except (UnicodeError, TypeError) as e:  # HF tokenizers raise TypeError for a surrogate
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
                                  tools=tools.template_tools(req),
                                  template_kwargs=req.chat_template_kwargs)
    except (ChatTemplateError, TypeError) as e:
        raise APIError(400, f"messages: {e}", "messages") from None
    except UnicodeError as e:
        raise APIError(400, f"messages: the text is not valid Unicode: {_reason(e)}",
                       "messages") from None


class _ReleasingGIL:
    """A HF tokenizer (``HFTokenizer``) whose ``encode`` lets other threads run meanwhile
    (through ``encode_batch``, which releases the GIL and gives the same ids)."""

    def __init__(self, tokenizer: Any) -> None:
        self.wrapped = tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.wrapped, name)

    encode = TokenizerBackend.encode  # ``HFTokenizer.encode``, with the ``_encode_ids`` below

    def _encode_ids(self, text: str) -> list[int]:
        if not text:
            return []
        return self.wrapped.backend.encode_batch([text], add_special_tokens=False)[0].ids


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


__all__ = ["Choices", "ModelInfo", "Prepared", "Response", "encode_text", "prepare",
           "releasing_gil"]
