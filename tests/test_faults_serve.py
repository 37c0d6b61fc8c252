"""The HTTP server's faults and properties that need no engine (issue 34; the ones that need the
served model are in ``test_serve.py``, on its module's server): the body limits (413 by
Content-Length and by counting a chunked body, 408 and the connection closed for a body that
stalls, 503 for one still arriving at a shutdown); the CLI binds before it loads (a busy port
fails at once) and warns when it serves beyond loopback without a key; the request models
refuse an out-of-range temperature themselves; ``prepare`` stops completions at eos and chat
also at the turn's end; usage counts the tokens returned whatever ended the request; the key
is compared whole."""

import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from helpers import write_chatml_tokenizer
from pydantic import ValidationError

from transformer_jax.cli import serve as cli
from transformer_jax.serve import completions
from transformer_jax.serve.protocol import ChatCompletionRequest, CompletionRequest
from transformer_jax.serving import SamplingParams, TokenEvent
from transformer_jax.tokenizer import load_tokenizer

WORDS = [f"w{i}" for i in range(59)]
LIMIT = 1000  # bytes, the test server's --max-body-bytes
BODY_TIMEOUT = 0.5  # seconds, its --body-timeout


# Body limits ------------------------------------------------------------------------------------

class _Echo:
    """An ASGI app answering with the length of the body it was given."""

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        data = json.dumps({"length": len(body)}).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": data})


@pytest.fixture(scope="module")
def limited():
    """uvicorn on a thread serving ``_Echo`` behind ``BodyLimits``; ``state["draining"]``
    is what its ``draining`` callable returns."""
    from transformer_jax.serve.limits import BodyLimits

    state = {"draining": False}
    app = BodyLimits(_Echo(), LIMIT, BODY_TIMEOUT, draining=lambda: state["draining"])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]})
    thread.start()
    end = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < end, "the test server did not start"
        time.sleep(0.01)
    yield sock.getsockname()[:2], state
    server.should_exit = True
    thread.join(10)


def _raw(address, data):
    """Sends ``data``; returns (the response, seconds until it was whole, seconds until the
    server closed the connection). Fails after 5 s."""
    start = time.monotonic()
    with socket.create_connection(address, timeout=5) as s:
        s.sendall(data)
        got, whole = b"", None
        while piece := s.recv(65536):
            got += piece
            head, _, body = got.partition(b"\r\n\r\n")
            length = [line.split(b":")[1] for line in head.lower().split(b"\r\n")
                      if line.startswith(b"content-length:")]
            if whole is None and length and len(body) >= int(length[0]):
                whole = time.monotonic() - start
    return got, whole, time.monotonic() - start


def _status_and_error(raw):
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, head.lower(), json.loads(body)["error"]


def _post(length, chunked=False):
    framing = b"Transfer-Encoding: chunked" if chunked else b"Content-Length: %d" % length
    return b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + framing + b"\r\n\r\n"


def test_a_body_within_the_limit_reaches_the_app_whole(limited):
    address, _ = limited
    url = "http://{}:{}/".format(*address)
    for body in (b"", b"x" * LIMIT):
        r = httpx.post(url, content=body, timeout=5)
        assert r.status_code == 200 and r.json() == {"length": len(body)}
    chunks = (b"y" * 100 for _ in range(10))  # chunked, exactly the limit
    r = httpx.post(url, content=chunks, timeout=5)
    assert r.status_code == 200 and r.json() == {"length": LIMIT}


def test_a_declared_oversized_body_gets_413_before_it_is_read(limited):
    address, _ = limited
    got, whole, closed = _raw(address, _post(50 * 2 ** 20))  # only the headers are sent
    status, head, err = _status_and_error(got)
    assert status == 413 and b"connection: close" in head
    assert err["code"] == "request_too_large" and "--max-body-bytes" in err["message"]
    assert set(err) == {"message", "type", "param", "code"}
    # At once; the connection stays for the rest of the body until the body's deadline.
    assert whole < BODY_TIMEOUT and BODY_TIMEOUT <= closed < BODY_TIMEOUT + 2
    # A client that sends its whole (oversized) body first still reads the 413: the server
    # drops the rest before it closes (closing on unread data would reset the connection).
    url = "http://{}:{}/".format(*address)
    for _ in range(3):
        r = httpx.post(url, content=b"x" * 2 ** 21, timeout=5)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_a_chunked_body_is_counted_as_it_comes(limited):
    address, _ = limited
    r = httpx.post("http://{}:{}/".format(*address), content=(b"z" * 300 for _ in range(10)),
                   timeout=5)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    # A chunked body that has not ended is refused once past the limit, not read to its end.
    chunk = b"%x\r\n%s\r\n" % (400, b"z" * 400)
    got, whole, _ = _raw(address, _post(0, chunked=True) + chunk * 3)
    assert _status_and_error(got)[0] == 413 and whole < BODY_TIMEOUT


def test_a_stalled_body_gets_408_and_the_connection_closes(limited):
    address, _ = limited
    got, whole, closed = _raw(address, _post(100) + b'{"model": "x", ')  # 15 of 100 bytes
    status, head, err = _status_and_error(got)
    assert status == 408 and b"connection: close" in head
    assert err["code"] == "request_timeout" and "--body-timeout" in err["message"]
    assert BODY_TIMEOUT <= whole <= closed < BODY_TIMEOUT + 2  # closed with the response


def test_a_body_still_arriving_at_shutdown_gets_503(limited):
    address, state = limited
    state["draining"] = True
    try:
        got, _, closed = _raw(address, _post(100) + b"{")
    finally:
        state["draining"] = False
    status, _, err = _status_and_error(got)
    assert status == 503 and err["code"] == "server_shutting_down" and closed < BODY_TIMEOUT


# The CLI: bind first, warn when open ------------------------------------------------------------

@pytest.fixture
def never_loads(monkeypatch):
    """``cli.build`` recording that it was called, then failing (so ``main`` returns 1)."""
    calls = []

    def build(args):
        calls.append(args)
        raise RuntimeError("the test stops here")

    monkeypatch.setattr(cli, "build", build)
    return calls


def _main(*flags):
    return cli.main(["--checkpoint", "unused", "--compilation-cache", "", *flags])


def test_a_busy_port_fails_before_loading(never_loads, capsys, caplog):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        assert _main("--port", str(port)) == 1
    finally:
        taken.close()
    err = capsys.readouterr().err
    assert never_loads == []  # nothing loaded or compiled
    assert f"cannot listen on 127.0.0.1:{port}" in err and "in use" in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not any("serving" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("scheme", ["int4:\u00b2", "int3", "nf4:"])
def test_a_bad_quant_fails_before_loading(never_loads, capsys, scheme):
    assert _main("--port", str(_free_port()), "--quant", scheme) == 1
    err = capsys.readouterr().err
    assert never_loads == []
    assert "--quant" in err and err.count("\n") == 1 and "Traceback" not in err


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(("flags", "warned"), [
    (["--host", "0.0.0.0"], True),
    (["--host", "0.0.0.0", "--api-key", "k"], False),
    (["--host", "127.0.0.1"], False),
])
def test_serving_beyond_loopback_without_a_key_warns(never_loads, caplog, monkeypatch,
                                                     flags, warned):
    monkeypatch.delenv(cli.API_KEY_ENV, raising=False)
    caplog.set_level("WARNING", logger="transformer_jax.serve")
    assert _main("--port", str(_free_port()), *flags) == 1
    assert len(never_loads) == 1  # it got as far as loading
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert bool([m for m in warnings if "open to the network" in m]) == warned, warnings
    if warned:
        assert "--api-key" in warnings[0] and "0.0.0.0" in warnings[0]


@pytest.mark.parametrize(("flag", "value"), [
    ("--max-body-bytes", "0"), ("--body-timeout", "0"), ("--body-timeout", "nan"),
    ("--grace-period", "-1"), ("--grace-period", "inf"), ("--port", "70000")])
def test_bad_limits_are_one_line_errors(never_loads, capsys, flag, value):
    assert _main(flag, value) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {flag} must") and err.count("\n") == 1
    assert never_loads == []


# Request models, prepare, usage, the key ----------------------------------------------------------

@pytest.mark.parametrize("cls", [CompletionRequest, ChatCompletionRequest])
def test_the_request_models_refuse_an_out_of_range_temperature(cls):
    body = {"model": "m", "prompt": "w1", "messages": [{"role": "user", "content": "w1"}]}
    for good in (0, 0.0, 1.5, 2, 2.0):
        assert cls.model_validate({**body, "temperature": good}).temperature == good
    for bad in (-0.1, -1, 2.000001, 3, 1e9):
        with pytest.raises(ValidationError) as e:
            cls.model_validate({**body, "temperature": bad})
        assert [err["loc"] for err in e.value.errors()] == [("temperature",)], bad


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    tok = load_tokenizer(write_chatml_tokenizer(tmp_path_factory.mktemp("tok"), WORDS))
    return completions.ModelInfo("m", 64, 64, tok, tok.token_to_id("<|im_end|>"))


def test_prepare_stops_completions_at_eos_and_chat_also_at_the_turn_end(model):
    eos, turn_end = model.tokenizer.eos_id, model.turn_end
    assert eos >= 0 and turn_end is not None and eos != turn_end
    assert completions.ModelInfo.of("m", type("C", (), {"vocab_size": 64, "max_seq_len": 64}),
                                    model.tokenizer).turn_end == turn_end
    text = {"model": "m", "prompt": "w1 w2", "max_tokens": 4}
    chat = {"model": "m", "messages": [{"role": "user", "content": "w1"}], "max_tokens": 4}

    def stops(cls, body):
        return completions.prepare(cls.model_validate(body), model).params.stop_token_ids

    assert stops(CompletionRequest, text) == (eos,)
    assert stops(ChatCompletionRequest, chat) == (eos, turn_end)
    assert stops(CompletionRequest, {**text, "stop_token_ids": [9]}) == (9, eos)
    assert stops(ChatCompletionRequest, {**chat, "stop_token_ids": [9]}) == (9, eos, turn_end)
    assert stops(CompletionRequest, {**text, "ignore_eos": True}) == ()
    assert stops(ChatCompletionRequest, {**chat, "ignore_eos": True}) == ()
    assert stops(ChatCompletionRequest, {**chat, "ignore_eos": True,
                                         "stop_token_ids": [9]}) == (9,)


def test_the_checkpoints_generation_config_eos_ids_stop_every_request(model, tmp_path):
    """A HF checkpoint's ``generation_config.json`` ``eos_token_id`` list (Llama 3.1 ends a
    tool call with ``<|eom_id|>``) stops completions and chats, but with ``ignore_eos``; a
    file that is not an id or a list of them is one error naming it."""
    from transformer_jax.hf.generation_config import generation_stop_ids

    assert generation_stop_ids(tmp_path) == ()
    file = tmp_path / "generation_config.json"
    for eos, ids in ((5, (5,)), ([5, 30, 99], (5, 30, 99)), (None, ())):
        file.write_text(json.dumps({"eos_token_id": eos}))
        assert generation_stop_ids(tmp_path) == ids
    for bad in ("x", [1, -2], True, [1.5]):
        file.write_text(json.dumps({"eos_token_id": bad}))
        with pytest.raises(ValueError, match="generation_config.json: eos_token_id"):
            generation_stop_ids(tmp_path)
    file.write_text("{")
    with pytest.raises(ValueError, match="generation_config.json"):
        generation_stop_ids(tmp_path)
    config = type("C", (), {"vocab_size": 64, "max_seq_len": 64})
    info = completions.ModelInfo.of("m", config, model.tokenizer, stop_ids=(30, 99))
    assert info.stop_ids == (30,)  # an id beyond the vocabulary cannot be drawn
    eos, turn_end = model.tokenizer.eos_id, model.turn_end
    text = {"model": "m", "prompt": "w1 w2", "max_tokens": 4}
    chat = {"model": "m", "messages": [{"role": "user", "content": "w1"}], "max_tokens": 4}
    stops = lambda cls, body: completions.prepare(  # noqa: E731
        cls.model_validate(body), info).params.stop_token_ids
    assert stops(CompletionRequest, text) == (eos, 30)
    assert stops(ChatCompletionRequest, chat) == (eos, turn_end, 30)
    assert stops(ChatCompletionRequest, {**chat, "ignore_eos": True}) == ()


def _events(tokens, reason, closing):
    """The events of a request that made ``tokens`` (two per step) and ended with ``reason``,
    on its last token or (``closing``) on an event of its own without one."""
    events = [TokenEvent(0, t, i, logprob=-0.5, text=f" w{t}") for i, t in enumerate(tokens)]
    if closing:
        events.append(TokenEvent(0, None, len(tokens), finish_reason=reason))
    else:
        events[-1] = TokenEvent(0, tokens[-1], len(tokens) - 1, logprob=-0.5,
                                finish_reason=reason, text="")
    return [events[i:i + 2] for i in range(0, len(events), 2)]


@pytest.mark.parametrize(("reason", "closing"), [
    ("length", False), ("stop", False), ("timeout", True), ("cancelled", True),
    ("abort", True), ("error", True)])
@pytest.mark.parametrize("chat", [False, True])
def test_usage_counts_the_tokens_returned_for_every_finish_reason(model, reason, closing, chat):
    tokens = [7, 8, 9, 10, 11]
    prepared = completions.Prepared([1, 5, 6], SamplingParams(logprobs=True), chat)
    whole, streamed = completions.Response(prepared, model), completions.Response(prepared,
                                                                                 model)
    for step in _events(tokens, reason, closing):
        whole.add(step)
    final = whole.final()
    returned = (final["choices"][0]["logprobs"]["content"] if chat else
                final["choices"][0]["logprobs"]["tokens"])
    assert final["choices"][0]["finish_reason"] == reason
    assert final["usage"] == {"prompt_tokens": 3, "completion_tokens": len(returned),
                              "total_tokens": 3 + len(returned)}
    assert len(returned) == len(tokens)
    sent = 0
    for step in _events(tokens, reason, closing):
        text, got = streamed.add(step)
        chunk = streamed.chunk(text, got, streamed.finish_reason, usage=True)
        lp = chunk["choices"][0]["logprobs"]
        sent += len(lp["content"] if chat else lp["tokens"])
        assert chunk["usage"]["completion_tokens"] == sent
    assert streamed.usage_chunk()["usage"] == final["usage"]


def test_the_key_must_be_the_whole_header():
    from transformer_jax.serve.app import key_matches

    assert key_matches("Bearer sekrit", "sekrit")
    for header in ("Bearer sekri", "Bearer sekrit2", "Bearer sekritsekrit", "Bearer sekrit ",
                   "Bearer  sekrit", " Bearer sekrit", "sekrit", "sekrit ", "Bearer",
                   "Bearer ", "Basic sekrit", "bearer sekrit", "", None, "Bearer s\udc00",
                   "Bearer sekrit\x00"):
        assert not key_matches(header, "sekrit"), header
