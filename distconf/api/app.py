"""The Starlette application: OpenAI's ``/v1`` routes and the chat page at ``/``.

``GET /v1/models``, ``POST /v1/chat/completions`` and ``POST /v1/completions`` answer in
OpenAI's shapes (`distconf.api.shapes`), streamed as server-sent events when the request
says ``stream: true``. Every error is OpenAI's error object with its status (never a
traceback). With an API key, ``/v1`` needs ``Authorization: Bearer KEY`` (401 otherwise);
the page and its files are public (the page asks for the key). Bodies are limited to
``max_body_bytes`` (413). A stream's client that goes away cancels its generation at once
(`EventStream` watches for the disconnect while it sends). One log line per request:
route, model, tokens, time, status.

Outside OpenAI's namespace (no OpenAI client calls it, and no future OpenAI route can
collide with it), ``GET /distconf/verification`` lists the servers the model's spot checks
caught (``?limit=N``, the latest 100 by default; the key is needed as for ``/v1``). Every
completion answer carries the count in a header, `EVENTS_HEADER` (a header never changes
the JSON a client parses; OpenAI itself puts metadata such as ``x-request-id`` there).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from importlib import resources
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from distconf.api import shapes
from distconf.api.backend import MAX_EVENTS_LISTED, Backend, Event, Generation
from distconf.api.protocol import ApiError, new_id, now, parse_chat, parse_completion
from distconf.monitor.app import LOOPBACK_HOSTS

__all__ = ["DEFAULT_MAX_BODY_BYTES", "EVENTS_HEADER", "EventStream", "SECURITY_HEADERS", "STATIC_FILES", "build_app"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 1 << 20
"""Largest request body accepted (1 MiB)."""
STATIC_FILES = {"chat.js": "text/javascript; charset=utf-8", "chat.css": "text/css; charset=utf-8",
                "favicon.svg": "image/svg+xml"}
"""Files served under ``/static/`` (nothing else is)."""
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
"""The page's headers: the monitor's strict policy (no other origin, no inline script or style)."""
EVENTS_HEADER = "X-Distconf-Verification-Events"
"""Header of every completion answer: servers the model's spot checks caught so far (see /distconf/verification)."""
_POLL = 0.25  # seconds between disconnect checks while a request waits for its first token


def _asset(name: str) -> bytes:
    return resources.files("distconf.api").joinpath("static", name).read_bytes()


def _error(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body, status_code=exc.status)


class EventStream(Response):
    """A ``text/event-stream`` response that calls ``on_close`` as soon as it ends or its client goes away."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[bool], None],
                 headers: dict[str, str] | None = None) -> None:
        self.events, self.on_close = events, on_close
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Send the events while watching for the client's disconnect (which cancels the sending)."""
        finished = False
        async with anyio.create_task_group() as group:
            async def watch() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                group.cancel_scope.cancel()

            group.start_soon(watch)
            try:
                await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
                async for chunk in self.events:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                finished = True
            except OSError:
                pass  # the client went away while we wrote
            finally:
                self.on_close(finished)
                group.cancel_scope.cancel()


async def _read_json(request: Request, limit: int) -> Any:
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise ApiError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
    size, chunks = 0, []
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except ValueError:
        raise ApiError(400, "the request body is not valid JSON") from None


async def _next_event(generation: Generation, request: Request | None) -> Event:
    """The next event; while waiting, a client that went away cancels the generation."""
    getter = asyncio.ensure_future(generation.queue.get())  # one getter: an event is never lost to a timeout
    try:
        while True:
            done, _ = await asyncio.wait({getter}, timeout=_POLL)
            if done:
                return getter.result()
            if request is not None and await request.is_disconnected():
                generation.cancel()
                raise ApiError(499, "the client went away", code="client_closed")
    finally:
        getter.cancel()


def build_app(backend: Backend, *, api_key: str | None = None,
              allowed_hosts: tuple[str, ...] | None = LOOPBACK_HOSTS,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> Starlette:
    """The ASGI app serving ``backend``'s model.

    :param api_key: when set, ``/v1`` requests must send ``Authorization: Bearer <api_key>``.
    :param allowed_hosts: Host headers accepted (None: any, for a server bound to a public
        address on purpose); the default accepts loopback names only (against DNS rebinding).
    :param max_body_bytes: largest request body (larger: 413).
    """
    page = _asset("index.html")
    assets = {name: (_asset(name), media) for name, media in STATIC_FILES.items()}
    expected = f"Bearer {api_key}".encode() if api_key else None

    def authorize(request: Request) -> None:
        if expected is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            raise ApiError(401, "Incorrect API key provided: send it as 'Authorization: Bearer KEY'",
                           code="invalid_api_key")

    async def index(_: Request) -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers=SECURITY_HEADERS)

    async def static(request: Request) -> Response:
        found = assets.get(request.path_params["name"])
        if found is None:
            return Response("not found", status_code=404, media_type="text/plain")
        return Response(found[0], media_type=found[1], headers={**SECURITY_HEADERS, "Cache-Control": "max-age=60"})

    async def models(request: Request) -> Response:
        try:
            authorize(request)
        except ApiError as exc:
            return _error(exc)
        return JSONResponse({"object": "list", "data": [shapes.model_object(model_id, backend.created)
                                                        for model_id in backend.model_ids]})

    async def model(request: Request) -> Response:
        try:
            authorize(request)
            backend.check_model(request.path_params["model"])
        except ApiError as exc:
            return _error(exc)
        return JSONResponse(shapes.model_object(request.path_params["model"], backend.created))

    async def verification(request: Request) -> Response:
        try:
            authorize(request)
            raw = request.query_params.get("limit", "100")
            if not raw.isdigit() or not 0 <= int(raw) <= MAX_EVENTS_LISTED:
                raise ApiError(400, f"limit must be an integer in 0..{MAX_EVENTS_LISTED}", param="limit")
        except ApiError as exc:
            return _error(exc)
        return JSONResponse(backend.verification(int(raw)), headers={"Cache-Control": "no-store"})

    async def chat(request: Request) -> Response:
        return await _generate(request, "chat")

    async def completions(request: Request) -> Response:
        return await _generate(request, "completion")

    async def _generate(request: Request, kind: str) -> Response:
        started = time.monotonic()
        state: dict[str, Any] = {"model": "-", "generation": None}

        def log(status: int, note: str = "") -> None:
            gen: Generation | None = state["generation"]
            logger.info("%s %s model=%s prompt_tokens=%d completion_tokens=%d time=%.2fs status=%d%s",
                        request.method, request.url.path, state["model"], gen.prompt_tokens if gen else 0,
                        sum(s.completion_tokens for s in gen.streams) if gen else 0, time.monotonic() - started,
                        status, note)

        try:
            authorize(request)
            parsed = (parse_chat if kind == "chat" else parse_completion)(await _read_json(request, max_body_bytes))
            state["model"] = parsed.model
            adapter = backend.check_model(parsed.model)
            ids = backend.input_ids(parsed)
            sampling = backend.sampling(parsed, len(ids))
            generation = state["generation"] = backend.start(parsed, ids, sampling, adapter)
            first = await _next_event(generation, request)
            if first.kind == "error" and first.error is not None:
                raise first.error
        except ApiError as exc:
            log(exc.status, f" error={exc.code or exc.type}")
            return _error(exc)
        cid, created = new_id("chatcmpl" if kind == "chat" else "cmpl"), now()
        if not parsed.stream:
            try:
                body = await _collect(backend, parsed, generation, first, cid, created, request)
            except ApiError as exc:
                log(exc.status, f" error={exc.code or exc.type}")
                return _error(exc)
            log(200)
            return JSONResponse(body, headers={EVENTS_HEADER: str(backend.events_count)})

        def on_close(finished: bool) -> None:
            generation.cancel()
            log(200, " stream" if finished else " stream cancelled")

        return EventStream(_events(backend, parsed, generation, first, cid, created), on_close,
                           {EVENTS_HEADER: str(backend.events_count)})

    async def not_found(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        message = "no such route" if status == 404 else ("method not allowed" if status == 405 else "error")
        return _error(ApiError(status, f"{message}: {request.method} {request.url.path}", code=None))

    routes = [
        Route("/", index), Route("/static/{name}", static),
        Route("/v1/models", models), Route("/v1/models/{model:path}", model),
        Route("/v1/chat/completions", chat, methods=["POST"]), Route("/v1/completions", completions, methods=["POST"]),
        Route("/distconf/verification", verification),
    ]
    middleware = [] if allowed_hosts is None else [Middleware(TrustedHostMiddleware, allowed_hosts=list(allowed_hosts))]
    return Starlette(routes=routes, middleware=middleware, exception_handlers={HTTPException: not_found})


async def _collect(backend: Backend, request: Any, generation: Generation, first: Event, cid: str, created: int,
                   http: Request) -> dict[str, Any]:
    """The whole (non-streamed) answer."""
    pieces: dict[int, list[Any]] = {i: [] for i in range(request.n)}
    choices = []
    event = first
    while event.kind != "done":
        if event.kind == "error" and event.error is not None:
            raise event.error
        if event.kind == "piece":
            pieces[event.index].append(event.piece)
        elif event.kind == "end" and event.stream is not None:
            got = pieces[event.index]
            choice: dict[str, Any] = {"index": event.index, "text": "".join(p.text for p in got),
                                      "finish_reason": event.stream.finish_reason or "stop"}
            if request.logprobs:
                choice["logprobs"] = (shapes.chat_logprobs if request.kind == "chat"
                                      else shapes.completion_logprobs)(backend.tokenizer, got)
            choices.append(choice)
        event = await _next_event(generation, http)
    use = shapes.usage(generation.prompt_tokens, sum(s.completion_tokens for s in generation.streams))
    build = shapes.chat_completion if request.kind == "chat" else shapes.text_completion
    return build(cid, created, request.model, choices, use)


async def _events(backend: Backend, request: Any, generation: Generation, first: Event, cid: str,
                  created: int) -> AsyncIterator[bytes]:
    """The stream's server-sent events, ending with ``data: [DONE]``."""
    chat = request.kind == "chat"
    model, started, offsets = request.model, set(), dict.fromkeys(range(request.n), 0)
    event = first
    while event.kind != "done":
        if event.kind == "error" and event.error is not None:
            yield shapes.sse(event.error.body)
            break
        index = event.index
        if chat and index not in started:
            started.add(index)
            yield shapes.sse(shapes.chat_chunk(cid, created, model, index, {"role": "assistant", "content": ""}))
        if event.kind == "piece" and event.piece is not None and (event.piece.text or request.logprobs):
            piece = event.piece
            if chat:
                lp = shapes.chat_logprobs(backend.tokenizer, [piece]) if request.logprobs else None
                yield shapes.sse(shapes.chat_chunk(cid, created, model, index, {"content": piece.text}, logprobs=lp))
            else:
                lp = (shapes.completion_logprobs(backend.tokenizer, [piece], offsets[index])
                      if request.logprobs else None)
                offsets[index] += len(piece.text)
                yield shapes.sse(shapes.completion_chunk(cid, created, model, index, piece.text, logprobs=lp))
        elif event.kind == "end" and event.stream is not None:
            reason = event.stream.finish_reason or "stop"
            yield shapes.sse(shapes.chat_chunk(cid, created, model, index, {}, reason) if chat
                             else shapes.completion_chunk(cid, created, model, index, "", reason))
        event = await generation.queue.get()
    if request.include_usage:
        use = shapes.usage(generation.prompt_tokens, sum(s.completion_tokens for s in generation.streams))
        yield shapes.sse(shapes.usage_chunk(cid, created, model, request.kind, use))
    yield shapes.DONE
