"""How text becomes the ids a model is trained on and prompted with, one place for both: a text
prompt gets bos exactly when the tokenizer's ``add_bos_token`` says so (Llama yes, Qwen2 no); a
chat is rendered with the chat template and encoded with no bos beyond what the template writes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from transformer_jax.tokenizer.base import TextTokenizer
from transformer_jax.tokenizer.chat import ChatTemplate

_PROBE_REPLY = "REPLY"  # an assistant reply, to find what the template closes a turn with


def adds_bos(tokenizer: TextTokenizer) -> bool:
    """Whether a text prompt starts with bos: ``add_bos_token``, if the tokenizer has a bos."""
    return bool(tokenizer.add_bos_token) and tokenizer.bos_id >= 0


def encode_text(tokenizer: TextTokenizer, text: str, *, bos: bool | None = None) -> list[int]:
    """The ids [T] of a text prompt (or a record's prompt part); ``bos`` prepends bos, and None
    (the default) follows the tokenizer (``adds_bos``)."""
    add = adds_bos(tokenizer) if bos is None else bos and tokenizer.bos_id >= 0
    return tokenizer.encode(text, add_bos=add)


def encode_chat_prompt(tokenizer: TextTokenizer, messages: Sequence[Mapping[str, Any]], *,
                       tools: Sequence[Mapping[str, Any]] | None = None,
                       template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """The ids [T] of a conversation rendered with the tokenizer's chat template and its
    generation prompt, as fine-tuning encoded it; ``tools`` (OpenAI function entries) and
    ``template_kwargs`` (e.g. ``enable_thinking``) go to the template.

    Raises:
      ValueError: the tokenizer has no chat template (``ChatTemplateError`` if it fails).
    """
    text = ChatTemplate.of(tokenizer, tools).render(messages, add_generation_prompt=True,
                                                    tools=tools, **(template_kwargs or {}))
    return tokenizer.encode(text)


def chat_turn_end_id(tokenizer: TextTokenizer) -> int | None:
    """The id of the token closing a chat template's assistant turn (``<|im_end|>``), to stop
    generation at; None if it is no single token. ValueError without a chat template."""
    template = ChatTemplate.of(tokenizer)
    user = {"role": "user", "content": "x"}
    before = template.render([user], add_generation_prompt=True)
    through = template.render([user, {"role": "assistant", "content": _PROBE_REPLY}])
    closing = (through[len(before) + len(_PROBE_REPLY):].split()
               if through.startswith(before + _PROBE_REPLY) else [])
    if not closing:
        return None
    token_id = tokenizer.token_to_id(closing[0])
    if token_id is None or tokenizer.encode(closing[0]) != [token_id]:
        return None
    return token_id


__all__ = ["adds_bos", "chat_turn_end_id", "encode_chat_prompt", "encode_text"]
