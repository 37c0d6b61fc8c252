"""How text becomes the ids a model is trained on and prompted with: one place for both.

Fine-tuning (``transformer_jax.data.instruct``) and generation (``transformer-jax generate``)
encode through these functions, so a model is prompted in the format it was trained on:

* a plain text prompt gets bos first exactly when the tokenizer's settings say so
  (``add_bos_token``, as transformers' ``tokenizer(text)`` does; Llama yes, Qwen2 no);
* a chat is rendered with the tokenizer's chat template and encoded without any bos beyond what
  the template writes; a prompt ends with the template's generation prompt, where the model
  starts its reply (the prompt pieces of ``instruct.chat_pieces``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from transformer_jax.tokenizer.base import TextTokenizer
from transformer_jax.tokenizer.chat import ChatTemplate

_PROBE_REPLY = "REPLY"  # an assistant reply, to find what the template closes a turn with


def adds_bos(tokenizer: TextTokenizer) -> bool:
    """Whether a text prompt or prompt/completion record starts with bos: the tokenizer's
    ``add_bos_token``, if it has a bos token."""
    return bool(tokenizer.add_bos_token) and tokenizer.bos_id >= 0


def encode_text(tokenizer: TextTokenizer, text: str, *, bos: bool | None = None) -> list[int]:
    """The ids [T] of a text prompt (or a record's prompt part).

    Args:
      tokenizer: the model's tokenizer.
      text: the prompt.
      bos: prepend bos; None (the default) follows the tokenizer (``adds_bos``).
    """
    add = adds_bos(tokenizer) if bos is None else bos and tokenizer.bos_id >= 0
    return tokenizer.encode(text, add_bos=add)


def encode_chat_prompt(tokenizer: TextTokenizer, messages: Sequence[Mapping[str, Any]], *,
                       tools: Sequence[Mapping[str, Any]] | None = None,
                       template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """The ids [T] of a conversation rendered with the tokenizer's chat template and its
    generation prompt, as fine-tuning encoded the text before each assistant turn.

    Args:
      tokenizer: the model's tokenizer.
      messages: the conversation.
      tools: the template's ``tools`` (OpenAI's ``{"type": "function", "function": {...}}``
        entries, as ``apply_chat_template(tools=...)`` takes them), or None.
      template_kwargs: further template variables (``apply_chat_template(**kwargs)``: e.g.
        ``enable_thinking``).

    Raises:
      ValueError: the tokenizer has no chat template (``ChatTemplateError`` if it fails).
    """
    text = ChatTemplate.of(tokenizer, tools).render(messages, add_generation_prompt=True,
                                                    tools=tools, **(template_kwargs or {}))
    return tokenizer.encode(text)


def chat_turn_end_id(tokenizer: TextTokenizer) -> int | None:
    """The id of the token the chat template closes an assistant turn with (e.g.
    ``<|im_end|>``), for generation to stop at; None when the template closes it with no
    single vocabulary token.

    Raises:
      ValueError: the tokenizer has no chat template.
    """
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
