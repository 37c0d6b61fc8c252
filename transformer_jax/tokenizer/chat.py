"""Chat templates: render a checkpoint's own Jinja template as transformers does.

As ``apply_chat_template(..., tokenize=False)``: a sandboxed Jinja environment with
transformers' options, filters and globals; the template sees ``messages`` (None values
dropped), ``add_generation_prompt``, ``tools`` / ``documents``, the special tokens and kwargs.
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

Message = Mapping[str, Any]


class ChatTemplateError(ValueError):
    """A chat template failed to compile or render (``raise_exception`` or a Jinja error)."""


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@functools.lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    """Compiles a chat template source (cached); ChatTemplateError on a syntax error."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not compile: line {e.lineno}: {e}") from e


def render_chat(template: str, messages: Sequence[Message], *,
                add_generation_prompt: bool = False,
                special_tokens: Mapping[str, str] | None = None,
                tools: Sequence[Mapping[str, Any]] | None = None,
                documents: Sequence[Mapping[str, Any]] | None = None, **kwargs: Any) -> str:
    """Renders a conversation with a chat template, as ``apply_chat_template(tokenize=False)``.

    Args:
      template: The Jinja template source.
      messages: The conversation: dicts with at least ``role`` and ``content``.
      add_generation_prompt: Append the header that opens an assistant turn.
      special_tokens: Named special tokens (``{"bos_token": "<s>", ...}``) the template sees.
      tools, documents: Tool JSON schemas and documents, for templates that use them.
      **kwargs: Further template variables; they override special tokens of the same name.

    Returns:
      The rendered text (special tokens appear as text; encode it without adding bos).

    Raises:
      ChatTemplateError: If the template does not compile, raises or fails while rendering.
      TypeError: If a message is not a mapping.
    """
    if not messages:
        raise ChatTemplateError("cannot render an empty conversation")
    chat = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise TypeError(f"chat messages must be dicts, got {message!r}")
        chat.append({key: value for key, value in message.items() if value is not None})
    variables = {**(special_tokens or {}), **kwargs}
    compiled = compile_template(template)
    try:
        return compiled.render(messages=chat, tools=None if tools is None else list(tools),
                               documents=None if documents is None else list(documents),
                               add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat template failed: {e}") from e
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e


def template_source(tokenizer: Any, tools: Sequence[Mapping[str, Any]] | None = None
                    ) -> str | None:
    """The template a conversation is rendered with, as transformers picks it: with ``tools``
    (not None) the ``"tool_use"`` one where there is one, else the default (None if none)."""
    if tools is not None:
        config = getattr(tokenizer, "config", None)  # a TokenizerConfig, or None
        named = getattr(config, "named_templates", None) or {}
        if "tool_use" in named:
            return named["tool_use"]
    return getattr(tokenizer, "chat_template", None)


class ChatTemplate:
    """A tokenizer's chat template (``source``) bound to the named ``special_tokens`` it sees."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None):
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        compile_template(source)  # fail early on a syntax error

    @classmethod
    def of(cls, tokenizer: Any, tools: Sequence[Mapping[str, Any]] | None = None
           ) -> ChatTemplate:
        """The chat template of a tokenizer (with ``tools``, its ``"tool_use"`` one when it has
        one: ``template_source``); ValueError if it has none."""
        source = template_source(tokenizer, tools)
        if not source:
            raise ValueError(f"tokenizer {tokenizer!r} has no chat template (no "
                             "chat_template.jinja or chat_template in tokenizer_config.json)")
        return cls(source, getattr(tokenizer, "special_tokens", {}))

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = False,
               **kwargs: Any) -> str:
        """``render_chat`` with this template and its special tokens."""
        return render_chat(self.source, messages, add_generation_prompt=add_generation_prompt,
                           special_tokens=self.special_tokens, **kwargs)


__all__ = ["ChatTemplate", "ChatTemplateError", "Message", "compile_template", "render_chat",
           "template_source"]
