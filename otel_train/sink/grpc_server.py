"""The OTLP/gRPC receiver (metrics and traces services) of the sink.

It is grpcio's server with its handlers on `THREADS` threads of its own (not on the receivers' event loop,
which serves OTLP/HTTP): a request is decoded and handed to the router on the thread that received it. A
request never waits: a run whose backends are behind is held in its spool, or refused at once with
UNAVAILABLE and a RetryInfo (`otel_train.sink.router`), so `/health` and other runs' requests are always
served. grpcio's asyncio server cost more per request than the rest of the sink's work on a request of
100 points, and one thread leaves the second core idle while that thread waits on a system call (the spool's
write, grpc's own I/O): with four, `bench/sink.py` writes 1.05-1.2x more points/s (4 senders, 2 cores).
Decoding and the router are safe to run on several threads at once (per-run locks, `Router`).

Handlers take the raw request bytes (no deserializer registered), so a malformed payload is
answered INVALID_ARGUMENT with the reason instead of grpcio's generic INTERNAL.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from otel_train.sink.core import SinkCore as Sink
    from otel_train.sink.event_loop import LoopThread

__all__ = ["GrpcReceiver", "start_grpc"]

_logger = logging.getLogger(__name__)

_METRICS_SERVICE = "opentelemetry.proto.collector.metrics.v1.MetricsService"
_TRACE_SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"
#: Threads that receive and decode gRPC requests.
THREADS = 4


def _handler(sink: Sink, signal: str) -> Any:
    import grpc

    from otel_train.sink.core import DecodeError, Overloaded
    from otel_train.sink.otlp import rpc_status

    def export(body: bytes, context: grpc.ServicerContext) -> bytes:  # `abort` raises: nothing after it runs
        if sink.token is not None:
            auth = ""
            for key, value in context.invocation_metadata() or ():
                if key == "authorization":
                    auth = value if isinstance(value, str) else value.decode("latin-1")
            if not sink.token_ok(auth):
                sink.count_rejected("unauthenticated")
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong `authorization: Bearer` token")
        limit = sink.settings.max_body_bytes
        if len(body) > limit:  # gRPC's own limit is twice ours, so that this refusal is counted
            sink.count_rejected("too_large", f"{len(body)} bytes")
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"message of {len(body)} bytes exceeds the "
                          f"limit of {limit} bytes")
        try:
            sink.ingest(signal, body, "application/x-protobuf", None)
        except DecodeError as err:
            sink.count_rejected("invalid", str(err))
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except OverflowError as err:
            sink.count_rejected("too_large", str(err))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))
        except Overloaded as err:
            sink.count_rejected("overloaded", str(err))
            # The retry hint as OTLP senders read it: a google.rpc.Status with RetryInfo in the trailers.
            status = rpc_status(grpc.StatusCode.UNAVAILABLE.value[0], str(err), err.retry_after_s)
            context.set_trailing_metadata((("grpc-status-details-bin", status),))
            context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
        except Exception as err:  # never take the receiver down for one request
            sink.count_rejected("internal")
            _logger.exception("gRPC %s export failed", signal)
            context.abort(grpc.StatusCode.INTERNAL, f"{type(err).__name__}: {err}")
        return b""

    return grpc.unary_unary_rpc_method_handler(export)


class GrpcReceiver:
    """A started grpcio server, its handlers on `THREADS` threads of its own.

    Keep a reference: a gRPC server that nobody references stops serving.
    """

    def __init__(self, sink: Sink, address: str, max_message_bytes: int, tls_cert: bytes | None = None,
                 tls_key: bytes | None = None) -> None:
        from concurrent.futures import ThreadPoolExecutor

        import grpc

        options = [
            # Twice ours: a message up to that size reaches the handler, which refuses and counts it;
            # only a larger one is refused by gRPC itself, before the sink can see (or count) it.
            ("grpc.max_receive_message_length", 2 * max_message_bytes),
            ("grpc.so_reuseport", 0),  # a second sink on the same port must fail, not share it
        ]
        self._server = grpc.server(ThreadPoolExecutor(THREADS, thread_name_prefix="otel-train-sink-grpc"),
                                   options=options)
        self._server.add_generic_rpc_handlers((
            grpc.method_handlers_generic_handler(_METRICS_SERVICE, {"Export": _handler(sink, "metrics")}),
            grpc.method_handlers_generic_handler(_TRACE_SERVICE, {"Export": _handler(sink, "traces")}),
        ))
        try:
            if tls_cert is not None and tls_key is not None:
                port = self._server.add_secure_port(address, grpc.ssl_server_credentials([(tls_key, tls_cert)]))
            else:
                port = self._server.add_insecure_port(address)
        except RuntimeError as err:  # grpcio raises when it cannot bind
            raise OSError(f"cannot bind the OTLP/gRPC receiver to {address}: {err}") from None
        if port == 0:
            raise OSError(f"cannot bind the OTLP/gRPC receiver to {address}")
        self._server.start()
        self.port = int(port)

    def stop(self, grace_s: float | None = None) -> None:
        """Stop accepting and let requests in flight finish for up to `grace_s`."""
        try:
            self._server.stop(grace_s).wait((grace_s or 0.0) + 10.0)
        except Exception:
            _logger.exception("stopping the OTLP/gRPC receiver failed")


def start_grpc(sink: Sink, loop: LoopThread, address: str, max_message_bytes: int, tls_cert: bytes | None = None,
               tls_key: bytes | None = None) -> tuple[GrpcReceiver, int]:
    """Bind and start the gRPC receiver; return it (keep a reference) and its port. `loop`, the receivers'
    event loop, is not used: the gRPC receiver has threads of its own.

    Raises:
        OSError: the address cannot be bound.
    """
    del loop
    receiver = GrpcReceiver(sink, address, max_message_bytes, tls_cert, tls_key)
    return receiver, receiver.port
