"""The OpenAI-compatible HTTP API of the orchestrator process (Starlette app served by uvicorn).

Owns: the routes ``POST /v1/completions``, ``POST /v1/chat/completions``
(server-sent events when ``stream`` is true), ``GET /v1/models`` and
``GET /health``; forwarding each caller's ``Authorization: Bearer`` token to
Generate (so HTTP needs exactly the tokens gRPC does); mapping gRPC status
codes to HTTP statuses and OpenAI error objects; and ``HttpApiServer``, which
serves the app on its own port from a thread of the orchestrator process.

Every call goes through the public async gRPC client (``aio_client``) to the
orchestrator's own port on loopback, so this module depends on the Generate
RPC only, never on the orchestrator's internals.

Must not know: scheduling, workers, tensors. Body validation and response
shapes live in ``openai_api``; the chat template in ``chat``.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from functools import partial
from typing import Any, AsyncIterator, Callable

import structlog
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from orchestrator.aio_client import AsyncSpecsplitClient
from orchestrator.chat import NoChatTemplate, render_chat
from orchestrator.client import SpecsplitError
from orchestrator.openai_api import (FINISH_REASONS, ApiError, CompletionParams, SpecStats, StopMatcher, bad,
                                     chunk_body, completion_body, now, parse_chat, parse_completion)

log = structlog.get_logger("http_api")

GENERATE_TIMEOUT_S = 3600.0        # deadline of one Generate call made for an HTTP request
STATUS_TIMEOUT_S = 10.0            # deadline of GetStatus / health calls
START_TIMEOUT_S = 30.0             # HttpApiServer.start waits this long for uvicorn to accept connections
MAX_BODY_BYTES = 8 * 1024 * 1024


def _error_response(err: ApiError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def _token(request: Request) -> str | None:
    header = request.headers.get("authorization")
    if header is None:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(401, "the Authorization header must be 'Bearer <token>'", "authentication_error")
    return token.strip()


async def _body(request: Request) -> Any:
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
    try:
        return json.loads(raw or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad(f"the request body is not valid JSON: {exc}") from None


class _Generation:
    """One Generate call seen as text pieces (cut at stop sequences) plus statistics."""

    def __init__(self, client: AsyncSpecsplitClient, params: CompletionParams, request_id: str) -> None:
        self.events = client.generate(params.prompt, request_id=request_id, timeout=GENERATE_TIMEOUT_S,
                                      **params.generate_kwargs())
        self.matcher = StopMatcher(params.stop)
        self.stats = SpecStats(request_id=request_id)
        if isinstance(params.prompt, tuple):
            self.stats.prompt_tokens = len(params.prompt)
        self.finish = "stop"
        self._first: Any = None

    async def start(self) -> None:
        """Wait for the first event, so a refused request still gets a proper HTTP status."""
        try:
            self._first = await anext(self.events)
        except StopAsyncIteration:
            raise ApiError(500, "the Generate stream ended without a message", "server_error") from None
        except SpecsplitError as exc:
            await self.events.aclose()
            raise ApiError.from_grpc(exc.code.name, exc.details) from None

    async def pieces(self) -> AsyncIterator[str]:
        """Text to send, in order; afterwards ``finish`` and ``stats`` are final. Raises ApiError."""
        seen, ev = "", self._first
        try:
            while True:
                if ev.final:
                    self.stats.set_final(ev)
                    # NOTE: the final event repeats the whole text; only a tail the chunks did
                    # not carry (bytes the incremental decoder held back) is new.
                    tail = ev.text[len(seen):] if ev.text.startswith(seen) else ""
                    out = self.matcher.feed(tail)
                    out += self.matcher.flush()
                    if out:
                        yield out
                    self.finish = "stop" if self.matcher.stopped else FINISH_REASONS.get(
                        ev.finish_reason or "", ev.finish_reason or "stop")
                    return
                seen += ev.text
                self.stats.add_chunk(ev)
                out = self.matcher.feed(ev.text)
                if out:
                    yield out
                if self.matcher.stopped:          # leaving cancels the call: its slots are freed
                    self.finish = "stop"
                    return
                try:
                    ev = await anext(self.events)
                except StopAsyncIteration:
                    raise ApiError(500, "the Generate stream ended without a final message", "server_error") \
                        from None
        except SpecsplitError as exc:
            raise ApiError.from_grpc(exc.code.name, exc.details) from None
        finally:
            await self.events.aclose()


def _sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


class Api:
    """The route handlers over one async client (created in the server's event loop)."""

    def __init__(self, grpc_address: str, model_name: str, render: Callable[[list[dict[str, Any]]], str]) -> None:
        self.grpc_address, self.model_name, self.render = grpc_address, model_name, render
        self.client: AsyncSpecsplitClient | None = None
        self.created = now()

    async def open(self) -> None:
        self.client = AsyncSpecsplitClient(self.grpc_address, timeout=STATUS_TIMEOUT_S)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()

    def app(self) -> Starlette:
        from contextlib import asynccontextmanager

        @asynccontextmanager
        async def lifespan(_app: Starlette):
            await self.open()
            try:
                yield
            finally:
                await self.close()

        return Starlette(routes=[
            Route("/v1/completions", partial(self.generate, chat=False), methods=["POST"]),
            Route("/v1/chat/completions", partial(self.generate, chat=True), methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
        ], lifespan=lifespan)

    async def health(self, _request: Request) -> Response:
        """200 when the orchestrator's gRPC health is SERVING, else 503 with the status."""
        assert self.client is not None
        try:
            status = await self.client.health(timeout=STATUS_TIMEOUT_S)
        except SpecsplitError as exc:
            status = f"{exc.code.name}: {exc.details}"
        return JSONResponse({"status": status}, status_code=200 if status == "SERVING" else 503)

    async def models(self, _request: Request) -> Response:
        """The one served model (open, like GetStatus); ``specsplit`` carries its weights version."""
        assert self.client is not None
        try:
            status = await self.client.status(timeout=STATUS_TIMEOUT_S)
        except SpecsplitError as exc:
            return _error_response(ApiError.from_grpc(exc.code.name, exc.details))
        version = (status.get("orchestrator") or {}).get("weights_version", "")
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "specsplit",
             "specsplit": {"weights_version": version}}]})

    async def generate(self, request: Request, chat: bool) -> Response:
        assert self.client is not None
        try:
            client = self.client.with_token(_token(request))
            body = await _body(request)
            try:
                params = (parse_chat(body, self.model_name, self.render) if chat
                          else parse_completion(body, self.model_name))
            except NoChatTemplate as exc:
                raise bad(str(exc), "messages") from None
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            gen = _Generation(client, params, rid)
            await gen.start()
        except ApiError as err:
            return _error_response(err)
        created = now()
        if params.stream:
            return StreamingResponse(self._stream(gen, params, rid, created, chat), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            text = "".join([piece async for piece in gen.pieces()])
        except ApiError as err:
            return _error_response(err)
        return JSONResponse(completion_body(rid, self.model_name, created, text, gen.finish, gen.stats, chat))

    async def _stream(self, gen: _Generation, params: CompletionParams, rid: str, created: int,
                      chat: bool) -> AsyncIterator[bytes]:
        model = self.model_name
        if chat:
            yield _sse(chunk_body(rid, model, created, "", None, chat, first=True))
        try:
            async for piece in gen.pieces():
                yield _sse(chunk_body(rid, model, created, piece, None, chat))
        except ApiError as err:
            # NOTE: the HTTP status is already sent: the error travels as an event (the openai
            # SDK raises it), and the stream ends without [DONE].
            yield _sse(err.body())
            return
        last = chunk_body(rid, model, created, None, gen.finish, chat)
        last["specsplit"] = gen.stats.extension()
        yield _sse(last)
        if params.include_usage:
            yield _sse({"id": rid, "object": last["object"], "created": created, "model": model, "choices": [],
                        "usage": gen.stats.usage(), "specsplit": gen.stats.extension()})
        yield b"data: [DONE]\n\n"


def loopback_address(host: str, port: int) -> str:
    """Where this process reaches its own gRPC port bound on ``host``."""
    h = host.strip("[]")
    if h in ("", "0.0.0.0"):
        return f"127.0.0.1:{port}"
    if h == "::":
        return f"[::1]:{port}"
    return f"[{h}]:{port}" if ":" in h else f"{h}:{port}"


class HttpApiServer:
    """The app served by uvicorn on ``host:port`` (0 picks) from a daemon thread of this process."""

    def __init__(self, host: str, port: int, grpc_address: str, model_name: str, tokenizer: str,
                 render: Callable[[str, list[dict[str, Any]]], str] = render_chat) -> None:
        h = host.strip("[]") or "0.0.0.0"
        self.sock = socket.socket(socket.AF_INET6 if ":" in h else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((h, port))
        except OSError as exc:
            self.sock.close()
            raise OSError(f"cannot listen on {host}:{port} for the HTTP API: {exc.strerror or exc}") from None
        self.host, self.port = host, self.sock.getsockname()[1]
        api = Api(grpc_address, model_name, partial(render, tokenizer))
        self.server = uvicorn.Server(uvicorn.Config(api.app(), log_config=None, access_log=False,
                                                    log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, name="http-api",
                                       daemon=True)

    def start(self) -> "HttpApiServer":
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.server.started:          # bounded: uvicorn sets `started` once it accepts
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP API did not start on {self.host}:{self.port}")
            time.sleep(0.01)
        log.info("http_api_serving", address=f"{self.host}:{self.port}")
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop accepting, let open responses end (bounded), close the gRPC channel."""
        self.server.should_exit = True
        self.thread.join(timeout)
        if self.thread.is_alive():
            self.server.force_exit = True
            self.thread.join(5.0)
        self.sock.close()


def start_http_api(host: str, http_port: int, grpc_port: int, model_name: str, tokenizer: str) -> HttpApiServer:
    """Serve the HTTP API on ``host:http_port`` in front of the orchestrator's gRPC ``grpc_port``."""
    return HttpApiServer(host, http_port, loopback_address(host, grpc_port), model_name, tokenizer).start()
