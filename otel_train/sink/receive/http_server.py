"""The sink's HTTP server: OTLP/HTTP (protobuf and JSON), `/health`, `/runs`, `/runs/<run id>/hangs` and the
compat API.

It is aiohttp's server on the receivers' event loop (shared with OTLP/gRPC): HTTP/1.1 keep-alive,
chunked bodies (the OTel JavaScript exporters send them), slow clients and TLS handshakes are
aiohttp's and asyncio's work, not a thread per connection. Bodies are limited before they are
buffered (a declared `Content-Length` over the limit is answered 413 unread; a chunked body stops
at the limit), and gzip is inflated by the decoder with the same limit (aiohttp's own inflation is
off, so a small gzip bomb cannot grow in memory).

Slow clients cannot lock senders out (`_Connections`): a new connection must send its first request's headers
within `header_timeout_s`, and at the connection cap a new connection closes the oldest one that has not sent a
whole request (with a token: an authorized one), else the oldest idle one between requests; only when every
connection is in a request is the new one turned away.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

from otel_train.sink.receive.answer import success_body

if TYPE_CHECKING:
    from aiohttp import web

    from otel_train.sink.receive.event_loop import LoopThread
    from otel_train.sink.receive.ingest import SinkCore as Sink

__all__ = ["HttpReceiver", "start_http"]

_logger = logging.getLogger(__name__)

_OTLP_PATHS = {"/v1/metrics": "metrics", "/v1/traces": "traces", "/v1/logs": "logs"}
_GRPC_CODES = {400: 3, 401: 16, 404: 5, 405: 12, 413: 8, 503: 14, 500: 13}  # google.rpc.Code of each error
_UNAUTHORIZED = "missing or wrong `authorization: Bearer` token"


def _json(code: int, doc: Any, close: bool = False) -> web.Response:
    from aiohttp import web

    resp = web.Response(status=code, body=json.dumps(doc, default=str).encode(), content_type="application/json")
    if close:
        resp.force_close()
    return resp


def _otlp_error(code: int, message: str, protobuf: bool, close: bool = False,
                retry_after_s: float | None = None) -> web.Response:
    """An OTLP error: a `google.rpc.Status` in the request's encoding (with a ``Retry-After`` header when
    the sender should retry later: the OTLP/HTTP spec's throttling hint)."""
    from aiohttp import web

    from otel_train.sink.decode.otlp import rpc_status

    headers = {"Retry-After": str(max(1, math.ceil(retry_after_s)))} if retry_after_s is not None else None
    if protobuf:
        body = rpc_status(_GRPC_CODES.get(code, 2), message, retry_after_s)
        resp = web.Response(status=code, body=body, content_type="application/x-protobuf", headers=headers)
    else:
        resp = web.json_response({"code": _GRPC_CODES.get(code, 2), "message": message}, status=code,
                                 headers=headers)
    if close:
        resp.force_close()
    return resp


class _Refused(asyncio.Protocol):
    """A connection over `max_connections`: closed at once, before a byte is read."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()


class _Conn:
    """What the server knows of one open connection (touched on the event loop only)."""

    __slots__ = ("authorized", "busy", "requests", "since", "transport")

    def __init__(self, since: float, transport: asyncio.BaseTransport) -> None:
        self.since = since
        self.transport = transport
        self.requests = 0  # requests whose headers arrived
        self.busy = 0  # requests being answered now
        self.authorized = False  # a request passed the token check (any request, without a token)


class _Connections:
    """The open connections of aiohttp's protocol factory (`web.Server`), told by its `connection_made` /
    `connection_lost`; makes room at the cap and closes connections that send no headers in time."""

    def __init__(self, handlers: Any, sink: Sink, cap: int, header_timeout_s: float) -> None:
        self._handlers = handlers
        self._sink = sink
        self.cap = cap
        self.header_timeout_s = header_timeout_s
        self.open: dict[Any, _Conn] = {}
        # Protocols handed out whose connection is not made yet (asyncio accepts a burst, then makes each).
        self._accepting: dict[Any, float] = {}
        self._doomed: dict[Any, float] = {}  # such protocols closed to make room as soon as they are made
        made, lost = handlers.connection_made, handlers.connection_lost

        def connection_made(handler: Any, transport: asyncio.Transport) -> None:
            made(handler, transport)
            self._accepting.pop(handler, None)
            if self._doomed.pop(handler, None) is not None:
                transport.close()
                return
            loop = asyncio.get_running_loop()
            self.open[handler] = _Conn(loop.time(), transport)
            loop.call_later(header_timeout_s, self._headers_due, handler)

        def connection_lost(handler: Any, exc: BaseException | None) -> None:
            self.open.pop(handler, None)
            lost(handler, exc)

        handlers.connection_made = connection_made
        handlers.connection_lost = connection_lost

    def _headers_due(self, handler: Any) -> None:
        conn = self.open.get(handler)
        if conn is not None and conn.requests == 0:
            self._sink.count_rejected("header_timeout", f"no request headers within {self.header_timeout_s:g} s")
            self._close(handler, conn)

    def _close(self, handler: Any, conn: _Conn) -> None:
        self.open.pop(handler, None)
        conn.transport.close()

    def protocol(self) -> asyncio.Protocol:
        """aiohttp's protocol for a new connection, after making room at the cap; `_Refused` without room."""
        now = asyncio.get_running_loop().time()
        if len(self._accepting) + len(self._doomed) > 64:  # a connection that failed before it was made is never told
            self._accepting = {h: t for h, t in self._accepting.items() if now - t < 10.0}
            self._doomed = {h: t for h, t in self._doomed.items() if now - t < 10.0}
        if len(self.open) + len(self._accepting) >= self.cap and not self._make_room():
            self._sink.count_rejected("too_many_connections", f"{self.cap} open, every one in a request")
            return _Refused()
        handler = self._handlers()
        self._accepting[handler] = now
        return handler  # type: ignore[no-any-return]

    def _make_room(self) -> bool:
        """Close the oldest connection that has sent no whole (authorized) request, else the oldest idle one."""
        idle = [(conn.authorized, conn.since, id(handler), handler) for handler, conn in self.open.items()
                if conn.busy == 0]
        idle += [(False, since, id(handler), handler) for handler, since in self._accepting.items()]  # nothing sent
        if not idle:
            return False
        authorized, _, _, handler = min(idle)
        self._sink.count_rejected("connection_closed_for_room", "idle connection closed at the connection cap"
                                  if authorized else "connection without a whole request closed at the cap")
        conn = self.open.get(handler)
        if conn is not None:
            self._close(handler, conn)
        else:
            self._doomed[handler] = self._accepting.pop(handler)
        return True

    def request(self, protocol: Any) -> _Conn | None:
        """A request's headers arrived on `protocol`'s connection."""
        conn = self.open.get(protocol)
        if conn is not None:
            conn.requests += 1
            if self._sink.token is None:
                conn.authorized = True
        return conn


class HttpReceiver:
    """A started aiohttp server on the receivers' event loop; `stop()` closes it."""

    def __init__(self, sink: Sink, loop: LoopThread, address: str, tls_cert: str | None = None,
                 tls_key: str | None = None) -> None:
        self._sink = sink
        self._loop = loop
        self._runner: Any = None
        self._conns: _Connections
        self._server: Any = None
        self.port = loop.run(self._start(address, tls_cert, tls_key), 60)

    async def _start(self, address: str, tls_cert: str | None, tls_key: str | None) -> int:
        from aiohttp import web

        app = web.Application(client_max_size=self._sink.settings.max_body_bytes)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        # lingering_time: after answering a request whose body was not read (413, 408), read and drop what
        # the client still sends for 1 s (so it sees the answer), not aiohttp's 10 s.
        self._runner = web.AppRunner(app, handle_signals=False, access_log=None, auto_decompress=False,
                                     keepalive_timeout=75.0, lingering_time=1.0)
        await self._runner.setup()
        ssl_context = None
        if tls_cert and tls_key:
            import ssl

            ssl_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ssl_context.load_cert_chain(tls_cert, tls_key)
        host, _, port = address.rpartition(":")
        self._conns = _Connections(self._runner.server, self._sink, self._sink.max_connections,
                                   self._sink.settings.header_timeout_s)
        try:
            self._server = await asyncio.get_running_loop().create_server(
                self._conns.protocol, host.strip("[]") or None, int(port), ssl=ssl_context, reuse_address=True)
        except OSError:
            await self._runner.cleanup()
            raise
        return int(self._server.sockets[0].getsockname()[1])

    async def _close(self) -> None:
        if self._server is not None:  # stop accepting; `cleanup` then closes the open connections
            self._server.close()
        await self._runner.cleanup()

    def stop(self) -> None:
        if self._runner is not None and self._loop.loop.is_running():
            try:
                self._loop.run(self._close(), 15.0)
            except Exception:
                _logger.exception("stopping the OTLP/HTTP receiver failed")

    # -- requests --------------------------------------------------------------------------------
    def _authorized(self, request: web.Request) -> bool:
        sink = self._sink
        if sink.token is None or sink.token_ok(request.headers.get("Authorization", "")):
            conn = self._conns.open.get(request.protocol)
            if conn is not None:
                conn.authorized = True
            return True
        sink.count_rejected("unauthenticated", f"{request.method} {request.path} from {request.remote}")
        return False

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        conn = self._conns.request(request.protocol)
        if conn is None:
            return await self._answer(request)
        conn.busy += 1
        try:
            return await self._answer(request)
        finally:
            conn.busy -= 1

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        if request.method in ("GET", "HEAD"):
            return self._get(request)
        if request.method == "POST":
            return await self._post(request)
        self._sink.count_rejected("method_not_allowed", f"{request.method} {request.path}")
        return _json(405, {"code": 12, "message": f"method {request.method} not allowed; use GET or POST"})

    def _get(self, request: web.Request) -> web.StreamResponse:
        sink = self._sink
        path = request.path
        if path == "/health":
            return _json(200, sink.health())
        if not self._authorized(request):
            return _json(401, {"code": 16, "message": _UNAUTHORIZED})
        if path == "/runs":
            return _json(200, sink.runs())
        if path.startswith("/runs/") and path.endswith("/hangs") and len(path) > len("/runs//hangs"):
            run_id = path[len("/runs/"):-len("/hangs")]
            doc = sink.run_hangs(run_id)
            if doc is None:
                sink.count_rejected("not_found", f"GET {path[:200]}")
                return _json(404, {"code": 5, "message": f"no run {run_id[:200]!r} heard from (or it was dropped after "
                                   "its idle time); see GET /runs"})
            return _json(200, doc)
        if path.startswith("/metrics/"):
            return self._compat("GET", request, None)
        sink.count_rejected("not_found", f"GET {path}")
        return _json(404, {"code": 5, "message": f"no route {path}"})

    def _compat(self, method: str, request: web.Request, body: bytes | None) -> web.StreamResponse:
        code, doc = self._sink.compat.handle(method, request.path, parse_qs(request.query_string), body)
        if code == 503:  # a backlogged run: refused at once, nothing lost; the sender retries after the hint
            self._sink.count_rejected("overloaded", str(doc.get("message", "")))
            resp = _json(code, doc)
            resp.headers["Retry-After"] = str(max(1, math.ceil(float(doc.get("retry_after_s", 1)))))
            return resp
        if code >= 400:
            self._sink.count_rejected(f"compat_{code}", f"{method} {request.path}: {doc.get('message', '')}")
        return _json(code, doc)

    async def _post(self, request: web.Request) -> web.StreamResponse:
        from aiohttp import web

        from otel_train.sink.receive.ingest import DecodeError, Overloaded

        sink = self._sink
        path = request.path
        ctype = request.headers.get("Content-Type", "application/x-protobuf")
        protobuf = "json" not in ctype.lower()
        signal = _OTLP_PATHS.get(path)
        if signal is None and not path.startswith("/metrics/"):
            sink.count_rejected("not_found", f"POST {path}")
            return _json(404, {"code": 5, "message": f"no route {path}"}, close=True)
        if not self._authorized(request):
            return _otlp_error(401, _UNAUTHORIZED, protobuf, close=True)
        limit = sink.settings.max_body_bytes
        too_large = f"exceeds the limit of {limit} bytes"
        length = request.content_length
        if length is not None and length > limit:  # refused before reading a byte of it
            sink.count_rejected("too_large", f"{length} bytes")
            return _json(413, {"code": 8, "message": f"body of {length} bytes {too_large}"}, close=True)
        timeout_s = sink.settings.body_timeout_s
        try:
            body = await asyncio.wait_for(request.read(), timeout_s)
        except web.HTTPRequestEntityTooLarge:  # a chunked body that grew past the limit
            sink.count_rejected("too_large", "chunked body")
            return _json(413, {"code": 8, "message": f"body {too_large}"}, close=True)
        except asyncio.TimeoutError:  # a body trickled in: the connection is not held for ever
            sink.count_rejected("body_timeout", f"POST {path} from {request.remote}")
            return _json(408, {"code": 4, "message": f"the body did not arrive within {timeout_s:g} s"}, close=True)
        if signal is None:
            return self._compat("POST", request, body)
        try:
            answer = await sink.ingest_async(signal, body, ctype, request.headers.get("Content-Encoding"))
        except DecodeError as err:
            sink.count_rejected("invalid", str(err))
            return _otlp_error(400, str(err), protobuf)
        except OverflowError as err:
            sink.count_rejected("too_large", str(err))
            return _otlp_error(413, str(err), protobuf)
        except Overloaded as err:
            sink.count_rejected("overloaded", str(err))
            return _otlp_error(503, str(err), protobuf, retry_after_s=err.retry_after_s)
        except Exception as err:  # one bad request must never take the server down
            sink.count_rejected("internal", repr(err))
            _logger.exception("HTTP %s export failed", signal)
            return _otlp_error(500, f"{type(err).__name__}: {err}", protobuf)
        return web.Response(status=200, body=success_body(signal, answer, protobuf),
                            content_type="application/x-protobuf" if protobuf else "application/json")


def start_http(sink: Sink, loop: LoopThread, address: str, tls_cert: str | None = None,
               tls_key: str | None = None) -> tuple[HttpReceiver, int]:
    """Bind and start the HTTP server on the receivers' loop; return it and its port.

    Raises:
        OSError: the address cannot be bound.
    """
    receiver = HttpReceiver(sink, loop, address, tls_cert, tls_key)
    return receiver, receiver.port
