"""Structured outputs in the engine (``serving.grammar``): every reply of an untrained model under
a JSON schema parses and validates (objects, nested objects, arrays, enums, bounded numbers,
strings, booleans, null, required and optional keys), regexes and choices match, every drawn
token is one the grammar allowed, a completed grammar ends the request (a refused token with
``"error"``), the alternatives of ``top_logprobs`` are the unmasked softmax's, rows without a
grammar decode as ``generate`` in the same steps, and bad grammars are refused naming their
kind."""

from __future__ import annotations

import json
import re

import jax
import jsonschema
import numpy as np
import pytest
from helpers import (
    FAST_COMPILE,
    QWEN_ADDED,
    TINY,
    Served,
    check_top_logprobs,
    run_until_idle,
    write_byte_tokenizer,
)

from transformer_jax.decode import generation
from transformer_jax.model.transformer import Transformer, init_params
from transformer_jax.serving import Engine, SamplingParams
from transformer_jax.serving.grammar import Grammar, GrammarTokenizer
from transformer_jax.tokenizer import load_tokenizer

pytestmark = pytest.mark.usefixtures("fast_generate_compiles", "fast_engine_compiles")

CONFIG = TINY.replace(vocab_size=320, max_seq_len=256)
SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
     "required": ["a"], "additionalProperties": False},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                      "ok": {"type": "boolean"}},
     "required": ["name", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"enum": ["cat", "dog", "eel"]},
                                      "n": {"type": "null"}},
     "required": ["kind"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "maxItems": 3,
                                               "items": {"type": "integer", "minimum": -5,
                                                         "maximum": 5}}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"inner": {
        "type": "object", "properties": {"x": {"type": "boolean"}, "y": {"enum": [1, 2]}},
        "required": ["x", "y"], "additionalProperties": False}},
     "required": ["inner"], "additionalProperties": False},
    {"type": "array", "minItems": 1, "maxItems": 2, "items": {"enum": ["yes", "no"]}},
]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    tok = load_tokenizer(write_byte_tokenizer(tmp_path_factory.mktemp("tok"), added=QWEN_ADDED))
    init = jax.jit(init_params, static_argnums=0, compiler_options=FAST_COMPILE)
    return init(CONFIG, jax.random.key(3)), tok


@pytest.fixture(scope="module")
def engine(model):
    params, tok = model
    return Engine(CONFIG, params, num_slots=4, num_pages=64, page_size=8, token_budget=24,
                  tokenizer=tok)


def _ask(grammar, **kw):
    return SamplingParams(max_tokens=160, grammar=grammar, **kw)


def test_every_schema_reply_parses_and_validates_beside_unconstrained_rows(model, engine):
    params, tok = model
    prompt = tok.encode("hello")
    asks = [(schema, _ask(Grammar("json_schema", schema), temperature=t, seed=s))
            for schema in SCHEMAS for t, s in ((0.0, 0), (1.0, 7))]
    free = [[5, 9, 2], [7, 7, 1, 4]]
    forked = engine.scheduler.forked
    ids = [engine.add_request(prompt, p) for _, p in asks]
    free_ids = [engine.add_request(p, SamplingParams(max_tokens=8)) for p in free]
    done = run_until_idle(engine, max_steps=3000)
    engine.check_no_leaks()
    assert engine.scheduler.forked > forked  # one prompt: forks draw their first token too
    checker = GrammarTokenizer(tok, CONFIG.vocab_size)
    for (schema, ask), i in zip(asks, ids, strict=True):
        got = done[i]
        assert got.finish_reason == "stop", (schema, got)
        text = tok.decode(got.tokens)
        jsonschema.validate(json.loads(text), schema)
        matcher = checker.matcher(ask.grammar)  # every drawn token was allowed, in order
        assert all(matcher.consume_token(t) for t in got.tokens) and matcher.is_stopped()
    want = generation.generate(CONFIG, params, free, max_new_tokens=8)
    assert [done[i].tokens for i in free_ids] == want.tokens


def test_regex_and_choice_replies_match_and_json_object_parses(model, engine):
    _, tok = model
    prompt = tok.encode("hello")
    asks = {"regex": _ask(Grammar("regex", r"[a-c]{2,4}-[0-9]"), temperature=1.0, seed=2),
            "choice": _ask(Grammar("choice", ("yes", "no", "maybe")), temperature=1.0, seed=5),
            "json_object": _ask(Grammar("json_object"), temperature=0.0)}
    ids = {k: engine.add_request(prompt, p) for k, p in asks.items()}
    done = run_until_idle(engine, max_steps=3000)
    engine.check_no_leaks()
    assert re.fullmatch(r"[a-c]{2,4}-[0-9]", tok.decode(done[ids["regex"]].tokens))
    assert tok.decode(done[ids["choice"]].tokens) in ("yes", "no", "maybe")
    got = done[ids["json_object"]]
    if got.finish_reason == "stop":  # an untrained model may not close an open object
        assert isinstance(json.loads(tok.decode(got.tokens)), dict)
    else:
        assert tok.decode(got.tokens).startswith("{")


def test_top_logprobs_under_a_grammar_are_the_unmasked_softmax_top_k(model, engine):
    """A grammar row's alternatives are the K most likely tokens of the forward's softmax
    (tokens the grammar forbids among them), not of the masked logits; the drawn token's
    log-probability is the raw softmax's too."""
    params, tok = model
    prompt = tok.encode("hello")
    k = 5
    asks = [_ask(Grammar("regex", r"[a-c]{2,4}-[0-9]"), logprobs=True, top_logprobs=k),
            _ask(Grammar("choice", ("<think>", "no")), temperature=1.0, seed=4, logprobs=True,
                 top_logprobs=2)]
    ids = [engine.add_request(prompt, ask) for ask in asks]
    done = run_until_idle(engine)
    engine.check_no_leaks()
    forward = jax.jit(lambda p, t: Transformer(CONFIG).apply({"params": p}, t).logits)
    forbidden = 0
    for i, ask in zip(ids, asks, strict=True):
        got = done[i]
        assert got.finish_reason == "stop", got
        seq = prompt + got.tokens
        logp = np.asarray(jax.nn.log_softmax(forward(params, np.asarray(
            [seq[:-1]], np.int32))[0], axis=-1))[len(prompt) - 1:]
        tops = check_top_logprobs(got, logp, ask.top_logprobs)
        # the grammar kept the draw off the likeliest
        forbidden += sum(token not in top for token, top in zip(got.tokens, tops, strict=True))
    assert forbidden > 0  # the masked and unmasked top K differ somewhere


def test_a_grammar_that_refuses_its_own_token_ends_the_request_with_an_error(model, engine,
                                                                            monkeypatch):
    """A matcher that refuses a token drawn from its own mask (llguidance then reports
    itself stopped) is the engine's fault: the request ends with ``"error"``, not ``"stop"``
    as if its grammar were complete."""

    class Refusing:
        def __init__(self, matcher):
            self.matcher, self.refused = matcher, False

        def compute_bitmask(self):
            return self.matcher.compute_bitmask()

        def consume_token(self, token):
            self.refused = True
            return False

        def is_stopped(self):
            return self.refused

        def is_error(self):
            return self.refused

        def get_error(self):
            return "refused"

    grammars = engine._grammar_tokenizer()
    monkeypatch.setattr(grammars, "matcher", lambda g, made=grammars.matcher: Refusing(made(g)))
    _, tok = model
    rid = engine.add_request(tok.encode("hello"), _ask(Grammar("choice", ("yes", "no"))))
    got = run_until_idle(engine)[rid]
    assert (got.finish_reason, len(got.tokens)) == ("error", 1)
    engine.check_no_leaks()


@pytest.mark.parametrize("grammar, message", [
    (Grammar("json_schema", {"type": "nonsense"}), "json_schema: .*nonsense"),
    (Grammar("json_schema", "[1, 2]"), "json_schema must be a JSON object"),
    (Grammar("regex", "(unclosed"), "regex: "),
    (Grammar("choice", ()), "choice must be a non-empty list"),
    (Grammar("lark"), "lark must be a non-empty grammar text"),
    (Grammar("lark", 'start: "a" undefined_rule'), "lark: "),
    (Grammar("ebnf"), "grammar kind must be one of"),
])
def test_bad_grammars_are_refused_naming_their_kind(engine, grammar, message):
    with pytest.raises(ValueError, match=message):
        engine.add_request([1, 2], _ask(grammar))
    assert engine.idle


def test_a_grammar_needs_the_engines_hf_tokenizer(model):
    params, _ = model
    bare = Engine(CONFIG, params, num_slots=1, num_pages=32, page_size=8, token_budget=8)
    with pytest.raises(ValueError, match="needs the engine's tokenizer"):
        bare.add_request([1, 2], _ask(Grammar("json_object")))


# Through the server, with the real openai client ---------------------------------------------

@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    import numpy as np

    from transformer_jax import hf
    from transformer_jax.cli import serve as cli
    from transformer_jax.serve.app import create_app

    params, _ = model
    path = tmp_path_factory.mktemp("ckpt") / "tiny-json"
    hf.save(CONFIG, jax.tree.map(np.asarray, params), path)
    write_byte_tokenizer(path)
    args = cli.build_parser().parse_args(["--checkpoint", str(path), "--slots", "4",
                                          "--page-size", "8", "--token-budget", "24",
                                          "--compilation-cache", ""])
    runner, info, _ = cli.build(args)
    runner.start()
    runner.ready = True
    served = Served(create_app(runner, info))
    yield served, runner
    served.close()
    runner.stop()


def test_response_format_replies_parse_and_validate_through_the_openai_client(server):
    import openai

    served, runner = server
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "hello"}]
    for i, schema in enumerate(SCHEMAS):
        reply = client.chat.completions.create(
            model="tiny-json", messages=messages, max_completion_tokens=160, seed=i,
            response_format={"type": "json_schema",
                             "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}})
        jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    streamed = client.completions.create(model="tiny-json", prompt="hello", max_tokens=40,
                                         stream=True, seed=1,
                                         extra_body={"guided_choice": ["red", "green"]})
    assert "".join(c.choices[0].text for c in streamed if c.choices) in ("red", "green")
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model="tiny-json", messages=messages,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})
    assert bad.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny-json", prompt="hi",
                                  extra_body={"guided_regex": "(", "guided_choice": ["a"]})
    assert bad.value.body["param"] in ("guided_regex", "guided_choice")
    runner.engine.check_no_leaks()
