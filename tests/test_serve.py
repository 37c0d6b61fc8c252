"""The OpenAI-compatible server, driven by the real ``openai`` client and raw httpx against a
server started on a free loopback port (in this process, uvicorn on a thread) over a tiny random
HF checkpoint with a ChatML word tokenizer: completions and chat, streamed and not, equal to
``generate``; stop strings; every bad input gets its status and error object and the server goes
on (a lone surrogate too); auth, whole keys only; a full queue; timeouts; usage equal to the
tokens returned; a long prompt tokenised off the event loop; an oversized body refused unread;
disconnects and 64 concurrent streams leave no page behind; SIGTERM drains the CLI's server
(``cli.serve.main`` in this process's main thread, where uvicorn takes the signal) and it
returns 0, and past the grace period the streams end with "abort" and [DONE] and the queued
requests get 503. (The server's faults that need no model: ``test_faults_serve.py``.)"""

import asyncio
import functools
import json
import logging
import os
import signal
import socket
import threading
import time

import httpx
import jax
import numpy as np
import openai
import pytest
import uvicorn
from helpers import FAST_COMPILE, TINY, Served, free_socket, write_chatml_tokenizer

from transformer_jax import hf
from transformer_jax.cli import serve as cli
from transformer_jax.decode import generation
from transformer_jax.model.transformer import Transformer, init_params
from transformer_jax.serve import app as serve_app
from transformer_jax.serve.app import create_app
from transformer_jax.tokenizer.prompt import encode_chat_prompt, encode_text

pytestmark = pytest.mark.usefixtures("fast_generate_compiles", "fast_engine_compiles")

NAME = "tiny"
WORDS = [f"w{i}" for i in range(TINY.vocab_size - 5)]  # the tokenizer fills the vocabulary
ENGINE_ARGS = ["--slots", "8", "--page-size", "16", "--token-budget", "24",
               "--compilation-cache", ""]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # Random weights of the model's shapes, drawn by numpy (compiling init costs seconds).
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda x: rng.normal(0, 0.2, x.shape).astype(x.dtype),
                          jax.eval_shape(lambda key: init_params(TINY, key), jax.random.key(0)))
    path = tmp_path_factory.mktemp("ckpt") / NAME
    hf.save(TINY, params, path)
    write_chatml_tokenizer(path, WORDS)
    return path, params


@pytest.fixture(scope="module")
def served(checkpoint):
    args = cli.build_parser().parse_args(["--checkpoint", str(checkpoint[0]), *ENGINE_ARGS])
    runner, model, _ = cli.build(args)
    runner.start()
    runner.ready = True
    open_server = Served(create_app(runner, model))
    keyed = Served(create_app(runner, model, api_key="sekrit"))
    yield open_server, keyed, runner, model
    open_server.close()
    keyed.close()
    runner.stop()


@pytest.fixture
def server(served):
    """The open server; after the test no request is in flight and every page is back."""
    yield served[0]
    runner = served[2]
    _wait_idle(runner)
    runner.engine.check_no_leaks()


def _wait_idle(runner, timeout=10.0):
    end = time.monotonic() + timeout
    while runner.in_flight or not runner.engine.idle:
        assert time.monotonic() < end, f"{runner.in_flight} requests still in flight"
        time.sleep(0.01)
    assert runner.engine.pages_in_use == 0 and runner.engine.num_running == 0


def _client(server, key="none"):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


#: ``_expected``'s batches: the prompt beside a filler row this long (every prompt here is
#: shorter: one prompt bucket) and N_EXPECTED new tokens, cut to the request's: the module's
#: references run one program per sampling setting and stop list (a row's greedy or seeded
#: tokens do not depend on the rows beside it, nor on N).
FILLER, N_EXPECTED = [5] * 30, 12


def _expected(checkpoint, model, prompt, max_tokens, stops, seed=(0,), **sampling):
    """``generate`` on the prompt (greedy unless ``sampling`` says otherwise), and the text
    its tokens add to the prompt."""
    tok = model.tokenizer
    assert len(prompt) <= len(FILLER) and max_tokens <= N_EXPECTED
    out = generation.generate(TINY, checkpoint[1], [prompt, FILLER], max_new_tokens=N_EXPECTED,
                              stop_tokens=stops, seed=[*seed, 0], **sampling)
    tokens, logprobs = out.tokens[0][:max_tokens], out.logprobs[0][:max_tokens]
    body = tokens[:-1] if tokens and tokens[-1] in stops else tokens
    text = tok.decode(prompt + body)[len(tok.decode(prompt)):]
    return tokens, logprobs, text


# Completions and chat ----------------------------------------------------------------------------

def test_completion_greedy_equals_generate(server, served, checkpoint):
    model = served[3]
    prompt = "w3 w1 w4 w1 w5 w9 w2 w6 w5"  # 10 ids with bos: the chat test's bucket
    # Stops at eos and at the id asked for (the chat test's stops: the same generate program).
    out = _client(server).completions.create(model=NAME, prompt=prompt, max_tokens=12,
                                             temperature=0, logprobs=1,
                                             extra_body={"stop_token_ids": [model.turn_end]})
    ids = encode_text(model.tokenizer, prompt)
    stops = [model.tokenizer.eos_id, model.turn_end]
    tokens, logprobs, text = _expected(checkpoint, model, ids, 12, stops)
    choice = out.choices[0]
    assert choice.text == text
    assert choice.finish_reason == ("stop" if len(tokens) < 12 else "length")
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == len(tokens)
    np.testing.assert_allclose(choice.logprobs.token_logprobs, logprobs, atol=1e-4)
    # The same prompt as token ids, through raw HTTP.
    raw = httpx.post(server.url + "/v1/completions", json={
        "model": NAME, "prompt": ids, "max_tokens": 12, "temperature": 0,
        "stop_token_ids": [model.turn_end]}).json()
    assert raw["choices"][0]["text"] == text


def test_seeded_sampling_equals_generate_with_that_seed(server, served, checkpoint):
    model = served[3]
    prompt = "w5 w6 w7"
    out = _client(server).completions.create(model=NAME, prompt=prompt, max_tokens=8,
                                             temperature=0.8, seed=5, extra_body={"top_k": 10})
    ids = encode_text(model.tokenizer, prompt)
    _, _, text = _expected(checkpoint, model, ids, 8, [model.tokenizer.eos_id],
                           temperature=0.8, top_k=10, seed=[5])
    assert out.choices[0].text == text


def test_chat_streamed_equals_non_streamed_equals_generate(server, served, checkpoint):
    model, client = served[3], _client(server)
    messages = [{"role": "system", "content": "w7 w8"}, {"role": "user", "content": "w9 w2"}]
    whole = client.chat.completions.create(model=NAME, messages=messages, temperature=0,
                                           max_completion_tokens=12)
    chunks = list(client.chat.completions.create(
        model=NAME, messages=messages, temperature=0, max_completion_tokens=12, stream=True,
        stream_options={"include_usage": True}))
    ids = encode_chat_prompt(model.tokenizer, messages)
    stops = [model.tokenizer.eos_id, model.turn_end]
    tokens, _, text = _expected(checkpoint, model, ids, 12, stops)
    assert whole.choices[0].message.content == text
    assert whole.choices[0].message.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(tokens)


@functools.partial(jax.jit, compiler_options=FAST_COMPILE)
def _forward_logp(params, ids):
    return jax.nn.log_softmax(Transformer(TINY).apply({"params": params}, ids).logits, -1)


def _log_softmax(checkpoint, ids) -> np.ndarray:
    """The forward's log_softmax [T, V] at each position of ``ids``: one program for every
    call (the ids padded to max_seq_len after the sequence, unseen by its causal logits)."""
    padded = np.zeros((1, TINY.max_seq_len), np.int32)
    padded[0, :len(ids)] = ids
    return np.asarray(_forward_logp(checkpoint[1], padded))[0, :len(ids)]


def _softmax_top(checkpoint, ids, k):
    """The forward's log_softmax at each position of ``ids``: per position its k most likely
    (id, log-probability) pairs."""
    logp = _log_softmax(checkpoint, ids)
    return [[(int(i), float(row[i])) for i in np.argsort(-row, kind="stable")[:k]]
            for row in logp]


def test_top_logprobs_are_the_softmax_top_k_streamed_or_not(server, served, checkpoint):
    model, client = served[3], _client(server)
    tok = model.tokenizer
    messages = [{"role": "user", "content": "w3 w1 w4"}]
    kw = dict(model=NAME, messages=messages, temperature=0, max_completion_tokens=6,
              logprobs=True, top_logprobs=3)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    content = whole.choices[0].logprobs.content
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    prompt = encode_chat_prompt(tok, messages)
    tokens, _, _ = _expected(checkpoint, model, prompt, 6, [tok.eos_id, model.turn_end])
    want = _softmax_top(checkpoint, prompt + tokens[:-1], 3)[len(prompt) - 1:]
    assert len(content) == len(tokens)
    for entry, top in zip(content, want, strict=True):
        assert [a.token for a in entry.top_logprobs] == [tok.decode([i]) for i, _ in top]
        np.testing.assert_allclose([a.logprob for a in entry.top_logprobs],
                                   [lp for _, lp in top], atol=1e-5)
        assert entry.token == entry.top_logprobs[0].token  # greedy
        assert entry.top_logprobs[0].bytes == list(entry.token.encode())
    # Completions: ``logprobs: k`` gives a {token: logprob} dict per token, likeliest first.
    done = client.completions.create(model=NAME, prompt=[5, 9, 2], max_tokens=4,
                                     temperature=0, logprobs=2)
    lp = done.choices[0].logprobs
    assert len(lp.top_logprobs) == len(lp.tokens) and all(len(d) <= 2 for d in lp.top_logprobs)
    for d, token in zip(lp.top_logprobs, lp.tokens, strict=True):
        assert list(d)[0] == token and list(d.values()) == sorted(d.values(), reverse=True)


def test_completions_logprobs_0_is_each_tokens_logprob_without_alternatives(server, served,
                                                                           checkpoint):
    """OpenAI's ``logprobs: 0`` turns log-probabilities on, with no alternatives: each token's
    log-probability under the forward's softmax (greedy: its top token)."""
    ids = [5, 9, 2]
    done = _client(server).completions.create(model=NAME, prompt=ids, max_tokens=4,
                                              temperature=0, logprobs=0)
    lp = done.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None, done.choices[0]
    assert len(lp.token_logprobs) == len(lp.tokens) == done.usage.completion_tokens >= 1
    assert not any(lp.top_logprobs or ())
    tok = served[3].tokenizer
    tokens = [tok.token_to_id(piece.strip()) for piece in lp.tokens]
    logp = _log_softmax(checkpoint, ids + tokens[:-1])[len(ids) - 1:]
    assert logp.argmax(-1).tolist() == tokens  # greedy
    np.testing.assert_allclose(lp.token_logprobs, logp[np.arange(len(tokens)), tokens],
                               atol=1e-4)


def test_n_choices_are_the_request_sent_with_seeds_seed_plus_i(server, served):
    client = _client(server)
    kw = dict(model=NAME, prompt="w4 w2 w9", max_tokens=6, temperature=1.0)
    many = client.completions.create(**kw, n=3, seed=7)
    alone = [client.completions.create(**kw, seed=7 + i) for i in range(3)]
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert [c.text for c in many.choices] == [a.choices[0].text for a in alone]
    assert len({c.text for c in many.choices}) > 1  # the seeds differ, so do the samples
    assert many.usage.prompt_tokens == alone[0].usage.prompt_tokens  # counted once
    assert many.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    # Streamed: each chunk names its choice; each choice's text is the non-streamed one's.
    messages = [{"role": "user", "content": "w5 w6"}]
    chat = dict(model=NAME, messages=messages, max_completion_tokens=5, n=2, seed=3)
    whole = client.chat.completions.create(**chat)
    chunks = list(client.chat.completions.create(**chat, stream=True,
                                                 stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_n_choices_share_the_prompts_prefill(server, served):
    # The prompt is computed once: the other choices fork from its last chunk (they share its
    # full pages, copy its partial page and draw from its logits), each with its own seed.
    scheduler = served[2].engine.scheduler
    forked = scheduler.forked
    prompt = np.random.default_rng(4).integers(0, TINY.vocab_size - 1, 40).tolist()
    many = _client(server).completions.create(model=NAME, prompt=prompt, max_tokens=3, n=4,
                                              temperature=0.7, seed=1)
    assert scheduler.forked - forked == 3
    assert len({c.text for c in many.choices}) > 1


def test_stop_strings_cut_before_the_stop(server):
    client = _client(server)
    free = client.completions.create(model=NAME, prompt="w11 w12", max_tokens=12,
                                     temperature=0, extra_body={"ignore_eos": True})
    text = free.choices[0].text
    stop = text.split(" ")[3]  # the third word (the text starts with a space)
    want = text[:text.index(stop)]
    for stream in (False, True):
        out = client.completions.create(model=NAME, prompt="w11 w12", max_tokens=12,
                                        temperature=0, stop=[stop, "zz"], stream=stream,
                                        extra_body={"ignore_eos": True})
        if stream:
            chunks = list(out)
            got = "".join(c.choices[0].text for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            got, reason = out.choices[0].text, out.choices[0].finish_reason
        assert (got, reason) == (want, "stop")


def test_models_health_metrics(server):
    models = _client(server).models.list()
    assert [m.id for m in models.data] == [NAME]
    assert httpx.get(server.url + "/health").json() == {"status": "ready"}
    text = httpx.get(server.url + "/metrics").text
    for name in ("requests_running", "requests_waiting", "kv_pages_used",
                 "prefix_cache_hit_rate", "time_to_first_token_seconds_bucket",
                 "time_per_output_token_seconds_bucket", "prompt_tokens_total"):
        assert f"transformer_jax_{name}" in text
    generated = [line for line in text.splitlines()
                 if line.startswith("transformer_jax_generation_tokens_total")]
    assert float(generated[0].split()[-1]) > 0
    device = [line for line in text.splitlines()  # the engine's steps, timed by phase
              if line.startswith('transformer_jax_engine_step_seconds{phase="device"}')]
    assert float(device[0].split()[-1]) > 0
    assert "transformer_jax_engine_step_host_share" in text


# Faults ------------------------------------------------------------------------------------------

BAD = [  # (route, body, param, code)
    ("completions", b"{not json", None, "invalid_json"),
    ("completions", b"[1, 2]", None, None),
    ("completions", {"model": NAME, "prompt": "w1", "temperature": "hot"}, "temperature", None),
    ("completions", {"model": NAME, "prompt": "w1", "max_tokens": True}, "max_tokens", None),
    ("completions", {"model": NAME, "prompt": "w1", "top_p": 1.5}, "top_p", None),
    ("completions", {"model": NAME, "prompt": "w1", "temperature": -1}, "temperature", None),
    ("completions", {"model": NAME, "prompt": "w1", "top_k": 1000}, "top_k", None),
    ("completions", {"model": NAME, "prompt": "w1", "seed": -3}, "seed", None),
    ("completions", {"model": NAME, "prompt": "w1", "n": 17}, "n", None),
    ("completions", {"model": NAME, "prompt": [1, 999]}, "prompt", None),
    ("completions", {"model": NAME, "prompt": "w1", "max_tokens": 64}, "max_tokens",
     "context_length_exceeded"),
    ("completions", {"model": NAME, "prompt": " ".join(["w1"] * 70)}, "prompt",
     "context_length_exceeded"),
    ("completions", {"model": NAME}, "prompt", None),
    ("chat/completions", {"model": NAME, "messages": []}, "messages", None),
    ("chat/completions", {"model": NAME, "messages": [{"role": "bot", "content": "w1"}]},
     "messages.0.role", None),
    ("chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "w1"}],
                          "max_completion_tokens": 100}, "max_completion_tokens",
     "context_length_exceeded"),
    ("chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "w1"}],
                          "stop": [""]}, "stop", None),
    ("chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "w1"}],
                          "logprobs": True, "top_logprobs": 21}, "top_logprobs", None),
    ("chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "w1"}],
                          "top_logprobs": 2}, "top_logprobs", None),
    ("completions", {"model": NAME, "prompt": "w1", "logprobs": 6}, "logprobs", None),
]


def test_bad_inputs_get_400_naming_the_field_and_the_server_goes_on(server):
    with httpx.Client(base_url=server.url + "/v1") as http:
        for route, body, param, code in BAD:
            r = (http.post(f"/{route}", content=body) if isinstance(body, bytes)
                 else http.post(f"/{route}", json=body))
            assert r.status_code == 400, (body, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert (err["param"], err["code"], err["type"]) == (
                param, code, "invalid_request_error"), (body, err)
            assert err["message"]
        r = http.post("/completions", json={"model": "gpt-4", "prompt": "w1"})
        assert r.status_code == 404, r.text  # OpenAI's answer for a model that does not exist
        assert (r.json()["error"]["param"], r.json()["error"]["code"]) == ("model",
                                                                           "model_not_found")
        r = http.post("/completions", json={"model": NAME, "prompt": "w1", "max_tokens": 2,
                                            "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    with pytest.raises(openai.BadRequestError, match="top_p"):
        _client(server).completions.create(model=NAME, prompt="w1", top_p=0)


def test_auth(served):
    keyed = served[1]
    for key, status in (("wrong", 401), ("sekrit", 200)):
        r = httpx.get(keyed.url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == status
    r = httpx.post(keyed.url + "/v1/completions", json={"model": NAME, "prompt": "w1"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(keyed.url + "/health").status_code == 200  # not under /v1
    with pytest.raises(openai.AuthenticationError):
        _client(keyed, "wrong").models.list()
    out = _client(keyed, "sekrit").completions.create(model=NAME, prompt="w1", max_tokens=2,
                                                      temperature=0)
    assert out.usage.completion_tokens >= 1


def test_a_key_that_starts_or_extends_the_real_one_is_refused(served):
    with httpx.Client(base_url=served[1].url) as http:
        for header in ("Bearer sekri", "Bearer sekrit2", "Bearer sekritsekrit", "Bearer s",
                       "sekrit", "Bearer  sekrit", "Basic sekrit", "Bearer sekrit x"):
            r = http.get("/v1/models", headers={"Authorization": header})
            assert r.status_code == 401, header
            assert r.json()["error"]["code"] == "invalid_api_key"
        r = http.get("/v1/models", headers={"Authorization": "Bearer sekrit"})
        assert r.status_code == 200


def test_full_queue_gets_429_with_retry_after(server, served):
    runner = served[2]
    runner.max_requests, before = 0, runner.max_requests
    try:
        r = httpx.post(server.url + "/v1/completions", json={"model": NAME, "prompt": "w1"})
    finally:
        runner.max_requests = before
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "rate_limit_exceeded"


def test_request_timeout_ends_the_request(server, served):
    runner = served[2]
    runner.request_timeout, before = 1e-3, runner.request_timeout
    try:
        out = _client(server).completions.create(model=NAME, prompt="w1", max_tokens=40,
                                                 temperature=0, extra_body={"ignore_eos": True})
    finally:
        runner.request_timeout = before
    assert out.choices[0].finish_reason == "timeout"
    assert out.usage.completion_tokens < 40


def test_a_failing_step_ends_its_requests_and_the_server_goes_on(server, served, monkeypatch):
    engine = served[2].engine
    real = engine.step

    def fail_once():
        monkeypatch.setattr(engine, "step", real)
        raise RuntimeError("injected")

    monkeypatch.setattr(engine, "step", fail_once)
    body = {"model": NAME, "prompt": "w1", "max_tokens": 5, "temperature": 0}
    r = httpx.post(server.url + "/v1/completions", json=body)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert httpx.post(server.url + "/v1/completions", json=body).status_code == 200


def test_usage_counts_the_tokens_returned(server, served):
    """For length, stop (a stop token) and timeout: completion_tokens is the number of
    tokens returned (logprobs lists them) and total = prompt + completion."""
    runner, client = served[2], _client(server)
    body = {"model": NAME, "prompt": "w11 w12", "max_tokens": 10, "temperature": 0,
            "logprobs": 1, "extra_body": {"ignore_eos": True}}
    free = client.completions.create(**body)
    third = encode_text(served[3].tokenizer, free.choices[0].text.split()[2])[-1]
    stopped = client.completions.create(**{**body, "extra_body": {
        "ignore_eos": True, "stop_token_ids": [third]}})
    runner.request_timeout, before = 1e-3, runner.request_timeout
    try:
        timed_out = client.completions.create(**{**body, "max_tokens": 40})
    finally:
        runner.request_timeout = before
    for out, reason in ((free, "length"), (stopped, "stop"), (timed_out, "timeout")):
        choice, usage = out.choices[0], out.usage
        assert choice.finish_reason == reason
        assert usage.completion_tokens == len(choice.logprobs.tokens), reason
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens == (
            3 + usage.completion_tokens)
    assert free.usage.completion_tokens == 10
    assert 0 < stopped.usage.completion_tokens <= 3


def test_a_lone_surrogate_is_a_400_naming_the_field(server):
    """JSON escapes \\udc00 decode to a lone surrogate, which no text encoding takes: a 400
    naming the field (not a 500 and a reset connection), and the connection goes on."""
    chat = {"model": NAME, "messages": [{"role": "user", "content": "w1"}]}
    cases = [  # (route, body with a "@" where the escape goes, param)
        ("completions", {"model": NAME, "prompt": "a@b"}, "prompt"),
        ("completions", {"model": NAME, "prompt": ["a@b"]}, "prompt.0"),
        ("chat/completions", {**chat, "messages": [{"role": "user", "content": "w1 @"}]},
         "messages.0.content"),
        ("chat/completions", {**chat, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "@"}]}]},
         "messages.0.content.0.text"),
        ("chat/completions", {**chat, "stop": ["x", "@"]}, "stop.1"),
        ("completions", {"model": "@", "prompt": "w1"}, "model"),
    ]
    with httpx.Client(base_url=server.url + "/v1", timeout=10) as http:
        for escape in ("\\udc00", "\\uD800", "\\ude00\\ud83d"):  # low, high, a pair reversed
            for route, body, param in cases:
                raw = json.dumps(body).replace("@", escape).encode()
                r = http.post(f"/{route}", content=raw,
                              headers={"Content-Type": "application/json"})
                assert r.status_code == 400, (raw, r.text)
                err = r.json()["error"]
                assert err["param"] == param and "not valid Unicode" in err["message"], err
                assert r.headers.get("connection") != "close"
        # A pair is one character: accepted (the word tokenizer has no emoji: it is <unk>).
        raw = json.dumps({"model": NAME, "prompt": "w1 @", "max_tokens": 2,
                          "temperature": 0}).replace("@", "\\ud83d\\ude00").encode()
        r = http.post("/completions", content=raw)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 3


def test_tokenising_runs_off_the_event_loop(server, monkeypatch):
    """While a long prompt is being tokenised, /health answers: the tokeniser runs on a
    worker thread, and lets go of the GIL (HF ``encode`` holds it for the whole text)."""
    from transformer_jax.serve import completions

    entered, times = threading.Event(), {}
    real = completions.encode_text

    def timed_encode(*args, **kwargs):
        entered.set()
        try:
            return real(*args, **kwargs)
        finally:
            times["encoded"] = time.monotonic()

    monkeypatch.setattr(completions, "encode_text", timed_encode)
    prompt = " ".join(WORDS[i % 50] for i in range(200_000))  # 0.5 s or more to encode
    got = {}

    def post():
        got["r"] = httpx.post(server.url + "/v1/completions", timeout=60,
                              json={"model": NAME, "prompt": prompt})

    thread = threading.Thread(target=post)
    thread.start()
    try:
        assert entered.wait(30)
        health = httpx.get(server.url + "/health", timeout=30)
        times["health"] = time.monotonic()
    finally:
        thread.join(60)
    assert health.status_code == 200
    assert times["health"] < times["encoded"], "/health waited for the tokeniser"
    assert got["r"].status_code == 400  # far above the context
    assert got["r"].json()["error"]["code"] == "context_length_exceeded"


def test_an_oversized_body_is_refused_before_it_is_read(server):
    """The server's default --max-body-bytes: a Content-Length above it gets 413 (OpenAI's
    error object) without a byte of the body sent."""
    from urllib.parse import urlsplit

    url = urlsplit(server.url)
    with socket.create_connection((url.hostname, url.port), timeout=5) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n" % (50 * 2 ** 20))
        got = b""
        while b"}}" not in got:  # the whole error object (the server waits for the body)
            got += sock.recv(65536)
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413 ") and b"connection: close" in head.lower()
    assert json.loads(body)["error"]["code"] == "request_too_large"
    assert httpx.get(server.url + "/health").status_code == 200


def test_disconnect_mid_stream_frees_pages(server, served):
    runner = served[2]
    with httpx.stream("POST", server.url + "/v1/completions", json={
            "model": NAME, "prompt": "w1 w2", "max_tokens": 60, "ignore_eos": True,
            "temperature": 0, "stream": True}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert runner.in_flight == 1
    _wait_idle(runner)  # the server saw the client go and cancelled the request
    text = httpx.get(server.url + "/metrics").text
    assert 'transformer_jax_requests_finished_total{finish_reason="cancelled"}' in text


def _cancelled(server) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith('transformer_jax_requests_finished_total{finish_reason="cancelled"}'):
            return float(line.split()[-1])
    return 0.0


def test_disconnect_of_an_n_choice_stream_cancels_every_choice(server, served, monkeypatch):
    runner, before = served[2], _cancelled(server)
    # The choices fork from one prefill and decode together: slowed to 50 ms a step, their 60
    # tokens outlast the first chunk's round trip, so they are in flight when the client goes.
    step = runner.engine.step

    def slow_step():
        time.sleep(0.05)
        return step()

    monkeypatch.setattr(runner.engine, "step", slow_step)
    with httpx.stream("POST", server.url + "/v1/completions", json={
            "model": NAME, "prompt": "w1 w2", "max_tokens": 60, "ignore_eos": True,
            "temperature": 0.8, "n": 3, "stream": True}) as r:
        assert next(r.iter_lines()).startswith("data: ")
        assert runner.in_flight == 3
    _wait_idle(runner)  # (the fixture then finds every page back)
    assert _cancelled(server) == before + 3


def test_64_concurrent_streams_some_disconnecting(server, served):
    """Every completed stream's text equals the non-streamed response to the same request;
    the streams that went away are cancelled; nothing is left in flight."""
    runner = served[2]
    rng = np.random.default_rng(0)
    bodies = [{"model": NAME, "prompt": rng.integers(5, TINY.vocab_size, int(n)).tolist(),
               "max_tokens": int(m), "temperature": 0}
              for n, m in zip(rng.integers(2, 24, 64), rng.integers(4, 16, 64), strict=True)]
    leaving = set(range(0, 64, 10))  # 7 of 64 (about 10%) go away after their first chunk

    async def stream(http, i):
        body = {**bodies[i], "stream": True, "stream_options": {"include_usage": True}}
        text, usage, last = "", None, None
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line:
                    continue
                if line == "data: [DONE]":
                    return text, usage
                chunk = json.loads(line.removeprefix("data: "))
                if chunk["choices"]:
                    text += chunk["choices"][0]["text"]
                    last = chunk["choices"][0]["finish_reason"] or last
                    if i in leaving:
                        return None
                else:
                    usage = chunk["usage"]
        raise AssertionError(f"stream {i} ended without [DONE] ({last})")

    async def whole(http, i):
        r = await http.post("/v1/completions", json=bodies[i])
        assert r.status_code == 200
        return r.json()["choices"][0]["text"], r.json()["usage"]

    async def main():
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=60) as http:
            streamed = await asyncio.gather(*(stream(http, i) for i in range(64)))
            plain = await asyncio.gather(*(whole(http, i) for i in range(64)))
        return streamed, plain

    threads = _threads()
    streamed, plain = asyncio.run(main())
    for i, (s, p) in enumerate(zip(streamed, plain, strict=True)):
        if i in leaving:
            assert s is None
        else:
            assert s == p, i
    _wait_idle(runner)
    assert _threads() == threads  # no thread left behind
    parsers = [t for t in threading.enumerate() if t.name.startswith("serve-parse")]
    assert len(parsers) <= 2 * serve_app.PARSE_THREADS  # the two apps' bounded parse pools


def _threads():
    """The threads alive, but the apps' parse pools' workers (started on demand)."""
    return sum(not t.name.startswith("serve-parse") for t in threading.enumerate())


def test_pool_size_flags():
    def pages(*flags):
        return cli.pool_pages(cli.build_parser().parse_args(["--checkpoint", "x", *flags]), TINY)

    assert pages("--slots", "3", "--page-size", "16") == 1 + 3 * 4  # each slot a full context
    assert pages("--pages", "9") == 9
    with pytest.raises(ValueError, match="--memory-fraction needs a device"):
        pages("--memory-fraction", "0.5")  # the CPU reports no memory


def test_bench_http_mode_counts_every_token(server):
    from transformer_jax.bench.serve import make_workload
    from transformer_jax.bench.serve_http import run_http

    work = make_workload(6, (2, 12), (3, 9), 1, 50.0, 1.0, TINY.vocab_size, seed=1)
    out = run_http(server.url, work)
    assert out["output_tokens"] == sum(work.max_tokens)
    assert 0 < out["ttft_s"]["median"] <= out["e2e_s"]["median"]


# SIGTERM -----------------------------------------------------------------------------------------

def test_sigterm_drains_and_exits_0(checkpoint):
    """``cli.main`` serves until SIGTERM; the stream in flight then finishes (within the grace
    period), the port closes, and main returns 0."""
    sock = free_socket()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()
    got = {}

    def client():
        try:
            end = time.monotonic() + 60
            while time.monotonic() < end:
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.05)
            body = {"model": NAME, "prompt": "w1", "max_tokens": 30, "ignore_eos": True,
                    "temperature": 0, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
                lines = r.iter_lines()
                got["first"] = next(lines)
                os.kill(os.getpid(), signal.SIGTERM)
                got["rest"] = [line for line in lines if line]
        finally:
            if "first" not in got:  # never ready: end main anyway
                os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=client)
    thread.start()
    rc = cli.main(["--checkpoint", str(checkpoint[0]), "--port", url.rsplit(":", 1)[1],
                   "--served-model-name", NAME, "--grace-period", "20",
                   "--log-level", "warning", *ENGINE_ARGS])
    thread.join(30)
    assert rc == 0
    assert got["first"].startswith("data: ") and got["rest"][-1] == "data: [DONE]"
    last = json.loads(got["rest"][-2].removeprefix("data: "))
    assert last["choices"][0]["finish_reason"] == "length"
    assert len(got["rest"]) == 30  # 29 more tokens, then [DONE]: nothing cut off
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/health", timeout=2)


@pytest.mark.parametrize("stuck", [False, True], ids=["engine-steps", "engine-stuck"])
def test_shutdown_ends_cut_streams_and_refuses_queued_requests(served, monkeypatch, caplog,
                                                               stuck):
    """SIGTERM with a grace period shorter than the requests: the eight running streams end
    with a last chunk (finish_reason "abort", usage equal to the tokens sent) and [DONE]; the
    two requests still queued (one streamed, one not) get 503 error objects; no traceback or
    error is logged; the server returns well before uvicorn's own timeout would cancel them.
    Also when the engine is stuck in a step from the signal on (a first step that compiles):
    the handlers end their requests themselves. (``DrainingServer`` in this main thread,
    where uvicorn takes the signal, over the module's engine, its steps slowed to 30 ms.)"""
    runner, model = served[2], served[3]
    engine = runner.engine
    real_step = engine.step
    hold, release = threading.Event(), threading.Event()

    def slow_step():
        time.sleep(0.03)
        if hold.is_set():
            release.wait(30)
        return real_step()

    monkeypatch.setattr(engine, "step", slow_step)
    sock = free_socket()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    config = uvicorn.Config(create_app(runner, model), log_level="warning",
                            timeout_graceful_shutdown=0.3)
    server = cli.DrainingServer(runner, config)
    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.addHandler(caplog.handler)
    body = {"model": NAME, "prompt": "w1", "max_tokens": 50, "ignore_eos": True,
            "temperature": 0, "logprobs": 1}
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    got = {}

    async def stream(http, i, started):
        lines = []
        try:
            async with http.stream("POST", "/v1/completions", json=streamed) as r:
                started.add(i)
                if r.status_code != 200:
                    return r.status_code, json.loads(await r.aread())
                async for line in r.aiter_lines():
                    if line:
                        lines.append(line)
            return 200, lines
        except httpx.HTTPError as e:
            return type(e).__name__, lines

    async def plain(http):
        try:
            r = await http.post("/v1/completions", json=body)
            return r.status_code, r.json()
        except httpx.HTTPError as e:
            return type(e).__name__, None

    async def clients():
        end = time.monotonic() + 30
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            started = set()
            running = [asyncio.create_task(stream(http, i, started)) for i in range(8)]
            while len(started) < 8:  # headers come with the first token: all 8 run
                assert time.monotonic() < end, f"{len(started)} of 8 streams started"
                await asyncio.sleep(0.01)
            queued = [asyncio.create_task(stream(http, 8, started)),
                      asyncio.create_task(plain(http))]
            while runner.in_flight < 10:
                assert time.monotonic() < end, f"{runner.in_flight} requests in flight"
                await asyncio.sleep(0.01)
            if stuck:
                hold.set()
            got["signal"] = time.monotonic()
            os.kill(os.getpid(), signal.SIGTERM)
            got["running"] = await asyncio.gather(*running)
            got["queued"] = await asyncio.gather(*queued)

    def client():
        try:
            asyncio.run(asyncio.wait_for(clients(), 60))
        except BaseException as e:
            got["error"] = e
        finally:
            server.should_exit = True  # stops the server if no signal came

    thread = threading.Thread(target=client)
    thread.start()
    try:
        server.run(sockets=[sock])
        stopped = time.monotonic()
        thread.join(60)
    finally:
        release.set()
        uvicorn_log.removeHandler(caplog.handler)
        runner.draining, runner.abort_at = False, float("inf")
        monkeypatch.undo()
    assert "error" not in got, got.get("error")
    assert stopped - got["signal"] < 0.3 + 3  # the grace, not uvicorn's timeout (+5 s)
    for status, lines in got["running"]:
        assert status == 200 and lines[-1] == "data: [DONE]", (status, lines[-3:])
        chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
        *text, last, usage = chunks
        assert last["choices"][0]["finish_reason"] == "abort"
        assert not any(c["choices"][0]["finish_reason"] for c in text)
        sent = sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in [*text, last])
        assert 0 < sent < 50 and usage["usage"]["completion_tokens"] == sent
    for status, out in got["queued"]:
        assert status == 503, (status, out)
        assert out["error"]["code"] == "server_shutting_down"
    problems = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not problems, [r.getMessage() for r in problems]
    _wait_idle(runner)
    engine.check_no_leaks()


def test_a_draft_model_speculates_through_the_server(checkpoint, monkeypatch):
    """``--speculative draft:PATH`` (the checkpoint as its own draft, so its proposals are the
    model's): replies equal ``generate``'s, and ``/metrics`` counts the kept proposals."""
    args = cli.build_parser().parse_args(["--checkpoint", str(checkpoint[0]), *ENGINE_ARGS,
                                          "--speculative", f"draft:{checkpoint[0]}:k=3"])
    # Built without ``Engine.compile``: its step shapes are the served fixture's (compiled),
    # and its sampled and wider verify programs are more than these greedy requests run
    # (test_speculative_engine covers ``compile(speculative=k)``).
    from transformer_jax.serving import Engine

    monkeypatch.setattr(Engine, "compile", lambda self, *a, **k: 0)
    runner, model, _ = cli.build(args)
    runner.start()
    runner.ready = True
    served = Served(create_app(runner, model))
    try:
        stops = [model.tokenizer.eos_id]
        for prompt in ("w3 w1 w4 w1 w5 w9 w2 w6 w5", "w7 w7 w2"):
            out = _client(served).completions.create(model=NAME, prompt=prompt, max_tokens=10,
                                                     temperature=0)
            ids = encode_text(model.tokenizer, prompt)
            assert out.choices[0].text == _expected(checkpoint, model, ids, 10, stops)[2]
        _wait_idle(runner)
        metrics = runner.engine.speculation.metrics()
        assert metrics["accepted"] > 0 and metrics["accepted"] >= 0.9 * metrics["proposed"]
        text = httpx.get(served.url + "/metrics").text
        assert f"transformer_jax_speculative_accepted {float(metrics['accepted'])}" in text
        runner.engine.check_no_leaks()
    finally:
        served.close()
        runner.stop()
