"""bench serve's http mode with text prompts (``--http-prompts text``, bench/serve_http.py):
what a server that takes only OpenAI's fields (``transformers serve``) is sent, and how the
tokens of its text chunks are counted, against a stand-in for such a server."""

import asyncio
import itertools
import json
import socket

import httpx
import pytest
from helpers import exit_and_line

from transformer_jax.bench import serve as bench_serve
from transformer_jax.bench.serve_http import _run
from transformer_jax.bench.serve_workload import make_workload

OPENAI_FIELDS = {"model", "prompt", "max_tokens", "temperature", "stream", "stream_options"}


class Words:
    """A word-level tokenizer: id i is the word ``w{i}``, words joined by spaces."""

    def decode(self, ids):
        return " ".join(f"w{i}" for i in ids)

    def encode(self, text):
        return [int(w[1:]) for w in text.split()]


def stand_in(drop=0, usage_extra=0):
    """A transformers-serve-like server: 422 for any field beyond OpenAI's or a prompt that is
    not text; else ``max_tokens - drop`` words streamed in chunks of 1, 0, 2 and 3 words (text
    held back, then merged, as a stream that fell behind sends it), a finish chunk, and the
    usage (``usage_extra`` tokens more than it sent). Returns the transport and the bodies."""
    bodies = []

    def handle(request):
        body = json.loads(request.content)
        bodies.append(body)
        if set(body) - OPENAI_FIELDS or not isinstance(body["prompt"], str):
            return httpx.Response(422, json={"detail": "Unexpected fields"})
        n = body["max_tokens"] - drop
        words = [f"w{(len(body['prompt']) + k) % 50}" for k in range(n)]
        chunks, k, sizes = [], 0, itertools.cycle([1, 0, 2, 3])
        while k < n:
            size = next(sizes)
            chunks.append({"choices": [{"index": 0, "text": (" " if k else "")
                                        + " ".join(words[k:k + size])}]})
            k += size
        chunks.append({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
        chunks.append({"choices": [], "usage": {"completion_tokens": n + usage_extra}})
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handle), bodies


def serve(work, transport):
    return asyncio.run(_run("http://stand-in", work, "m", None, 30.0, Words(), transport))


def test_text_prompts_and_every_token_counted_from_the_text():
    work = make_workload(8, (2, 12), (3, 17), 1, float("inf"), 1.0, 50, seed=1)
    transport, bodies = stand_in()
    out = serve(work, transport)
    assert out["output_tokens"] == sum(work.max_tokens)
    assert out["streams_completed"] == 8
    assert sorted(b["prompt"] for b in bodies) == sorted(Words().decode(p)
                                                         for p in work.prompts)
    assert all(set(b) <= OPENAI_FIELDS and b["temperature"] == 0 for b in bodies)
    assert 0 < out["ttft_s"]["median"] <= out["e2e_s"]["median"]


@pytest.mark.parametrize("drop, usage_extra", [(1, 0), (0, 1)])
def test_a_short_stream_or_a_usage_that_disagrees_fails_the_run(drop, usage_extra):
    work = make_workload(4, (2, 6), (4, 8), 1, float("inf"), 1.0, 50, seed=2)
    with pytest.raises(RuntimeError, match="4 of 4 streams incomplete"):
        serve(work, stand_in(drop, usage_extra)[0])


def test_an_error_chunk_fails_the_run_with_the_server_s_message():
    def handle(request):
        text = 'data: {"error": {"message": "out of pages"}}\n\ndata: [DONE]\n\n'
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})

    work = make_workload(2, (2, 6), (4, 8), 1, float("inf"), 1.0, 50, seed=3)
    with pytest.raises(RuntimeError, match="2 of 2 streams incomplete; the first: .*out of pages"):
        serve(work, httpx.MockTransport(handle))


def test_text_prompts_need_the_checkpoint_s_tokenizer(capsys):
    with socket.socket() as s:  # something accepting connections at --url
        s.bind(("127.0.0.1", 0))
        s.listen()
        code, line = exit_and_line(capsys, bench_serve.main, "--config", "tiny", "--modes", "http",
                                   "--url", f"http://127.0.0.1:{s.getsockname()[1]}",
                                   "--http-prompts", "text")
    assert code == 2 and "--http-prompts text needs --checkpoint (its tokenizer)" in line, line
