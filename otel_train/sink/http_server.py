"""The sink's HTTP server: OTLP/HTTP (protobuf and JSON), `/health`, `/runs` and the compat API."""

from __future__ import annotations

import json
import logging
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

if TYPE_CHECKING:
    from otel_train.sink.core import SinkCore as Sink

__all__ = ["start_http"]

_logger = logging.getLogger(__name__)

_OTLP_PATHS = {"/v1/metrics": "metrics", "/v1/traces": "traces"}
_GRPC_CODES = {400: 3, 401: 16, 413: 8, 503: 14, 500: 13}  # google.rpc.Code of each HTTP error


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    sink: Sink
    tls: Any = None  # ssl.SSLContext when serving HTTPS

    def get_request(self) -> tuple[Any, Any]:
        sock, addr = self.socket.accept()
        if self.tls is not None:
            # The handshake runs in the request's thread (`_Handler.setup`), so a client that
            # connects and stalls cannot block the accept loop.
            sock = self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, addr

    def handle_error(self, request: Any, client_address: Any) -> None:
        _logger.debug("HTTP connection from %s failed: %r", client_address, sys.exc_info()[1])


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server
    server_version = "otel-train-sink"
    timeout = 60  # seconds a connection may stay silent (slow or stuck clients free their thread)

    def setup(self) -> None:
        if self.server.tls is not None:
            self.request.settimeout(self.timeout)
            self.request.do_handshake()
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:
        _logger.debug("%s " + format, self.address_string(), *args)

    # -- responses -----------------------------------------------------------------------------
    def _send(self, code: int, body: bytes, content_type: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, code: int, doc: Any) -> None:
        self._send(code, json.dumps(doc, default=str).encode(), "application/json")

    def _otlp_error(self, code: int, message: str, protobuf: bool) -> None:
        """An OTLP error: a `google.rpc.Status` in the request's encoding."""
        if protobuf:
            try:
                from google.rpc import status_pb2

                body = status_pb2.Status(code=_GRPC_CODES.get(code, 2), message=message).SerializeToString()
                self._send(code, body, "application/x-protobuf")
                return
            except ImportError:
                pass
        self._json(code, {"code": _GRPC_CODES.get(code, 2), "message": message})

    # -- plumbing ------------------------------------------------------------------------------
    def _authorized(self) -> bool:
        sink = self.server.sink
        if sink.token is None or sink.token_ok(self.headers.get("Authorization", "")):
            return True
        sink.count_rejected("unauthenticated")
        return False

    def _read_body(self) -> bytes | None:
        """The body, or None after answering 411/413 (the connection is then closed unread)."""
        sink = self.server.sink
        length_raw = self.headers.get("Content-Length")
        if length_raw is None or not length_raw.strip().isdigit():
            sink.count_rejected("length_required", f"{self.command} {self.path} without Content-Length")
            self.close_connection = True
            self._json(411, {"code": 3, "message": "a Content-Length header is required"})
            return None
        length = int(length_raw)
        if length > sink.settings.max_body_bytes:
            sink.count_rejected("too_large", f"{length} bytes")
            self.close_connection = True
            self._json(413, {"code": 8, "message": f"body of {length} bytes exceeds the limit of "
                                                   f"{sink.settings.max_body_bytes} bytes"})
            return None
        return self.rfile.read(length)

    # -- verbs ---------------------------------------------------------------------------------
    def do_GET(self) -> None:
        url = urlsplit(self.path)
        sink = self.server.sink
        if url.path == "/health":
            self._json(200, sink.health())
            return
        if not self._authorized():
            self._json(401, {"code": 16, "message": "missing or wrong `authorization: Bearer` token"})
            return
        if url.path == "/runs":
            self._json(200, sink.runs())
        elif url.path.startswith("/metrics/"):
            code, doc = sink.compat.handle("GET", url.path, parse_qs(url.query), None)
            self._json(code, doc)
        else:
            self._json(404, {"code": 5, "message": f"no route {url.path}"})

    def do_POST(self) -> None:
        from otel_train.sink.core import DecodeError, Overloaded

        url = urlsplit(self.path)
        sink = self.server.sink
        ctype = self.headers.get("Content-Type", "application/x-protobuf")
        protobuf = "json" not in ctype.lower()
        signal = _OTLP_PATHS.get(url.path)
        if signal is None and not url.path.startswith("/metrics/"):
            sink.count_rejected("not_found", f"POST {url.path}")
            self.close_connection = True
            self._json(404, {"code": 5, "message": f"no route {url.path}"})
            return
        if not self._authorized():
            self.close_connection = True
            self._otlp_error(401, "missing or wrong `authorization: Bearer` token", protobuf)
            return
        body = self._read_body()
        if body is None:
            return
        if signal is None:
            code, doc = sink.compat.handle("POST", url.path, parse_qs(url.query), body)
            self._json(code, doc)
            return
        try:
            sink.ingest(signal, body, ctype, self.headers.get("Content-Encoding"))
        except DecodeError as err:
            sink.count_rejected("invalid", str(err))
            self._otlp_error(400, str(err), protobuf)
            return
        except OverflowError as err:
            sink.count_rejected("too_large", str(err))
            self._otlp_error(413, str(err), protobuf)
            return
        except Overloaded as err:
            sink.count_rejected("overloaded", str(err))
            self._otlp_error(503, str(err), protobuf)
            return
        except Exception as err:  # one bad request must never take the server down
            sink.count_rejected("internal")
            _logger.exception("HTTP %s export failed", signal)
            self._otlp_error(500, f"{type(err).__name__}: {err}", protobuf)
            return
        if protobuf:
            self._send(200, b"", "application/x-protobuf")  # empty Export*ServiceResponse
        else:
            self._send(200, b"{}", "application/json")


def start_http(sink: Sink, address: str, tls_cert: str | None = None,
               tls_key: str | None = None) -> tuple[ThreadingHTTPServer, threading.Thread, int]:
    """Bind and start the HTTP server on a thread; return (server, thread, port)."""
    host, _, port = address.rpartition(":")
    server = _Server((host.strip("[]"), int(port)), _Handler)
    server.sink = sink
    if tls_cert and tls_key:
        import ssl

        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(tls_cert, tls_key)
        server.tls = ctx
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                              name="otel-train-sink-http", daemon=True)
    thread.start()
    return server, thread, server.server_address[1]
