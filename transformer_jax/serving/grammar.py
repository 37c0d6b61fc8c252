"""Structured outputs: a request's grammar, compiled by llguidance against the engine's tokenizer,
and the mask of the tokens it allows at each step.

A ``Grammar`` is a JSON schema, any JSON object, a regular expression, one of some strings or
llguidance's Lark syntax. A step with grammar rows dispatches the forward, fills each row of a
[R, ceil(V/32)] int32 bitmask on the host while it runs, then samples with every other token at
-inf. llguidance (the ``serve`` extra) is imported only when a grammar is used; the tokenizer it
is given tokenizes without the added tokens, so a grammar names one as ``<[id]>`` (``token_ref``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from typing import Any

logger = logging.getLogger(__name__)

KINDS = ("json_schema", "json_object", "regex", "choice", "lark")


@dataclasses.dataclass(frozen=True)
class Grammar:
    """What a request's output must be.

    Attributes:
      kind: one of ``KINDS``.
      value: ``"json_schema"``: the schema (a dict or JSON text); ``"json_object"``: None;
        ``"regex"``: the pattern; ``"choice"``: a tuple of strings; ``"lark"``: the text.
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
        """The llguidance grammar of this one; ValueError for an unknown kind or a bad value."""
        from llguidance import LLMatcher

        if self.kind in ("json_schema", "json_object"):
            schema = self.value if self.kind == "json_schema" else {"type": "object"}
            if isinstance(schema, str):
                schema = json.loads(schema)
            if not isinstance(schema, dict):
                raise ValueError(f"json_schema must be a JSON object, got {schema!r:.80}")
            return LLMatcher.grammar_from_json_schema(
                schema, defaults={"whitespace_flexible": False})
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
        full = llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size,
                                      eos_token=tokenizer.eos_id, slices=[])  # only read
        self._tok = llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(_TextTokenizer(full, backend, tokenizer.bos_id)),
            n_vocab=vocab_size, eos_token=tokenizer.eos_id)

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


class _TextTokenizer:
    """The tokenizer as ``llguidance.TokenizerWrapper`` takes it: ``full``'s tokens (an
    ``LLTokenizer`` of ``backend``, the ``tokenizers.Tokenizer``), text tokenized without the
    added tokens; ``bos_id`` -1 for none."""

    def __init__(self, full: Any, backend: Any, bos_id: int) -> None:
        n = full.vocab_size
        self.eos_token_id = full.eos_token
        self.bos_token_id = bos_id if bos_id >= 0 else None
        self.tokens = [full.decode_bytes([i]) for i in range(n)]
        self.special_token_ids = [i for i in range(n) if full.is_special_token(i)]
        self._special = frozenset(self.special_token_ids)
        self._full = full
        spec = json.loads(backend.to_str())
        spec["added_tokens"] = []
        import tokenizers

        try:
            self._plain = tokenizers.Tokenizer.from_str(json.dumps(spec))
        except Exception as e:  # the Rust side raises plain Exception
            logger.warning("grammars tokenize forced text greedily: the tokenizer without its "
                           "added tokens does not load (%s)", e)
            self._plain = None

    def __call__(self, text: str) -> list[int]:
        """Ids [T] of ``text`` (a str: bytes are refused, so llguidance passes text)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        if self._plain is None:
            return self._full.greedy_tokenize(text)
        ids = self._plain.encode(text, add_special_tokens=False).ids
        if any(i in self._special for i in ids):  # a model vocabulary that holds one
            return self._full.greedy_tokenize(text)
        return ids


def token_ref(token_id: int) -> str:
    """The Lark reference to the one token ``token_id`` (llguidance's ``<[id]>``)."""
    return f"<[{int(token_id)}]>"


def added_token_ids(tokenizer: Any) -> dict[str, int]:
    """{text: id} of the added tokens of an ``HFTokenizer`` (special or not: ``<|im_end|>``,
    Qwen's ``<tool_call>``); empty for any other tokenizer."""
    backend = getattr(tokenizer, "backend", None)
    if backend is None or not hasattr(backend, "get_added_tokens_decoder"):
        return {}
    return {t.content: i for i, t in backend.get_added_tokens_decoder().items()}
