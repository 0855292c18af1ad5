"""The OTLP/gRPC receiver (metrics, traces and logs services) of the sink.

It is grpcio's asyncio server on an event loop of its own (not the receivers' loop, which serves OTLP/HTTP):
a request of up to `INLINE_BYTES` is decoded and handed to the router right in its handler, on that loop; a
larger one on one of `LARGE_THREADS` threads, so that it holds up the loop's other requests for at most the
decode of `INLINE_BYTES`. A request never waits: a run whose backends are behind is held in its spool, or
refused at once with UNAVAILABLE and a RetryInfo (`otel_train.sink.runs.router`), so `/health` and other runs'
requests are always served.

Why this shape: grpcio's threaded server hands every request from its polling thread to a handler thread and
back, and under load that cost ~0.25 ms of CPU per request more than the request's own work. The asyncio server
on a loop of its own runs the handler where the request arrived: `bench/sink.py --compare` wrote 1.17x more
points/s at 1 step x 100 gauges per request (4 senders, 2 cores) and as many at 10 steps. (On the receivers'
shared loop, with every decode sent to a thread, it had cost more than the threaded server.)

Handlers take the raw request bytes (no deserializer registered), so a malformed payload is
answered INVALID_ARGUMENT with the reason instead of grpcio's generic INTERNAL.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from otel_train.sink.receive.event_loop import LoopThread

if TYPE_CHECKING:
    from otel_train.sink.receive.ingest import SinkCore as Sink

__all__ = ["INLINE_BYTES", "GrpcReceiver", "start_grpc"]

_logger = logging.getLogger(__name__)

_METRICS_SERVICE = "opentelemetry.proto.collector.metrics.v1.MetricsService"
_TRACE_SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"
_LOGS_SERVICE = "opentelemetry.proto.collector.logs.v1.LogsService"
#: Requests up to this size are decoded on the receiver's loop (~2,500 points: a few ms); larger ones on a thread.
INLINE_BYTES = 256 * 1024
#: Threads that decode the larger requests.
LARGE_THREADS = 2
_PROTOBUF = "application/x-protobuf"


def _handler(sink: Sink, signal: str, large: ThreadPoolExecutor) -> Any:
    import grpc

    from otel_train.sink.decode.otlp import rpc_status
    from otel_train.sink.receive.answer import success_body
    from otel_train.sink.receive.ingest import DecodeError, Overloaded

    async def export(body: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        # `abort` raises: nothing after it runs.
        if sink.token is not None:
            auth = ""
            for key, value in context.invocation_metadata() or ():
                if key == "authorization":
                    auth = value if isinstance(value, str) else value.decode("latin-1")
            if not sink.token_ok(auth):
                sink.count_rejected("unauthenticated")
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong `authorization: Bearer` token")
        limit = sink.settings.max_body_bytes
        if len(body) > limit:  # gRPC's own limit is twice ours, so that this refusal is counted
            sink.count_rejected("too_large", f"{len(body)} bytes")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"message of {len(body)} bytes exceeds the "
                                f"limit of {limit} bytes")
        try:
            if len(body) <= INLINE_BYTES:
                answer = sink.ingest(signal, body, _PROTOBUF, None)
            else:
                answer = await asyncio.get_running_loop().run_in_executor(large, sink.ingest, signal, body, _PROTOBUF,
                                                                          None)
            return success_body(signal, answer, protobuf=True)
        except DecodeError as err:
            sink.count_rejected("invalid", str(err))
            code, message = grpc.StatusCode.INVALID_ARGUMENT, str(err)
        except OverflowError as err:
            sink.count_rejected("too_large", str(err))
            code, message = grpc.StatusCode.RESOURCE_EXHAUSTED, str(err)
        except Overloaded as err:
            sink.count_rejected("overloaded", str(err))
            # The retry hint as OTLP senders read it: a google.rpc.Status with RetryInfo in the trailers.
            status = rpc_status(grpc.StatusCode.UNAVAILABLE.value[0], str(err), err.retry_after_s)
            context.set_trailing_metadata((("grpc-status-details-bin", status),))
            code, message = grpc.StatusCode.UNAVAILABLE, str(err)
        except Exception as err:  # never take the receiver down for one request
            sink.count_rejected("internal")
            _logger.exception("gRPC %s export failed", signal)
            code, message = grpc.StatusCode.INTERNAL, f"{type(err).__name__}: {err}"
        await context.abort(code, message)  # outside the `except`: the abort is not chained to the error
        raise AssertionError("unreachable: abort raises")

    return grpc.unary_unary_rpc_method_handler(export)


class GrpcReceiver:
    """A started grpcio asyncio server on an event loop (and thread) of its own.

    Keep a reference: a gRPC server that nobody references stops serving.
    """

    def __init__(self, sink: Sink, address: str, max_message_bytes: int, tls_cert: bytes | None = None,
                 tls_key: bytes | None = None) -> None:
        import grpc

        options = [
            # Twice ours: a message up to that size reaches the handler, which refuses and counts it;
            # only a larger one is refused by gRPC itself, before the sink can see (or count) it.
            ("grpc.max_receive_message_length", 2 * max_message_bytes),
            ("grpc.so_reuseport", 0),  # a second sink on the same port must fail, not share it
        ]
        self._large = ThreadPoolExecutor(LARGE_THREADS, thread_name_prefix="otel-train-sink-grpc-large")
        self._loop = LoopThread("otel-train-sink-grpc")

        async def start() -> tuple[Any, int]:
            server = grpc.aio.server(options=options)
            server.add_generic_rpc_handlers((
                grpc.method_handlers_generic_handler(_METRICS_SERVICE,
                                                     {"Export": _handler(sink, "metrics", self._large)}),
                grpc.method_handlers_generic_handler(_TRACE_SERVICE, {"Export": _handler(sink, "traces", self._large)}),
                grpc.method_handlers_generic_handler(_LOGS_SERVICE, {"Export": _handler(sink, "logs", self._large)}),
            ))
            try:
                if tls_cert is not None and tls_key is not None:
                    port = server.add_secure_port(address, grpc.ssl_server_credentials([(tls_key, tls_cert)]))
                else:
                    port = server.add_insecure_port(address)
            except RuntimeError as err:  # grpcio raises when it cannot bind
                raise OSError(f"cannot bind the OTLP/gRPC receiver to {address}: {err}") from None
            if port == 0:
                raise OSError(f"cannot bind the OTLP/gRPC receiver to {address}")
            await server.start()
            return server, int(port)

        try:
            self._server, self.port = self._loop.run(start(), timeout_s=30.0)
        except BaseException:
            self._close_threads()
            raise

    def stop(self, grace_s: float | None = None) -> None:
        """Stop accepting and let requests in flight finish for up to `grace_s`."""
        try:
            self._loop.run(self._server.stop(grace_s), timeout_s=(grace_s or 0.0) + 10.0)
        except Exception:
            _logger.exception("stopping the OTLP/gRPC receiver failed")
        self._close_threads()

    def _close_threads(self) -> None:
        self._loop.close()
        self._large.shutdown(wait=False, cancel_futures=True)


def start_grpc(sink: Sink, loop: LoopThread, address: str, max_message_bytes: int, tls_cert: bytes | None = None,
               tls_key: bytes | None = None) -> tuple[GrpcReceiver, int]:
    """Bind and start the gRPC receiver; return it (keep a reference) and its port. `loop`, the receivers'
    event loop, is not used: the gRPC receiver has a loop of its own.

    Raises:
        OSError: the address cannot be bound.
    """
    del loop
    receiver = GrpcReceiver(sink, address, max_message_bytes, tls_cert, tls_key)
    return receiver, receiver.port
