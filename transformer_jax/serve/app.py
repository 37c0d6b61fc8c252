"""The FastAPI app: routes, Bearer auth on ``/v1``, OpenAI error objects, SSE streaming.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health`` and ``GET /metrics``. A stream's headers go out with its first engine event, so
a request the engine never started can still be refused with a status.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from transformer_jax.serve import completions
from transformer_jax.serve.limits import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, BodyLimits
from transformer_jax.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    check_unicode,
    validation_error,
)
from transformer_jax.serve.runner import ABORT, EngineRunner, QueueFull, RequestStream, ShuttingDown
from transformer_jax.serving import TokenEvent

logger = logging.getLogger(__name__)

#: How often a non-streamed request checks that its client is still there, in seconds.
DISCONNECT_POLL_S = 0.5
#: ``Retry-After`` of a 429, in seconds.
RETRY_AFTER_S = 1
#: Worker threads parsing and tokenising request bodies (per app; named ``serve-parse_N``).
PARSE_THREADS = 4


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def key_matches(header: str | None, api_key: str) -> bool:
    """Whether an ``Authorization`` header value is exactly ``Bearer <api_key>`` (compared in
    constant time: no prefix, extension or other spacing of the key passes)."""
    given = _wire_bytes(header or "", "latin-1")  # the bytes sent: Starlette decodes latin-1
    return hmac.compare_digest(given, b"Bearer " + _wire_bytes(api_key, "utf-8"))


def _wire_bytes(text: str, encoding: str) -> bytes:
    """``text`` as bytes: in ``encoding`` when it can be; else as UTF-8 with its surrogates
    (a key from argv or the environment holds undecodable bytes as surrogates)."""
    for codec, errors in ((encoding, "strict"), ("utf-8", "surrogateescape")):
        try:
            return text.encode(codec, errors)
        except UnicodeEncodeError:
            pass
    return text.encode("utf-8", "surrogatepass")


def create_app(runner: EngineRunner, model: completions.ModelInfo,
               api_key: str | None = None, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               body_timeout: float | None = DEFAULT_BODY_TIMEOUT_S) -> FastAPI:
    """The app serving ``runner``'s engine as ``model``.

    Args:
      runner: the engine's runner (started by the caller).
      model: the served model.
      api_key: when given, every ``/v1`` route needs ``Authorization: Bearer <api_key>``.
      max_body_bytes: the largest request body (413 above it).
      body_timeout: seconds a request's body may take to arrive (408 after); None: no limit.
    """
    parsers = ThreadPoolExecutor(PARSE_THREADS, thread_name_prefix="serve-parse")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        parsers.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="transformer_jax", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)
    app.state.runner, app.state.model = runner, model
    app.add_middleware(BodyLimits, max_bytes=max_body_bytes, timeout=body_timeout,
                       draining=lambda: runner.draining)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(APIError(exc.status_code, str(exc.detail)).body(), exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("request %s %s failed", request.method, request.url.path)
        message = f"internal error: {type(exc).__name__}: {exc}"
        message = message.encode("utf-8", "backslashreplace").decode()  # always encodable
        return JSONResponse(APIError(500, message).body(), 500)

    async def authorize(request: Request) -> None:
        if api_key is not None and not key_matches(request.headers.get("authorization"), api_key):
            raise APIError(401, "a valid API key is needed: send the header "
                           "'Authorization: Bearer KEY'", None, "invalid_api_key")

    v1 = [Depends(authorize)]

    @app.get("/health")
    async def health() -> JSONResponse:
        if runner.ready and not runner.draining:
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "draining" if runner.draining else "starting"}, 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(runner.metrics.text(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", dependencies=v1)
    async def models() -> dict[str, Any]:
        base = {"id": model.name, "object": "model", "created": model.created,
                "owned_by": "transformer_jax", "root": model.name, "parent": None,
                "max_model_len": model.max_len}
        # A LoRA adapter is a model of its own, whose parent is the base (as vLLM lists them).
        return {"object": "list", "data": [base] + [
            {**base, "id": name, "root": name, "parent": model.name}
            for name in model.adapters]}

    @app.post("/v1/completions", dependencies=v1)
    async def complete(request: Request) -> Response:
        return await _serve(request, CompletionRequest)

    @app.post("/v1/chat/completions", dependencies=v1)
    async def chat(request: Request) -> Response:
        return await _serve(request, ChatCompletionRequest)

    def _refuse_if_draining() -> None:
        if runner.draining:
            raise _shutting_down()

    async def _serve(request: Request, cls: type[CompletionRequest | ChatCompletionRequest]
                     ) -> Response:
        _refuse_if_draining()
        raw = await request.body()  # whole already, within the limits (BodyLimits)
        req, prepared = await asyncio.get_running_loop().run_in_executor(
            parsers, _parse_and_prepare, raw, cls, model)
        _refuse_if_draining()
        streams = []
        try:
            for i in range(prepared.n):  # choice i: seed + i (``Prepared.choice``)
                streams.append(runner.submit(prepared.prompt, prepared.choice(i)))
        except (QueueFull, ShuttingDown, ValueError) as e:
            _cancel(streams)
            if isinstance(e, QueueFull):
                raise APIError(429, str(e), None, "rate_limit_exceeded",
                               {"Retry-After": str(RETRY_AFTER_S)}) from None
            if isinstance(e, ShuttingDown):
                raise _shutting_down() from None
            # What the engine refuses (a prompt above the page pool).
            raise APIError(400, str(e), _param_of(str(e))) from None
        choices = completions.Choices(prepared, model)
        pairs = list(zip(streams, choices.responses, strict=True))
        handed_over = False
        try:
            first = []
            for stream, response in pairs:
                events = await _next_or_gone(request, stream)
                if events is None:
                    return JSONResponse({}, 499)
                first.append(response.add(events))
                _refuse_unstarted(response)
            if req.stream:
                handed_over = True  # the stream's generator cancels them from now on
                return StreamingResponse(_sse(pairs, choices, req, first),
                                         media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache"})
            for stream, response in pairs:
                while response.finish_reason is None:
                    events = await _next_or_gone(request, stream)
                    if events is None:
                        return JSONResponse({}, 499)
                    response.add(events)
        finally:
            if not handed_over:
                _cancel(streams)
        if any(r.finish_reason == "error" for r in choices.responses):
            raise APIError(500, "the engine failed while running this request")
        return JSONResponse(choices.final())

    def _cancel(streams: list[RequestStream]) -> None:
        for stream in streams:
            runner.cancel(stream)

    async def _next_or_gone(request: Request, stream: RequestStream
                            ) -> list[TokenEvent] | None:
        """The stream's next events; None once its client has gone away."""
        while True:
            try:
                return await runner.next_events(stream, DISCONNECT_POLL_S)
            except TimeoutError:
                if await request.is_disconnected():
                    logger.info("client of request %d went away", stream.request_id)
                    return None

    async def _sse(pairs: list[tuple[RequestStream, completions.Response]],
                   choices: completions.Choices,
                   req: CompletionRequest | ChatCompletionRequest,
                   first: list[tuple[str, list[TokenEvent]]]) -> AsyncIterator[str]:
        """The chunks of every choice as its events come (each names its choice), then the
        usage when asked and [DONE]."""
        def chunks(response: completions.Response, text: str, tokens: list[TokenEvent],
                   opening: bool) -> list[str]:
            return [f"data: {_dumps(chunk)}\n\n" for chunk in response.chunks(
                text, tokens, response.finish_reason, opening, req.continuous_usage)]

        pending: dict[asyncio.Task, int] = {}
        try:
            for i, ((_, response), (text, tokens)) in enumerate(zip(pairs, first, strict=True)):
                for line in chunks(response, text, tokens, response.chat):
                    yield line
                if response.finish_reason is None:
                    pending[asyncio.ensure_future(runner.next_events(pairs[i][0]))] = i
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    i = pending.pop(task)
                    stream, response = pairs[i]
                    text, tokens = response.add(task.result())
                    for line in chunks(response, text, tokens, False):
                        yield line
                    if response.finish_reason is None:
                        pending[asyncio.ensure_future(runner.next_events(stream))] = i
            if req.include_usage:
                yield f"data: {_dumps(choices.responses[0].usage_chunk())}\n\n"
            yield "data: [DONE]\n\n"
        finally:  # also when the client went away (the generator is cancelled)
            for task in pending:
                task.cancel()
            _cancel([stream for stream, _ in pairs])

    return app


def _shutting_down(message: str = "the server is shutting down") -> APIError:
    return APIError(503, message, None, "server_shutting_down")


def _refuse_unstarted(response: completions.Response) -> None:
    """A request that ended before its first token without running: 503 (cut by a shutdown)
    or 500 (a failed engine step), as the status of the response."""
    if response.completion_tokens:
        return
    if response.finish_reason == ABORT:
        raise _shutting_down("the server shut down before this request started")
    if response.finish_reason == "error":
        raise APIError(500, "the engine failed while running this request")


def _parse_and_prepare(raw: bytes, cls: type[CompletionRequest | ChatCompletionRequest],
                       model: completions.ModelInfo
                       ) -> tuple[CompletionRequest | ChatCompletionRequest, completions.Prepared]:
    """The body as ``cls`` and the engine's input for it (on a worker thread)."""
    req = parse(raw, cls)
    return req, completions.prepare(req, model)


def parse(raw: bytes, cls: type[CompletionRequest | ChatCompletionRequest]
          ) -> CompletionRequest | ChatCompletionRequest:
    """The body as ``cls``, or an ``APIError`` naming what is wrong."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the body is not valid JSON: {e}", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the body must be a JSON object, got {type(data).__name__}")
    check_unicode(raw, data)
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise validation_error(e.errors()) from None


def _param_of(message: str) -> str:
    """The request field an engine error names first (``top_k must be ...``); else
    ``max_tokens`` (the engine's other refusals are of the request's size)."""
    head = message.split(" ", 1)[0]
    fields = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
    return head if head in fields else "max_tokens"
