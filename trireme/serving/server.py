"""`trireme serve`: an OpenAI-compatible HTTP server over the serving engine (docs/serving.md).

FastAPI (on Starlette) routes the requests and uvicorn serves them: both are well kept, async
(a streamed answer is a generator, a slow client costs a task, not a thread), and uvicorn drains
connections on SIGTERM. Bodies are parsed by trireme.serving.openai_api rather than by
FastAPI's models, so that every malformed request gets the OpenAI error shape and a 400.

The engine steps on its own thread (trireme.serving.runner); a handler submits its request
and awaits outputs that the engine thread puts on the handler's asyncio queue. The event loop
thread and the engine thread share Python's lock, so the engine thread hands outputs over in
bursts, as often as a bounded share of the loop's time allows (OutputRelay), a whole answer's
text is gathered on the engine thread (its handler wakes once, when it is done), and a stream
sends the text waiting for it as one event.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from trireme.data.chat import ChatFormat
from trireme.serving.engine import QueueFull, RequestError
from trireme.serving.image_parts import MAX_IMAGE_PIXELS, VisionInputs
from trireme.serving.openai_api import (
    Answer,
    ApiError,
    ParsedRequest,
    parse_chat,
    parse_completion,
)
from trireme.serving.runner import EngineThread
from trireme.serving.scheduler import RequestOutput

POLL_S = 0.5  # how often a waiting handler checks that its client is still there
RETRY_AFTER_S = 1  # a 429's Retry-After header (seconds)
DRAIN_MARGIN_S = 1.0  # the engine's requests end this long before uvicorn's drain runs out
LOOP_SHARE = 0.25  # OutputRelay: the event loop's share of the time for answers, at most about
MAX_PAUSE_S = 0.05  # OutputRelay: the longest pause between deliveries (after a GC pause, say)


IMAGE_DECODES = 2  # chat requests whose images are decoded at once (the rest wait their turn)


@dataclass
class ServerSettings:
    model_name: str
    api_key: str = ""
    max_body_bytes: int = 4 * 1024 * 1024
    max_image_pixels: int = MAX_IMAGE_PIXELS  # a vision model's largest image (decoded)


def error_response(error: ApiError) -> JSONResponse:
    headers = ({"Retry-After": str(RETRY_AFTER_S)} if error.status == 429 else
               {"WWW-Authenticate": "Bearer"} if error.status == 401 else None)
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


async def http_error(request: Request, error: HTTPException) -> JSONResponse:
    """Starlette's own errors (an unknown path: 404, a wrong method: 405) in the OpenAI shape."""
    kind = {404: "not_found_error", 405: "invalid_request_error"}.get(error.status_code,
                                                                     "invalid_request_error")
    message = f"{request.method} {request.url.path}: {error.detail}"
    return JSONResponse(ApiError(error.status_code, message, kind=kind).body(),
                        status_code=error.status_code, headers=error.headers)


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
    app.add_exception_handler(HTTPException, http_error)
    app.add_api_route("/health", api.health, methods=["GET", "HEAD"])
    app.add_api_route("/metrics", api.metrics, methods=["GET"])
    app.add_api_route("/v1/models", api.models, methods=["GET"])
    app.add_api_route("/v1/models/{model:path}", api.model, methods=["GET"])
    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", api.chat_completions, methods=["POST"])
    return app


class OpenAIServer:
    """The endpoints (module docstring), over one engine thread."""

    def __init__(self, runner: EngineThread, chat: ChatFormat, settings: ServerSettings) -> None:
        self.runner, self.chat, self.settings = runner, chat, settings
        self.engine = runner.engine
        self.relay: OutputRelay | None = None  # made on the event loop, at the first request
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

    def _model_card(self) -> dict:
        return {"id": self.settings.model_name, "object": "model", "created": 0,
                "owned_by": "trireme", "max_model_len": self.engine.cfg.seq_length}

    async def models(self, request: Request) -> Response:
        check_key(request, self.settings.api_key)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request, model: str) -> Response:
        check_key(request, self.settings.api_key)
        if model != self.settings.model_name:
            raise ApiError(404, f"no model {model!r} here; this server serves "
                           f"{self.settings.model_name!r}", "model", "model_not_found",
                           kind="not_found_error")
        return JSONResponse(self._model_card())

    async def completions(self, request: Request) -> Response:
        check_key(request, self.settings.api_key)
        body = await read_json(request, self.settings.max_body_bytes)
        # on a worker thread: tokenizing a long prompt must not hold up the other requests
        parsed = await asyncio.to_thread(parse_completion, body, self.engine.tokenizer)
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
        """Queue the request in the engine; its outputs arrive on the returned asyncio queue:
        a stream's one by one, a whole answer's as one output at the end (its whole text)."""
        loop = asyncio.get_running_loop()
        if self.relay is None or self.relay.loop is not loop:
            self.relay = OutputRelay(loop)
        relay, queue = self.relay, asyncio.Queue()
        if parsed.stream:
            def put(out: RequestOutput) -> None:  # called on the engine thread
                relay.put(queue, out)
        else:
            pieces: list[str] = []

            def put(out: RequestOutput) -> None:  # (the engine thread): the text at the end
                pieces.append(out.text)
                if out.finished:
                    relay.put(queue, replace(out, text="".join(pieces)))

        if not self.runner.alive:
            raise ApiError(503, "the server is shutting down", kind="server_error")
        if parsed.open_ended:  # no max tokens asked for: as many as the context and pool hold
            room = max(self.engine.room(len(parsed.prompt_ids)), 1)
            parsed.params = replace(parsed.params, max_tokens=min(parsed.params.max_tokens, room))
        try:
            submitted = self.runner.submit(parsed.prompt_ids, parsed.params, put, parsed.images)
        except QueueFull as e:
            raise ApiError(429, str(e), code="queue_full", kind="rate_limit_error") from None
        except RequestError as e:
            raise ApiError(400, str(e), e.param, e.code) from None
        return submitted.request_id, queue

    async def answer(self, request: Request, parsed: ParsedRequest, shape: Answer) -> Response:
        request_id, queue = self.submit(parsed)
        if parsed.stream:
            events = self.stream_events(queue, request_id, parsed.include_usage, shape)
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        last = None
        try:
            while last is None:  # one output: the whole text (submit)
                try:
                    last = await asyncio.wait_for(queue.get(), POLL_S)
                except TimeoutError:
                    if await request.is_disconnected():
                        self.runner.cancel(request_id)
                        return Response(status_code=499)
        except asyncio.CancelledError:
            self.runner.cancel(request_id)
            raise
        if last.finish_reason not in ("stop", "length"):
            raise ended_early(last.finish_reason)
        return JSONResponse(shape.whole(last.text, last.finish_reason, last.prompt_tokens,
                                        last.completion_tokens))

    async def stream_events(self, queue: asyncio.Queue, request_id: str, include_usage: bool,
                            shape: Answer) -> AsyncIterator[str]:
        """Server-sent events of one answer, ending with `data: [DONE]`."""
        finished = False
        try:
            if shape.chat:
                yield sse(shape.chunk(None, first=True))
            while not finished:
                # the outputs waiting now go out as one event (their texts joined) in one
                # write: each write costs the event loop (and so the engine thread, which
                # shares Python's lock) far more than its bytes do
                outputs = [await queue.get()]
                while not queue.empty():
                    outputs.append(queue.get_nowait())
                last = outputs[-1]  # (a request's finished output is its last)
                finished = last.finished
                text = "".join(out.text for out in outputs)
                events = []
                if last.finish_reason not in (None, "stop", "length"):
                    if text:
                        events.append(sse(shape.chunk(text)))
                    events.append(sse(ended_early(last.finish_reason).body()))
                else:
                    if text or finished:
                        events.append(sse(shape.chunk(text, last.finish_reason)))
                    if finished and include_usage:
                        events.append(sse(shape.usage_chunk(last.prompt_tokens,
                                                            last.completion_tokens)))
                if events:
                    yield "".join(events)
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away (or the server is stopping)
                self.runner.cancel(request_id)


class OutputRelay:
    """Hands the engine thread's outputs to the event loop's queues in bursts, and keeps the
    loop's share of the time bounded.

    The first output of a burst schedules one call on the loop (a write to its wake-up pipe),
    which delivers every output put until it runs, in order: a step's outputs for 64 requests
    wake the loop once. After a delivery the loop measures what it cost (putting the outputs on
    their queues and the woken streams writing them: each write runs through the ASGI stack,
    tens of microseconds) and delivers again no sooner than LOOP_SHARE of the time allows
    (after (1 / LOOP_SHARE - 1) x that cost, MAX_PAUSE_S at most). With few streams a delivery
    costs microseconds and every token goes out as it comes; with many, each delivery carries
    several tokens per stream (written as one event), and the engine thread, which needs the
    same Python lock to step, keeps most of the time.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, clock=time.perf_counter) -> None:
        self.loop, self.clock = loop, clock
        self.lock = threading.Lock()
        self.waiting: list[tuple[asyncio.Queue, RequestOutput]] = []
        self.scheduled = False  # a delivery is on its way (under the lock)
        self.not_before = 0.0  # (clock) no delivery before this; set on the loop

    def put(self, queue: asyncio.Queue, out: RequestOutput) -> None:
        """Any thread: `out` goes on `queue`, on the loop, soon."""
        with self.lock:
            self.waiting.append((queue, out))
            if self.scheduled:
                return
            self.scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._schedule)
        except RuntimeError:  # the loop is closed: nobody is listening
            pass

    def _schedule(self) -> None:
        wait = self.not_before - self.clock()
        if wait > 0:
            self.loop.call_later(wait, self.deliver)
        else:
            self.deliver()

    def deliver(self) -> None:
        start = self.clock()
        with self.lock:
            waiting, self.waiting, self.scheduled = self.waiting, [], False
        for queue, out in waiting:
            queue.put_nowait(out)  # (wakes the queue's reader: it runs after this call)
        self.loop.call_soon(self._delivered, start)  # after the woken readers' steps

    def _delivered(self, start: float) -> None:
        now = self.clock()
        self.not_before = now + min((now - start) * (1 / LOOP_SHARE - 1), MAX_PAUSE_S)


def ended_early(reason: str) -> ApiError:
    """The error of a request the engine ended: the server stopping (cancelled: 503), or a
    failed step (error: 500, the cause in the server's log)."""
    if reason == "cancelled":
        return ApiError(503, "the server stopped before the request finished",
                        kind="server_error")
    return ApiError(500, f"the request ended with {reason} (the server's log says why)",
                    kind="server_error")


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def check_key(request: Request, api_key: str) -> None:
    """401 unless the request carries `Authorization: Bearer <api_key>` (when one is set)."""
    if not api_key:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    # the header as sent (HTTP headers arrive as latin-1 text), against the key's UTF-8 bytes
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode("latin-1"),
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
    except (ValueError, RecursionError) as e:  # also: bad UTF-8, a 5,000-digit number, depth
        raise ApiError(400, f"the request body is not valid JSON ({str(e)[:200]})") from None


class DrainingServer(uvicorn.Server):
    """uvicorn's server, which on SIGTERM / SIGINT also ends the engine's requests
    DRAIN_MARGIN_S before its graceful shutdown gives up (`drain_s`): each then gets an answer
    (a 503, or a stream's error event and [DONE]) rather than a cancelled task. A second
    signal ends them at once, with the same answers, and the drain completes; only a third
    is uvicorn's forced exit (tasks cancelled, connections cut)."""

    def __init__(self, config: uvicorn.Config, runner: EngineThread, drain_s: float) -> None:
        super().__init__(config)
        self.runner, self.drain_s = runner, drain_s
        self.drain_timer: threading.Timer | None = None
        self.cut_short = False

    def run(self, sockets=None) -> None:
        try:
            super().run(sockets=sockets)
        finally:  # a drain that ended in time: its cut-off must not fire later
            if self.drain_timer is not None:
                self.drain_timer.cancel()

    def handle_exit(self, sig, frame) -> None:
        if self.drain_timer is None:  # the first signal: drain
            cutoff = max(self.drain_s - DRAIN_MARGIN_S, self.drain_s / 2)
            self.drain_timer = threading.Timer(cutoff, self.runner.shutdown)
            self.drain_timer.daemon = True
            self.drain_timer.start()
        elif not self.cut_short:  # the second: end the requests now (off the event loop,
            self.cut_short = True  # which must stay free to send their answers)
            self.drain_timer.cancel()
            threading.Thread(target=self.runner.shutdown, daemon=True).start()
            return
        super().handle_exit(sig, frame)
