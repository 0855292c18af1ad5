"""The OTLP/gRPC receiver (metrics and traces services) of the sink.

Handlers take the raw request bytes (no deserializer registered), so a malformed payload is
answered INVALID_ARGUMENT with the reason instead of grpcio's generic INTERNAL.
"""

from __future__ import annotations

import hmac
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from otel_train.sink.service import Sink

__all__ = ["start_grpc"]

_logger = logging.getLogger(__name__)

_METRICS_SERVICE = "opentelemetry.proto.collector.metrics.v1.MetricsService"
_TRACE_SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"


def _handler(sink: Sink, signal: str) -> Any:
    import grpc

    from otel_train.sink.decode import DecodeError
    from otel_train.sink.router import Overloaded

    def export(body: bytes, context: grpc.ServicerContext) -> bytes:
        if sink.token is not None:
            auth = ""
            for key, value in context.invocation_metadata():
                if key == "authorization":
                    auth = value if isinstance(value, str) else value.decode("latin-1")
            if not sink.token_ok(auth):
                sink.count_rejected("unauthenticated")
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong `authorization: Bearer` token")
        try:
            sink.ingest(signal, body, "application/x-protobuf", None)
        except DecodeError as err:
            sink.count_rejected("invalid")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except Overloaded as err:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
        except Exception as err:  # never crash the server thread on one request
            sink.count_rejected("internal")
            _logger.exception("gRPC %s export failed", signal)
            context.abort(grpc.StatusCode.INTERNAL, f"{type(err).__name__}: {err}")
        return b""  # an empty Export*ServiceResponse: full success

    return grpc.unary_unary_rpc_method_handler(export)  # raw bytes in and out


def start_grpc(sink: Sink, address: str, max_message_bytes: int, tls_cert: bytes | None = None,
               tls_key: bytes | None = None, workers: int = 8) -> tuple[Any, int]:
    """Bind and start the gRPC server; return it (keep a reference: it stops when collected) and its port."""
    import grpc

    options = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),  # a second sink on the same port must fail, not share it
    ]
    server = grpc.server(ThreadPoolExecutor(max_workers=workers, thread_name_prefix="otel-train-sink-grpc"),
                         options=options)
    server.add_generic_rpc_handlers((
        grpc.method_handlers_generic_handler(_METRICS_SERVICE, {"Export": _handler(sink, "metrics")}),
        grpc.method_handlers_generic_handler(_TRACE_SERVICE, {"Export": _handler(sink, "traces")}),
    ))
    if tls_cert is not None and tls_key is not None:
        port = server.add_secure_port(address, grpc.ssl_server_credentials([(tls_key, tls_cert)]))
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind the OTLP/gRPC receiver to {address}")
    server.start()
    return server, port


def token_matches(expected: str, header: str) -> bool:
    """Constant-time check of an ``authorization: Bearer <token>`` value."""
    scheme, _, given = header.strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), expected.encode())
