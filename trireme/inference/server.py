"""`trireme serve`: an OpenAI-compatible HTTP server over the serving engine (docs/serving.md).

FastAPI (on Starlette) routes the requests and uvicorn serves them: both are well kept, async
(a streamed answer is a generator, a slow client costs a task, not a thread), and uvicorn drains
connections on SIGTERM. Bodies are parsed by trireme.inference.openai_api rather than by
FastAPI's models, so that every malformed request gets the OpenAI error shape and a 400.

The engine steps on its own thread (trireme.inference.runner); a handler submits its request
and awaits outputs that the engine thread puts on the handler's asyncio queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from trireme.inference.chat import ChatFormat
from trireme.inference.engine import QueueFull, RequestError
from trireme.inference.image_parts import MAX_IMAGE_PIXELS, VisionInputs
from trireme.inference.openai_api import (
    Answer,
    ApiError,
    ParsedRequest,
    parse_chat,
    parse_completion,
)
from trireme.inference.runner import EngineThread
from trireme.inference.scheduler import RequestOutput

POLL_S = 0.5  # how often a waiting handler checks that its client is still there


IMAGE_DECODES = 2  # chat requests whose images are decoded at once (the rest wait their turn)


@dataclass
class ServerSettings:
    model_name: str
    api_key: str = ""
    max_body_bytes: int = 4 * 1024 * 1024
    max_image_pixels: int = MAX_IMAGE_PIXELS  # a vision model's largest image (decoded)


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def build_app(runner: EngineThread, chat: ChatFormat, settings: ServerSettings) -> FastAPI:
    """The ASGI app; its lifespan starts the engine thread and stops it at shutdown."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        runner.start()
        yield
        runner.shutdown()

    app = FastAPI(title="trireme", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    api = OpenAIServer(runner, chat, settings)
    app.add_exception_handler(ApiError, api.error)
    app.add_api_route("/health", api.health, methods=["GET"])
    app.add_api_route("/metrics", api.metrics, methods=["GET"])
    app.add_api_route("/v1/models", api.models, methods=["GET"])
    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", api.chat_completions, methods=["POST"])
    return app


class OpenAIServer:
    """The endpoints (module docstring), over one engine thread."""

    def __init__(self, runner: EngineThread, chat: ChatFormat, settings: ServerSettings) -> None:
        self.runner, self.chat, self.settings = runner, chat, settings
        self.engine = runner.engine
        self.vision = VisionInputs.of(self.engine.cfg, settings.max_image_pixels)
        self.decodes = asyncio.Semaphore(IMAGE_DECODES)  # image decodes at once (chat requests)

    async def error(self, request: Request, error: ApiError) -> JSONResponse:
        return error_response(error)

    async def health(self) -> Response:
        if not self.runner.alive:
            return JSONResponse({"status": "stopping"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics(self) -> Response:
        return PlainTextResponse(self.runner.metrics_text(self.settings.model_name),
                                 media_type="text/plain; version=0.0.4")

    async def models(self, request: Request) -> Response:
        check_key(request, self.settings.api_key)
        return JSONResponse({"object": "list", "data": [
            {"id": self.settings.model_name, "object": "model", "created": 0,
             "owned_by": "trireme", "max_model_len": self.engine.cfg.seq_length}]})

    async def completions(self, request: Request) -> Response:
        check_key(request, self.settings.api_key)
        body = await read_json(request, self.settings.max_body_bytes)
        parsed = parse_completion(body, self.engine.tokenizer)
        return await self.answer(request, parsed, Answer(self.settings.model_name, chat=False))

    async def chat_completions(self, request: Request) -> Response:
        check_key(request, self.settings.api_key)
        body = await read_json(request, self.settings.max_body_bytes)
        # on a worker thread: decoding an image must not hold up the other requests' streams;
        # for a vision model, only after a queue check and at most IMAGE_DECODES at once (each
        # holds a decoded image's memory)
        if self.vision is not None:
            self.check_queue()
        async with self.decodes if self.vision is not None else contextlib.nullcontext():
            parsed = await asyncio.to_thread(parse_chat, body, self.engine.tokenizer, self.chat,
                                             self.engine.cfg.seq_length, self.vision)
        return await self.answer(request, parsed, Answer(self.settings.model_name, chat=True))

    def check_queue(self) -> None:
        """A 429 now if the engine's queue is full (submit checks again, under the lock)."""
        if len(self.engine.scheduler.waiting) >= self.engine.settings.max_queue:
            raise ApiError(429, f"the queue holds {self.engine.settings.max_queue} waiting "
                           "requests (--max-queue); retry later", code="queue_full",
                           kind="rate_limit_error")

    def submit(self, parsed: ParsedRequest) -> tuple[str, asyncio.Queue]:
        """Queue the request in the engine; its outputs arrive on the returned asyncio queue."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def put(out: RequestOutput) -> None:  # called on the engine thread
            if not loop.is_closed():
                loop.call_soon_threadsafe(queue.put_nowait, out)

        if not self.runner.alive:
            raise ApiError(503, "the server is shutting down", kind="server_error")
        try:
            submitted = self.runner.submit(parsed.prompt_ids, parsed.params, put, parsed.images)
        except QueueFull as e:
            raise ApiError(429, str(e), code="queue_full", kind="rate_limit_error") from None
        except RequestError as e:
            code = "context_length_exceeded" if "context" in str(e) else None
            raise ApiError(400, str(e), "prompt" if code else None, code) from None
        return submitted.request_id, queue

    async def answer(self, request: Request, parsed: ParsedRequest, shape: Answer) -> Response:
        request_id, queue = self.submit(parsed)
        if parsed.stream:
            events = self.stream_events(queue, request_id, parsed.include_usage, shape)
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        text, last = [], None
        try:
            while last is None or not last.finished:
                try:
                    last = await asyncio.wait_for(queue.get(), POLL_S)
                    text.append(last.text)
                except TimeoutError:
                    if await request.is_disconnected():
                        self.runner.cancel(request_id)
                        return Response(status_code=499)
        except asyncio.CancelledError:
            self.runner.cancel(request_id)
            raise
        if last.finish_reason not in ("stop", "length"):
            raise ApiError(500, f"the request ended with {last.finish_reason}",
                           kind="server_error")
        return JSONResponse(shape.whole("".join(text), last.finish_reason, last.prompt_tokens,
                                        last.completion_tokens))

    async def stream_events(self, queue: asyncio.Queue, request_id: str, include_usage: bool,
                            shape: Answer) -> AsyncIterator[str]:
        """Server-sent events of one answer, ending with `data: [DONE]`."""
        finished = False
        try:
            if shape.chat:
                yield sse(shape.chunk(None, first=True))
            while not finished:
                out = await queue.get()
                finished = out.finished
                if out.finish_reason not in (None, "stop", "length"):
                    error = ApiError(500, f"the request ended with {out.finish_reason}",
                                     kind="server_error")
                    yield sse(error.body())
                    break
                if out.text or finished:
                    yield sse(shape.chunk(out.text, out.finish_reason))
                if finished and include_usage:
                    yield sse(shape.usage_chunk(out.prompt_tokens, out.completion_tokens))
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away (or the server is stopping)
                self.runner.cancel(request_id)


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def check_key(request: Request, api_key: str) -> None:
    """401 unless the request carries `Authorization: Bearer <api_key>` (when one is set)."""
    if not api_key:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                             api_key.encode()):
        raise ApiError(401, "missing or wrong API key (send Authorization: Bearer KEY)",
                       code="invalid_api_key", kind="authentication_error")


async def read_json(request: Request, limit: int):
    """The parsed JSON body; 413 past `limit` bytes, 400 if it is not JSON."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body has {declared} bytes; the limit is {limit} "
                       "(--max-body-bytes)", code="body_too_large")
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > limit:
            raise ApiError(413, f"the request body is over the limit of {limit} bytes "
                           "(--max-body-bytes)", code="body_too_large")
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({e})") from None
