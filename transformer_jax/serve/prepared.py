"""What the endpoints know of the served model (``ModelInfo``) and a request made ready for
the engine (``Prepared``: its prompt ids, sampling parameters, and how its reply is parsed)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from transformer_jax.serve import reasoning
from transformer_jax.serve.protocol import APIError
from transformer_jax.serving import SamplingParams
from transformer_jax.tokenizer.prompt import chat_turn_end_id


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
    tool_parser: str | None = None  # the tool calls' format; None: the chat template's
    stop_ids: tuple[int, ...] = ()  # the checkpoint's generation_config eos ids
    reasoning_parser: str | None = None  # chat replies' <think> block to reasoning_content
    speculative: Any = None  # every request's speculative decoding (``--speculative``), or None

    @classmethod
    def of(cls, name: str, config: Any, tokenizer: Any, adapters: tuple[str, ...] = (),
           tool_parser: str | None = None, stop_ids: tuple[int, ...] = (),
           reasoning_parser: str | None = None, speculative: Any = None) -> ModelInfo:
        reasoning.check_parser(reasoning_parser)
        chat = tokenizer is not None and bool(tokenizer.chat_template)
        return cls(name, config.vocab_size, config.max_seq_len, tokenizer,
                   chat_turn_end_id(tokenizer) if chat else None, adapters=tuple(adapters),
                   tool_parser=tool_parser,
                   stop_ids=tuple(i for i in stop_ids if 0 <= i < config.vocab_size),
                   reasoning_parser=reasoning_parser, speculative=speculative)

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
    thinking: bool | None = None  # whether the prompt opened a <think> block; None: not parsed

    def choice(self, i: int) -> SamplingParams:
        """The parameters of choice i: the request's, with seed ``seed + i`` (mod 2**32)."""
        return dataclasses.replace(self.params, seed=(self.params.seed + i) % 2 ** 32)


__all__ = ["ModelInfo", "Prepared"]
