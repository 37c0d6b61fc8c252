"""``bench serve``'s structured-output modes: the same load with grammars on the requests.

``engine-json`` gives every request the ``--response-format`` grammar, ``engine-json-mixed``
every other one. The default grammar, an array of exactly ``--output-len``'s maximum words,
cannot end before a request's ``max_tokens`` (a ``json_object`` may close after two tokens).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from transformer_jax.bench.eval import write_bpe
from transformer_jax.serving.grammar import Grammar

WORDS = ("alpha", "beta", "gamma", "delta", "north", "south", "river", "stone", "light", "green")


def default_schema(items: int) -> dict[str, Any]:
    """An array of exactly ``items`` words from ``WORDS``: it cannot end early."""
    return {"type": "array", "items": {"enum": list(WORDS)}, "minItems": items, "maxItems": items}


def grammar_of(response_format: str | None, max_output: int) -> Grammar:
    """``--response-format``: ``json_object``, a JSON schema file or inline JSON, or None for
    ``default_schema(max_output)``.

    Raises:
      ValueError: a file or text that is not a JSON object schema, or does not compile.
    """
    if response_format is None:
        grammar = Grammar("json_schema", default_schema(max_output))
    elif response_format == "json_object":
        grammar = Grammar("json_object")
    else:
        text = (Path(response_format).read_text() if os.path.isfile(response_format)
                else response_format)
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--response-format: not json_object, a schema file or JSON: "
                             f"{e}") from None
        grammar = Grammar("json_schema", schema)
    grammar.check()
    return grammar


def bench_tokenizer(vocab_size: int, directory: str | None) -> Any:
    """The engine's HF tokenizer: ``directory``'s, or a byte-level BPE trained on ``WORDS`` padded
    to exactly ``vocab_size`` tokens (so every token a random model draws has a text)."""
    from transformer_jax.tokenizer import load_tokenizer

    if directory is None:
        directory = tempfile.mkdtemp(prefix="bench-serve-tokenizer-")
        write_bpe(Path(directory), [json.dumps(list(WORDS)), '{"a": [1, 2.5, true, null]}'] * 20,
                  min(vocab_size, 512), pad_to=vocab_size)
    tok = load_tokenizer(directory)
    if tok.vocab_size > vocab_size:
        raise ValueError(f"--tokenizer {directory}: {tok.vocab_size} tokens, more than the "
                         f"model's vocab_size {vocab_size}")
    return tok


def compare(got: dict[str, Any]) -> list[str]:
    """The lines comparing the structured modes of ``got`` with its ``engine`` mode."""
    base = got["engine"]
    lines = []
    if "engine-json" in got:
        tput = got["engine-json"]["output_token_throughput"] / base["output_token_throughput"]
        lines.append(f"engine-json vs engine: {tput:.2f}x output tokens/s (every request "
                     f"under the grammar)")
    if "engine-json-mixed" in got:
        mixed = got["engine-json-mixed"]
        tput = mixed["output_token_throughput"] / base["output_token_throughput"]
        free = mixed["unconstrained_tpot_median_s"] / base["tpot_s"]["median"]
        lines.append(f"engine-json-mixed vs engine: {tput:.2f}x output tokens/s; its "
                     f"unconstrained requests' median TPOT {free:.2f}x the engine's")
    return lines
