"""What a request is: its sampling parameters, its state in the engine, and what it emits.

``SamplingParams`` are validated by the same checks as ``generation.generate``'s arguments
(``decode.SamplingSettings.validate``, ``prompts.validate_prompts``); a request's PRNG key is
``prompts.sequence_keys([seed], 1)``, the key ``generate(..., seed=[seed])`` gives that prompt,
and its token i is drawn with ``fold_in(key, i)`` as there, so a request samples the same
whatever else the engine runs beside it.
"""

from __future__ import annotations

import dataclasses
import enum
import numbers
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import numpy as np

from transformer_jax.decode.loop import SamplingSettings
from transformer_jax.decode.prompts import is_int, sequence_keys
from transformer_jax.decode.speculative import parse_spec
from transformer_jax.serving.grammar import Grammar

#: The most alternatives a request's ``top_logprobs`` may ask for (OpenAI's limit).
MAX_TOP_LOGPROBS = 20


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings.

    Attributes:
      max_tokens: the most new tokens (> 0; then reason ``"length"``).
      stop_token_ids: token ids in [0, V) that end the request (reason ``"stop"``; the stop
        token is part of the output, as in ``generate``).
      temperature: >= 0; 0 is greedy.
      top_k, top_p, min_p: None, or k in [1, V], p in (0, 1], a value in [0, 1].
      seed: the request's own PRNG seed, an int in [0, 2**32) (token i is drawn with
        ``fold_in(key(seed), i)``, as ``generate(..., seed=[seed])`` draws it).
      logprobs: (a bool) whether each ``TokenEvent`` carries the token's log-probability.
      top_logprobs: K in [0, ``MAX_TOP_LOGPROBS``]: each ``TokenEvent`` also carries the K
        most likely tokens of that step with their log-probabilities (needs ``logprobs``).
      stop: non-empty stop strings: the request ends (reason ``"stop"``) when its text contains
        one; the text released stops before it (the engine needs a tokenizer).
      grammar: a ``serving.grammar.Grammar`` the output must follow (reason ``"stop"`` once it
        is complete), or None.
      adapter: the name of one of the engine's LoRA adapters, or None for the base model.
      speculative: a spec string (``"ngram:k=4"``, ``"draft:PATH:k=4"``, ``"mtp"``) or a
        ``SpeculativeConfig``: the same tokens as without, often several per step.
    """

    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int = 0
    logprobs: bool = False
    top_logprobs: int = 0
    stop: tuple[str, ...] = ()
    grammar: Grammar | None = None
    adapter: str | None = None
    speculative: Any = None

    def validate(self, vocab_size: int) -> None:
        """Raises ValueError naming the first setting of the wrong type or out of range."""
        if not is_int(self.max_tokens) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive int, got {self.max_tokens!r}")
        stop_ids = self.stop_token_ids
        if not _is_collection(stop_ids, arrays=True):
            raise ValueError(f"stop_token_ids must be a sequence of ints, got {stop_ids!r}")
        for tok in stop_ids:
            if not is_int(tok) or not 0 <= tok < vocab_size:
                raise ValueError(f"stop_token_ids must be token ids in [0, {vocab_size}), "
                                 f"got {tok!r} in {stop_ids!r}")
        if not _is_real(self.temperature):
            raise ValueError(f"temperature must be a number >= 0 (0 is greedy), got "
                             f"{self.temperature!r}")
        if self.top_k is not None and not is_int(self.top_k):
            raise ValueError(f"top_k must be None or an int in [1, {vocab_size}], got "
                             f"{self.top_k!r}")
        for name, value, accepts in (("top_p", self.top_p, "in (0, 1]"),
                                     ("min_p", self.min_p, "in [0, 1]")):
            if value is not None and not _is_real(value):
                raise ValueError(f"{name} must be None or a number {accepts}, got {value!r}")
        if not is_int(self.seed) or not 0 <= self.seed < 2 ** 32:
            raise ValueError(f"seed must be an int in [0, 2**32), got {self.seed!r}")
        if not isinstance(self.logprobs, (bool, np.bool_)):
            raise ValueError(f"logprobs must be a bool, got {self.logprobs!r}")
        k = self.top_logprobs
        if not is_int(k) or not 0 <= k <= min(MAX_TOP_LOGPROBS, vocab_size):
            raise ValueError(f"top_logprobs must be an int in [0, "
                             f"{min(MAX_TOP_LOGPROBS, vocab_size)}], got {k!r}")
        if k and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=True")
        stop = self.stop
        if not _is_collection(stop) or any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must be a sequence of non-empty strings, got {stop!r}")
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise ValueError(f"grammar must be a serving.grammar.Grammar or None, got "
                             f"{self.grammar!r:.80}")
        if self.adapter is not None and (not isinstance(self.adapter, str) or not self.adapter):
            raise ValueError(f"adapter must be an adapter's name or None, got "
                             f"{self.adapter!r:.80}")
        if self.speculative is not None:
            parse_spec(self.speculative)
        self.settings().validate(vocab_size)

    def settings(self) -> SamplingSettings:
        """The same settings as ``generate`` takes them."""
        return SamplingSettings(temperature=self.temperature, top_k=self.top_k,
                                top_p=self.top_p, min_p=self.min_p,
                                stop_tokens=tuple(self.stop_token_ids))


def _is_collection(x: Any, arrays: bool = False) -> bool:
    """A sequence (not a string) or a set (or, with ``arrays``, a numpy array)."""
    if type(x) in (tuple, list):  # the usual case, without the ABCs' checks
        return True
    kinds = (Sequence, AbstractSet, np.ndarray) if arrays else (Sequence, AbstractSet)
    return isinstance(x, kinds) and not isinstance(x, (str, bytes))


def _is_real(x: Any) -> bool:
    """A real scalar (an int or float, numpy's included), not a bool or an array."""
    return type(x) in (float, int) or (isinstance(x, numbers.Real)
                                       and not isinstance(x, (bool, np.bool_)))


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    """What a request's consumer receives after each step that concerns it.

    Attributes:
      request_id: the id ``Engine.add_request`` returned.
      token: the new token id, or None for an event that only ends the request (cancelled).
      index: the token's index among the request's new tokens (0 first).
      logprob: its log-probability under the model's raw softmax, when the request asked.
      top_logprobs: with ``SamplingParams.top_logprobs`` K, the step's K most likely tokens
        under that softmax as (token id, log-probability) pairs, most likely first.
      finish_reason: None while the request runs; ``"stop"`` (a stop token, included, or a
        stop string), ``"length"``, ``"cancelled"`` or ``"error"`` on its last event.
      text: the text this token makes whole (possibly empty, held back while it may start a
        stop string), when the engine has a tokenizer; else None.
    """

    request_id: int
    token: int | None
    index: int
    logprob: float | None = None
    finish_reason: str | None = None
    text: str | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None


@dataclasses.dataclass(frozen=True)
class Completion:
    """A finished request: its new tokens (and their log-probabilities) and why it ended.

    ``preemptions`` counts its preemptions; ``prefix_hit_tokens`` the positions it found in
    the prefix cache; ``text`` the text released, ``top_logprobs`` each token's alternatives
    and ``speculative`` its ``decode.speculative.Acceptance``, each when there are any, else None.
    """

    request_id: int
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str
    preemptions: int = 0
    prefix_hit_tokens: int = 0
    text: str | None = None
    top_logprobs: list[tuple[tuple[int, float], ...]] | None = None
    speculative: Any = None


class State(enum.Enum):
    WAITING = "waiting"  # queued (new, or preempted to be recomputed)
    PREFILL = "prefill"  # holds a slot; its prompt is going into the cache chunk by chunk
    RUNNING = "running"  # decodes one token per step
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Request:
    """A request's state in the engine (host side).

    Attributes:
      id: its id, in arrival order (preemption takes the newest first).
      prompt, params: [n] int32 prompt ids; its sampling parameters.
      key_data: [2] uint32 raw PRNG key.
      on_token: optional consumer of its ``TokenEvent``s.
      tokens: prompt + new tokens so far (what the cache holds, in order).
      logprobs, top_logprobs: the new tokens' log-probabilities and top alternatives.
      slot: the engine slot it decodes in, or None.
      pages: its pages in position order (shared prefix pages first).
      cached: positions of ``tokens`` written in its pages.
      prefill_target: positions to prefill before decoding (its tokens when admitted).
      digests: chained digests of its full pages.
      named: leading pages already named in the prefix cache.
      text: its ``serving.text.TextStream`` when the engine detokenises, else None.
      adapter: the index of its LoRA adapter among the engine's (0 = the base model).
    """

    id: int
    prompt: np.ndarray
    params: SamplingParams
    key_data: np.ndarray
    on_token: Callable[[TokenEvent], Any] | None = None
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list[tuple[tuple[int, float], ...]] = dataclasses.field(default_factory=list)
    state: State = State.WAITING
    slot: int | None = None
    pages: list[int] = dataclasses.field(default_factory=list)
    cached: int = 0
    prefill_target: int = 0
    digests: list[bytes] = dataclasses.field(default_factory=list)
    named: int = 0
    finish_reason: str | None = None
    preemptions: int = 0
    prefix_hit_tokens: int = 0
    text: Any = None
    matcher: Any = None  # its grammar's llguidance matcher, or None
    adapter: int = 0
    speculation: Any = None  # its (SpeculativeConfig, Acceptance) when it speculates

    @property
    def digest_root(self) -> bytes:
        """What its page digests chain from: requests of different adapters share no page."""
        return b"" if not self.adapter else f"lora:{self.adapter}".encode()

    @classmethod
    def new(cls, request_id: int, prompt: np.ndarray, params: SamplingParams,
            on_token: Callable[[TokenEvent], Any] | None) -> Request:
        return cls(id=request_id, prompt=prompt, params=params,
                   key_data=sequence_keys([params.seed], 1)[0], on_token=on_token,
                   tokens=prompt.tolist())

    @property
    def num_new(self) -> int:
        """New tokens generated so far."""
        return len(self.tokens) - len(self.prompt)

    def completion(self) -> Completion:
        return Completion(self.id, self.tokens[len(self.prompt):], list(self.logprobs),
                          self.finish_reason or "", self.preemptions, self.prefix_hit_tokens,
                          None if self.text is None else self.text.full_text,
                          list(self.top_logprobs) if self.params.top_logprobs else None,
                          None if self.speculation is None else self.speculation[1])


def with_text(req: Request, event: TokenEvent, cancel: Callable[[Request], Any]) -> TokenEvent:
    """The event with its text delta; a stop string that matched ends the request (``cancel``)."""
    if event.token is None:  # cancelled: the held text is not released
        return dataclasses.replace(event, text="")
    text, stopped = req.text.feed(event.token)
    if stopped:
        if req.state != State.FINISHED:
            cancel(req)
        req.finish_reason = "stop"
        return dataclasses.replace(event, text=text, finish_reason="stop")
    if event.finish_reason is not None:
        text += req.text.finish()
    return dataclasses.replace(event, text=text)
