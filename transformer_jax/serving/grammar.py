"""Structured outputs: a request's grammar, compiled by llguidance against the engine's tokenizer,
and the mask of the tokens it allows at each step.

A ``Grammar`` says what the output must be: text matching a JSON schema (``"json_schema"``), any
JSON object (``"json_object"``), a regular expression (``"regex"``), one of some strings
(``"choice"``) or a grammar in llguidance's Lark syntax (``"lark"``, which may embed JSON
schemas as ``%json {...}``: the server's enforced tool calls). The engine gives each request
with one a ``llguidance.LLMatcher``. A step with grammar rows runs as two programs: the
forward is dispatched first, and while the device runs it each matcher fills its request's row
of a [R, ceil(V/32)] int32 bitmask on the host (bit v of a row: token v is allowed); the
sampling program then sets every other token's logit to -inf (``step.sample_rows``; the masks
are ``decode.constrained``'s, which ``generate``'s constrained loop uses too). After
the step, the drawn token is fed to the matcher. Once the grammar is complete (nothing but its
end may follow), the request finishes with reason ``"stop"``.
Rows without a grammar get no mask, and a step with none of them runs the unmasked program.

llguidance (the ``serve`` extra) is imported only when a grammar is used. It needs the HF
``tokenizers`` tokenizer of the checkpoint (``tokenizer.json``), whose bytes it reads.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

KINDS = ("json_schema", "json_object", "regex", "choice", "lark")


@dataclasses.dataclass(frozen=True)
class Grammar:
    """What a request's output must be.

    Attributes:
      kind: one of ``KINDS``.
      value: the JSON schema (a dict, or its JSON text) for ``"json_schema"``; None for
        ``"json_object"``; the pattern for ``"regex"``; a tuple of strings for ``"choice"``;
        the grammar's text for ``"lark"``.
    """

    kind: str
    value: Any = None

    def compiled(self) -> str:
        """``source()``, its errors raised as ValueError naming the kind."""
        try:
            return self.source()
        except (ValueError, TypeError, RuntimeError) as e:
            raise ValueError(f"{self.kind}: {e}") from None

    def source(self) -> str:
        """The llguidance grammar of this one.

        Raises:
          ValueError: an unknown kind, a schema that is not a JSON object, an empty choice or
            lark text.
        """
        from llguidance import LLMatcher

        if self.kind == "json_schema":
            schema = self.value
            if isinstance(schema, str):
                schema = json.loads(schema)
            if not isinstance(schema, dict):
                raise ValueError(f"json_schema must be a JSON object, got {schema!r:.80}")
            return LLMatcher.grammar_from_json_schema(
                schema, defaults={"whitespace_flexible": False})
        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema(
                {"type": "object"}, defaults={"whitespace_flexible": False})
        if self.kind == "regex":
            if not isinstance(self.value, str):
                raise ValueError(f"regex must be a string, got {self.value!r:.80}")
            return LLMatcher.grammar_from_regex(self.value)
        if self.kind == "choice":
            choices = self.value
            if (not isinstance(choices, tuple | list) or not choices
                    or not all(isinstance(c, str) and c for c in choices)):
                raise ValueError(f"choice must be a non-empty list of non-empty strings, got "
                                 f"{choices!r:.80}")
            return LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in choices))
        if self.kind == "lark":
            if not isinstance(self.value, str) or not self.value.strip():
                raise ValueError(f"lark must be a non-empty grammar text, got {self.value!r:.80}")
            return LLMatcher.grammar_from_lark(self.value)
        raise ValueError(f"grammar kind must be one of {KINDS}, got {self.kind!r}")

    def check(self) -> None:
        """Raises ValueError (naming the kind) unless the grammar compiles."""
        from llguidance import LLMatcher

        failed, messages = LLMatcher.validate_grammar_with_warnings(self.compiled())
        if failed:
            raise ValueError(f"{self.kind}: {'; '.join(messages)}")


class GrammarTokenizer:
    """The engine's tokenizer as llguidance reads it (built once: it indexes every token).

    Args:
      tokenizer: an ``HFTokenizer`` (``tokenizer.hf_backend``).
      vocab_size: V, the model's vocabulary (rows past the tokenizer's are never allowed).

    Raises:
      ValueError: the tokenizer is not an HF ``tokenizers`` one.
    """

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import llguidance

        backend = getattr(tokenizer, "backend", None)
        if backend is None or not hasattr(backend, "to_str"):
            raise ValueError("structured outputs need the checkpoint's HF tokenizer "
                             "(tokenizer.json); this engine's tokenizer is "
                             f"{type(tokenizer).__name__}")
        self.vocab_size = vocab_size
        self.words = -(-vocab_size // 32)
        self._tok = llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size,
                                           eos_token=tokenizer.eos_id)

    def matcher(self, grammar: Grammar) -> Any:
        """A fresh ``llguidance.LLMatcher`` of ``grammar``.

        Raises:
          ValueError: naming the kind, when it does not compile.
        """
        import llguidance

        m = llguidance.LLMatcher(self._tok, grammar.compiled())
        if m.is_error():
            raise ValueError(f"{grammar.kind}: {m.get_error()}")
        return m
