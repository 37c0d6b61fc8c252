"""Structured outputs in ``generate`` and its CLI (``decode.constrained``): every constrained row's
text follows its grammar (JSON schemas validate, regexes and choices match) and the row ends the
step its grammar completes; a grammar that allows exactly the unconstrained output (the choice
of it) gives its very tokens and log-probabilities, greedy and sampled, and free rows beside
constrained ones decode as without them; ``--json-schema``, ``--json-object``, ``--regex`` and
``--choice`` work end to end on a tiny HF checkpoint, and bad ones are one-line errors naming
the flag."""

from __future__ import annotations

import importlib
import json
import re

import jax
import jsonschema
import numpy as np
import pytest
from helpers import (
    CHATML_SPECIALS,
    FAST_COMPILE,
    QWEN_ADDED,
    TINY,
    fast_everywhere,
    write_byte_tokenizer,
)

from transformer_jax.decode import constrained, generation
from transformer_jax.model.transformer import init_params
from transformer_jax.serving.grammar import Grammar, GrammarTokenizer
from transformer_jax.tokenizer import load_tokenizer

pytestmark = pytest.mark.usefixtures("fast_generate_compiles", "fast_constrained_compiles")

cli = importlib.import_module("transformer_jax.cli.generate")

CONFIG = TINY.replace(vocab_size=320, max_seq_len=256)
N = 96  # max_new_tokens: every grammar below completes well within it
SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 8},
            "zip": {"type": "string", "pattern": r"^[0-9]{5}$"}},
            "required": ["zip"], "additionalProperties": False}},
     "required": ["name", "address"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {
        "type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "properties": {
                "qty": {"type": "integer", "minimum": 1, "maximum": 20},
                "ok": {"type": "boolean"}},
            "required": ["qty", "ok"], "additionalProperties": False}}},
     "required": ["items"], "additionalProperties": False},
    {"anyOf": [{"type": "null"}, {"type": "array", "maxItems": 4,
                                  "items": {"enum": ["a", "b", 3, None]}}]},
]
REGEX = r"[a-c]{2,4}-[0-9]"
CHOICES = ("yes", "no", "maybe")


@pytest.fixture(scope="module")
def fast_constrained_compiles():
    """The constrained loop's programs compile with ``FAST_COMPILE`` for the module (as every
    program does when ``helpers.fast_everywhere()``)."""
    if fast_everywhere():
        yield
        return
    original = constrained.prefill_jit, constrained.decode_jit, constrained.pick_jit
    (constrained.prefill_jit, constrained.decode_jit,
     constrained.pick_jit) = constrained.jit_programs(compiler_options=FAST_COMPILE)
    yield
    constrained.prefill_jit, constrained.decode_jit, constrained.pick_jit = original


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    directory = write_byte_tokenizer(tmp_path_factory.mktemp("tok"))
    init = jax.jit(init_params, static_argnums=0, compiler_options=FAST_COMPILE)
    tok = load_tokenizer(directory)
    return init(CONFIG, jax.random.key(3)), tok, GrammarTokenizer(tok, CONFIG.vocab_size)


def _text(tok, tokens: list[int]) -> str:
    """The decoded reply, without the end-of-text token a grammar may close with."""
    return tok.decode(tokens[:-1] if tokens and tokens[-1] == tok.eos_id else tokens)


def test_rows_follow_their_grammars_and_end_when_they_complete(model):
    params, tok, grammars = model
    kinds = [*(Grammar("json_schema", s) for s in SCHEMAS), Grammar("regex", REGEX),
             Grammar("choice", CHOICES), None]
    prompts = [tok.encode(w) for w in ("hi", "a b", "yes", "no", "hello", "x y z")]
    seeds = [11, 12, 13, 14, 15, 16]
    got = generation.generate(
        CONFIG, params, prompts, max_new_tokens=N, temperature=1.0, seed=seeds,
        stop_tokens=[tok.eos_id],
        constraints=[None if g is None else grammars.matcher(g) for g in kinds])
    for b, grammar in enumerate(kinds[:-1]):
        tokens = got.tokens[b]
        assert 0 < len(tokens) < N, (grammar, tokens)
        assert np.all(got.token_array[b, len(tokens):] == 0)  # pad_id once it ended
        text = _text(tok, tokens)
        if grammar.kind == "json_schema":
            jsonschema.validate(json.loads(text), grammar.value)
        elif grammar.kind == "regex":
            assert re.fullmatch(REGEX, text), text
        else:
            assert text in CHOICES
        replay = grammars.matcher(grammar)  # every token allowed; complete at the last only
        assert all(replay.consume_token(t) and not replay.is_stopped() for t in tokens[:-1])
        assert replay.consume_token(tokens[-1]) and replay.is_stopped()
    free = generation.generate(CONFIG, params, prompts[-1:], max_new_tokens=N,
                               temperature=1.0, seed=seeds[-1:], stop_tokens=[tok.eos_id])
    assert got.tokens[-1] == free.tokens[0]
    np.testing.assert_allclose(got.logprobs[-1], free.logprobs[0], atol=1e-5)


WORDS = ("hi", "a b", "yes", "no", "hello", "x y z", "the", "name", "ok", "tags", "user",
         "world", "{", "[1,", "true", "id")
FREE = {"max_new_tokens": 16, "seed": list(range(1, 17))}


class AllowsTheFreeTokens:
    """A constraint that allows, at step j, the free decode's token j and a random half of the
    vocabulary, and is stopped after ``stop`` tokens."""

    def __init__(self, free: list[int], stop: int, seed: int):
        self.free, self.stop, self.step = free, stop, 0
        self.rng = np.random.default_rng(seed)

    def compute_bitmask(self) -> bytes:
        bits = self.rng.random(32 * -(-CONFIG.vocab_size // 32)) < 0.5
        bits[self.free[self.step]] = True
        return np.packbits(bits, bitorder="little").tobytes()

    def consume_token(self, token: int) -> bool:
        ok = token == self.free[self.step]  # anything else is a wrong draw, not a refusal
        self.step += 1
        return ok

    def is_stopped(self) -> bool:
        return self.step >= self.stop


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_mask_that_allows_the_free_tokens_gives_them_and_stops_the_row(model, temperature):
    """Masking only tokens the free draw does not take changes nothing: greedy's argmax and the
    sampled draw (the same keys, ``fold_in(key, i)``) are the free ones, with their
    log-probabilities, and each row ends the step its constraint stops."""
    params, tok, _ = model
    prompts = [tok.encode(w) for w in WORDS]
    free = generation.generate(CONFIG, params, prompts, temperature=temperature, **FREE)
    stops = [1 + b % 16 for b in range(len(prompts))]
    got = generation.generate(
        CONFIG, params, prompts, temperature=temperature, **FREE,
        constraints=[AllowsTheFreeTokens(t, k, b) for b, (t, k) in
                     enumerate(zip(free.tokens, stops, strict=True))])
    assert got.lengths == stops
    assert got.tokens == [t[:k] for t, k in zip(free.tokens, stops, strict=True)]
    for b, k in enumerate(stops):
        np.testing.assert_allclose(got.logprobs[b], free.logprobs[b][:k], atol=1e-5)


def _valid_prefix(tok, tokens: list[int]) -> int:
    """How many of ``tokens`` lead the row with plain tokens (no special, none past the
    tokenizer's vocabulary) that decode to whole characters: the most a grammar can spell (an
    untrained model's output soon has neither)."""
    best = 0
    for k in range(1, len(tokens) + 1):
        if tokens[k - 1] < len(CHATML_SPECIALS) or tokens[k - 1] >= tok.vocab_size:
            break
        if "\ufffd" not in tok.decode(tokens[:k]):
            best = k
    return best


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_regex_matching_any_text_keeps_the_free_tokens(model, temperature):
    """The same through a real grammar: under ``(?s:.*)`` (any text) each row draws its free
    tokens for as long as they spell valid text; rows left free decode as without constraints.
    (Not the choice of the free text: llguidance spells forced text in its canonical tokens.)"""
    params, tok, grammars = model
    prompts = [tok.encode(w) for w in WORDS]
    free = generation.generate(CONFIG, params, prompts, temperature=temperature, **FREE)
    valid = [_valid_prefix(tok, t) for t in free.tokens]
    assert sum(k >= 3 for k in valid) >= 3, valid  # rows with something to follow
    anything = Grammar("regex", r"(?s:.*)")
    got = generation.generate(
        CONFIG, params, prompts, temperature=temperature, **FREE,
        constraints=[grammars.matcher(anything) if b % 4 else None for b in range(len(WORDS))])
    for b, k in enumerate(valid):
        k = k if b % 4 else FREE["max_new_tokens"]
        assert got.tokens[b][:k] == free.tokens[b][:k]
        np.testing.assert_allclose(got.logprobs[b][:k], free.logprobs[b][:k], atol=1e-5)


def test_a_grammar_longer_than_max_new_tokens_ends_at_the_limit_and_streams(model):
    params, tok, grammars = model
    steps = []
    got = generation.generate(
        CONFIG, params, [tok.encode("hi"), tok.encode("no")], max_new_tokens=6,
        constraints=[grammars.matcher(Grammar("regex", "a{40}")), None],
        stream=lambda step, tokens, active: steps.append((step, tokens.copy(), active.copy())))
    assert got.lengths == [6, 6]
    assert set(tok.decode(got.tokens[0])) == {"a"}
    assert [s for s, _, _ in steps] == list(range(6))
    assert np.stack([t for _, t, _ in steps], 1).tolist() == got.token_array.tolist()


def test_bad_constraints_are_refused_before_any_work(model):
    params, tok, grammars = model
    used = grammars.matcher(Grammar("choice", ("yes",)))
    assert used.consume_token(tok.encode("yes")[0]) and used.is_stopped()
    for constraints, message in [
            ([None], r"one constraint \(or None\) per prompt: 1 for 2 prompts"),
            ([None, "yes"], r"constraints\[1\] must have compute_bitmask"),
            (grammars.matcher(Grammar("json_object")), "must be a list"),
            ([used, None], r"constraints\[0\] is already stopped")]:
        with pytest.raises(ValueError, match=message):
            generation.generate(CONFIG, params, [[5], [6]], max_new_tokens=4,
                                constraints=constraints)


# The CLI -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_dir(model, tmp_path_factory):
    from transformer_jax import hf

    params, _, _ = model
    path = tmp_path_factory.mktemp("hf")
    hf.save(CONFIG, jax.tree.map(np.asarray, params), path)
    write_byte_tokenizer(path, added=QWEN_ADDED)  # Qwen's <think> and <tool_call>
    return path


def _run(hf_dir, capsys, *flags: str) -> tuple[list[str], dict]:
    argv = ["--checkpoint", str(hf_dir), "--prompt", "hi", "--prompt-ids", "5,6,7",
            "--max-new-tokens", str(N), "--temperature", "1", "--seed", "3", "--json", *flags]
    assert cli.main(argv) == 0, capsys.readouterr().err
    out = json.loads(capsys.readouterr().out)
    tok = load_tokenizer(hf_dir)
    return [_text(tok, t) for t in out["tokens"]], out


def test_cli_json_schema_from_a_file_and_inline(hf_dir, tmp_path, capsys):
    schema = SCHEMAS[1]
    file = tmp_path / "schema.json"
    file.write_text(json.dumps(schema))
    for value in (str(file), json.dumps(schema)):
        texts, out = _run(hf_dir, capsys, "--json-schema", value)
        assert all(n < N for n in out["lengths"]), out["lengths"]
        for text in texts:
            jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("flags, check", [
    (["--regex", REGEX], lambda text: re.fullmatch(REGEX, text)),
    (["--choice", ",".join(CHOICES)], lambda text: text in CHOICES),
])
def test_cli_regex_and_choice(hf_dir, capsys, flags, check):
    texts, out = _run(hf_dir, capsys, *flags)
    assert all(n < N for n in out["lengths"]), out["lengths"]
    assert all(check(text) for text in texts), texts


def test_cli_choice_that_spells_added_tokens(hf_dir, capsys):
    """``--choice "<think>"``: the text of an added token is written (as ordinary tokens), not
    a traceback over the added token the grammar's mask let through."""
    for choice in ("<think>", "<tool_call>"):  # an added special token and one not special
        texts, out = _run(hf_dir, capsys, "--choice", choice)
        assert all(n < N for n in out["lengths"]), out["lengths"]
        assert texts == [choice, choice], texts


def test_cli_json_object(hf_dir, capsys):
    texts, out = _run(hf_dir, capsys, "--json-object")
    for text, n in zip(texts, out["lengths"], strict=True):
        if n < N:  # ended: the object is complete
            assert isinstance(json.loads(text), dict), text
        else:  # an untrained model may keep an object open past the budget
            assert text.startswith("{"), text
    assert any(n < N for n in out["lengths"]), out["lengths"]


@pytest.mark.parametrize("flags, message", [
    (["--json-schema", "{not json"], "error: --json-schema: not JSON: "),
    (["--json-schema", "/no/such/schema.json"],
     "error: --json-schema: neither a JSON object nor a readable file"),
    (["--json-schema", '{"type": "nonsense"}'], "error: --json-schema: Invalid type"),
    (["--regex", "(unclosed"], "error: --regex: "),
    (["--choice", "a,,b"], "error: --choice: choice must be a non-empty list"),
    (["--regex", "a", "--choice", "a"], "argument --choice: not allowed with argument --regex"),
    (["--regex", "a", "--tensor", "2"], "error: --regex: structured outputs decode on one"),
])
def test_cli_bad_structured_flags_are_one_line_errors(hf_dir, capsys, flags, message):
    argv = ["--checkpoint", str(hf_dir), "--prompt-ids", "5", *flags]
    try:
        code = cli.main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error: " in line]
    assert code == 2 and "Traceback" not in err and len(lines) == 1, err
    assert message in lines[0], lines[0]


def test_cli_structured_flags_need_an_hf_tokenizer(hf_dir, tmp_path, capsys):
    from transformer_jax.tokenizer import Tokenizer

    spm = Tokenizer.train(["the quick brown fox " * 20], tmp_path / "tok.model", vocab_size=30,
                          model_type="char")
    argv = ["--checkpoint", str(hf_dir), "--tokenizer", str(spm.path), "--prompt-ids", "5",
            "--regex", "a+"]
    assert cli.main(argv) == 1
    assert "--regex: structured outputs need the checkpoint's HF tokenizer" in (
        capsys.readouterr().err)
