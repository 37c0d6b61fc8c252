"""HTTP mode of ``bench serve``: the same workload through a running server's streaming API.

``bench serve --url http://127.0.0.1:8000`` sends each request of ``make_workload`` at its
arrival time to ``POST /v1/completions`` (token-id prompt, greedy, ``ignore_eos``, so each
request produces exactly its drawn number of tokens, as in the engine mode) with ``stream`` and
``stream_options.continuous_usage_stats``: every chunk carries the request's token count so
far, so a token's time is its chunk's arrival even when its text was held back into the next
chunk. The figures are ``summarize``'s (TTFT, TPOT, ITL, E2E, throughputs). The server
must serve a model with ``--config``'s vocabulary (ids are drawn below its size); the client runs
in this process, on the same host's cores as the server.

With a ``tokenizer`` (``--http-prompts text``) the prompts go as text (the ids decoded) and the
body has only OpenAI's fields (no ``ignore_eos``, no per-chunk usage), for servers that take
no more, such as ``transformers serve``: each chunk's tokens are counted by encoding its text,
which is exact for a tokenizer whose ids round-trip through text (a word-level one); the model
must have no eos to stop at, and the last chunk's usage must agree with the count.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx

from transformer_jax.bench.serve_workload import Workload, summarize


def served_model(url: str, api_key: str | None = None) -> dict[str, Any]:
    """The first model ``GET /v1/models`` lists (its ``id`` and ``max_model_len``)."""
    r = httpx.get(url.rstrip("/") + "/v1/models", headers=_headers(api_key), timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _body(model: str, prompt: list[int], max_tokens: int, tokenizer: Any) -> dict[str, Any]:
    if tokenizer is not None:  # OpenAI's fields only
        return {"model": model, "prompt": tokenizer.decode(prompt), "max_tokens": max_tokens,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}


async def _run(url: str, work: Workload, model: str, api_key: str | None, timeout: float,
               tokenizer: Any = None, transport: Any = None) -> dict[str, Any]:
    records: list[dict[str, Any]] = [{"arrival": a, "times": []} for a in work.arrivals]
    limits = httpx.Limits(max_connections=len(records) + 8, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url.rstrip("/"), limits=limits, timeout=timeout,
                                 headers=_headers(api_key), transport=transport) as http:
        start = time.perf_counter()

        async def one(i: int) -> None:
            await asyncio.sleep(max(0.0, start + work.arrivals[i] - time.perf_counter()))
            body = _body(model, work.prompts[i], work.max_tokens[i], tokenizer)
            times, seen, usage = records[i]["times"], 0, None
            async with http.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"request {i}: HTTP {r.status_code}: "
                                       f"{(await r.aread()).decode()[:300]}")
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        raise RuntimeError(f"request {i}: {chunk['error']}")
                    now = time.perf_counter()
                    usage = chunk.get("usage") or usage
                    if tokenizer is not None:
                        new = sum(len(tokenizer.encode(c.get("text") or ""))
                                  for c in chunk.get("choices") or ())
                    else:
                        new = usage["completion_tokens"] - seen if chunk.get("usage") else 0
                    times += [now] * new
                    seen += new
            total = usage["completion_tokens"] if usage else None
            if seen != work.max_tokens[i] or total != seen:
                raise RuntimeError(f"request {i}: {seen} tokens counted, the server's usage "
                                   f"{total}, asked {work.max_tokens[i]}")

        outcomes = await asyncio.gather(*(one(i) for i in range(len(records))),
                                        return_exceptions=True)
    failed = [e for e in outcomes if isinstance(e, BaseException)]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(records)} streams incomplete; the first: "
                           f"{failed[0]}") from failed[0]
    out = summarize(records, start)
    out["streams_completed"] = len(records)
    return out


def run_http(url: str, work: Workload, api_key: str | None = None,
             timeout: float = 600.0, tokenizer: Any = None) -> dict[str, Any]:
    """Serves ``work`` through the server at ``url``; the same figures as the engine mode.
    With ``tokenizer`` (``encode``/``decode``), text prompts and tokens counted by text."""
    model = served_model(url, api_key)
    longest = max(len(p) + n for p, n in zip(work.prompts, work.max_tokens, strict=True))
    if model.get("max_model_len", longest) < longest:
        raise ValueError(f"the workload needs {longest} positions; the served model has "
                         f"{model['max_model_len']}")
    return asyncio.run(_run(url, work, model["id"], api_key, timeout, tokenizer))
