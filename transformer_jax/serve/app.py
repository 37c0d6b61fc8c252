"""The FastAPI app: routes, Bearer auth on ``/v1``, OpenAI error objects, SSE streaming.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health`` (200 once the engine is compiled and serving; 503 while draining) and
``GET /metrics`` (Prometheus text). Every refusal is OpenAI's error object with its status
(400 bad input naming the field, 401 a missing or wrong key, 429 a full queue with
``Retry-After``, 503 draining); an unexpected failure is a 500 object and the server goes on.
A stream is ``data: {chunk}`` lines, one per engine step that made text, then the usage chunk
when asked and ``data: [DONE]``; a client that goes away mid-request has its request
cancelled (its pages freed before the next step).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from transformer_jax.serve import completions
from transformer_jax.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    validation_error,
)
from transformer_jax.serve.runner import EngineRunner, QueueFull, RequestStream

logger = logging.getLogger(__name__)

#: How often a non-streamed request checks that its client is still there, in seconds.
DISCONNECT_POLL_S = 0.5
#: ``Retry-After`` of a 429, in seconds.
RETRY_AFTER_S = 1


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def create_app(runner: EngineRunner, model: completions.ModelInfo,
               api_key: str | None = None) -> FastAPI:
    """The app serving ``runner``'s engine as ``model``; with ``api_key``, every ``/v1``
    route needs ``Authorization: Bearer <api_key>``."""
    app = FastAPI(title="transformer_jax", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.runner, app.state.model = runner, model

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = APIError(exc.status_code, str(exc.detail))
        return JSONResponse(err.body(), exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("request %s %s failed", request.method, request.url.path)
        return JSONResponse(APIError(500, f"internal error: {type(exc).__name__}: {exc}")
                            .body(), 500)

    expected = f"Bearer {api_key}".encode() if api_key else None

    async def authorize(request: Request) -> None:
        if expected is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
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
        return {"object": "list", "data": [
            {"id": model.name, "object": "model", "created": model.created,
             "owned_by": "transformer_jax", "max_model_len": model.max_len}]}

    @app.post("/v1/completions", dependencies=v1)
    async def complete(request: Request) -> Response:
        return await _serve(request, await _parse(request, CompletionRequest))

    @app.post("/v1/chat/completions", dependencies=v1)
    async def chat(request: Request) -> Response:
        return await _serve(request, await _parse(request, ChatCompletionRequest))

    async def _serve(request: Request, req: CompletionRequest | ChatCompletionRequest
                     ) -> Response:
        if runner.draining:
            raise APIError(503, "the server is shutting down", None, "server_shutting_down")
        prepared = completions.prepare(req, model)
        try:
            stream = runner.submit(prepared.prompt, prepared.params)
        except QueueFull as e:
            raise APIError(429, str(e), None, "rate_limit_exceeded",
                           {"Retry-After": str(RETRY_AFTER_S)}) from None
        except ValueError as e:  # what the engine refuses (a prompt above the page pool)
            raise APIError(400, str(e), _param_of(str(e))) from None
        response = completions.Response(prepared, model)
        if req.stream:
            return StreamingResponse(_sse(stream, response, req),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await _collect(request, stream, response)

    async def _collect(request: Request, stream: RequestStream,
                       response: completions.Response) -> JSONResponse:
        try:
            while response.finish_reason is None:
                try:
                    events = await asyncio.wait_for(stream.next(), DISCONNECT_POLL_S)
                except TimeoutError:
                    if await request.is_disconnected():
                        logger.info("client of request %d went away", stream.request_id)
                        return JSONResponse({}, 499)
                    continue
                response.add(events)
        finally:
            runner.cancel(stream)
        if response.finish_reason == "error":
            raise APIError(500, "the engine failed while running this request")
        return JSONResponse(response.final())

    async def _sse(stream: RequestStream, response: completions.Response,
                   req: CompletionRequest | ChatCompletionRequest) -> AsyncIterator[str]:
        first = response.chat
        try:
            while response.finish_reason is None:
                text, tokens = response.add(await stream.next())
                if text or first or response.finish_reason is not None:
                    chunk = response.chunk(text, tokens, response.finish_reason, first,
                                           req.continuous_usage)
                    first = False
                    yield f"data: {_dumps(chunk)}\n\n"
            if req.include_usage:
                yield f"data: {_dumps(response.usage_chunk())}\n\n"
            yield "data: [DONE]\n\n"
        finally:  # also when the client went away (the generator is cancelled)
            runner.cancel(stream)

    return app


async def _parse(request: Request, cls: type[CompletionRequest | ChatCompletionRequest]
                 ) -> CompletionRequest | ChatCompletionRequest:
    """The body as ``cls``, or an ``APIError`` naming what is wrong."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the body is not valid JSON: {e}", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the body must be a JSON object, got {type(data).__name__}")
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
