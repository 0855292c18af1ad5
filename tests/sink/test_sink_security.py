"""Token, size limits, malformed payloads and TLS: each gets its error and the sink stays up."""

from __future__ import annotations

import datetime
import gzip
import http.client
import json
import socket
import ssl
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from sinkkit import make_sink, metrics_data, scalars

_METHOD = "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export"


def _request_bytes(run_id: str = "sec", steps: range = range(2)) -> bytes:
    from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics

    return bytes(encode_metrics(metrics_data(run_id, 0, 1, steps)).SerializeToString())


def _grpc_call(port: int, body: bytes, token: str | None = None) -> Any:
    import grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(_METHOD)
        metadata = [("authorization", f"Bearer {token}")] if token else None
        try:
            call(body, metadata=metadata, timeout=10)
            return grpc.StatusCode.OK, ""
        except grpc.RpcError as err:
            return err.code(), err.details()


def _http(port: int, body: bytes, headers: dict[str, str], path: str = "/v1/metrics") -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("POST", path, body=body, headers={"Content-Type": "application/x-protobuf", **headers})
    resp = conn.getresponse()
    out = resp.status, resp.read()
    conn.close()
    return out


def _status_message(body: bytes) -> str:
    from google.rpc import status_pb2

    return str(status_pb2.Status.FromString(body).message)


def test_token_garbage_truncated_and_oversized(tmp_path: Path) -> None:
    import grpc

    sink = make_sink(tmp_path, token="s3cret", max_body_bytes=1 << 20)
    try:
        good = _request_bytes()
        auth = {"Authorization": "Bearer s3cret"}
        # token: missing / wrong -> 401 / UNAUTHENTICATED; /health stays open, /runs does not
        assert _http(sink.http_port, good, {})[0] == 401
        code, body = _http(sink.http_port, good, {"Authorization": "Bearer nope"})
        assert code == 401 and "token" in _status_message(body)
        assert _grpc_call(sink.grpc_port, good)[0] == grpc.StatusCode.UNAUTHENTICATED
        assert _grpc_call(sink.grpc_port, good, "nope")[0] == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(urllib.error.HTTPError, match="401"):
            urllib.request.urlopen(f"http://127.0.0.1:{sink.http_port}/runs", timeout=5)
        # garbage and truncated protobuf -> 400 / INVALID_ARGUMENT with a message
        code, body = _http(sink.http_port, b"\xff\x00garbage" * 10, auth)
        assert code == 400 and "invalid OTLP protobuf" in _status_message(body)
        assert _grpc_call(sink.grpc_port, good[: len(good) // 2], "s3cret")[0] == grpc.StatusCode.INVALID_ARGUMENT
        code, body = _http(sink.http_port, good[:-3], auth)
        assert code == 400
        code, body = _http(sink.http_port, b"{not json", {**auth, "Content-Type": "application/json"})
        assert code == 400 and json.loads(body)["message"].startswith("invalid JSON")
        # 50 MB: refused before reading (HTTP) / by the message limit (gRPC)
        conn = http.client.HTTPConnection("127.0.0.1", sink.http_port, timeout=10)
        conn.putrequest("POST", "/v1/metrics")
        for k, v in {**auth, "Content-Type": "application/x-protobuf", "Content-Length": str(50 << 20)}.items():
            conn.putheader(k, v)
        conn.endheaders()
        resp = conn.getresponse()
        assert resp.status == 413 and b"exceeds the limit" in resp.read()
        conn.close()
        code, _ = _grpc_call(sink.grpc_port, b"\x0a" + b"\x00" * (50 << 20), "s3cret")
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        bomb = gzip.compress(b"\x00" * (4 << 20))  # 4 MiB of zeros in a few KiB
        code, body = _http(sink.http_port, bomb, {**auth, "Content-Encoding": "gzip"})
        assert code == 413
        # still up, nothing half-written; a good request (gzip too) goes through
        assert _http(sink.http_port, gzip.compress(good), {**auth, "Content-Encoding": "gzip"})[0] == 200
        assert _grpc_call(sink.grpc_port, _request_bytes("sec2"), "s3cret")[0] == grpc.StatusCode.OK
        assert sink.flush(10)
        assert sink.router.points_in == 8
        assert sink.rejected == {"unauthenticated": 5, "invalid": 4, "too_large": 2}
        with urllib.request.urlopen(f"http://127.0.0.1:{sink.http_port}/health", timeout=5) as resp:
            assert json.loads(resp.read())["status"] == "ok"
    finally:
        sink.stop()
    assert scalars(tmp_path / "runs" / "sec")["train/loss"] == [(0, 0.0), (1, 1.0)]


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def test_tls_on_both_protocols(tmp_path: Path) -> None:
    import grpc

    cert, key = _self_signed(tmp_path)
    sink = make_sink(tmp_path, tls_cert=cert, tls_key=key)
    try:
        ctx = ssl.create_default_context(cafile=str(cert))
        stalled = socket.create_connection(("127.0.0.1", sink.http_port))  # never handshakes
        conn = http.client.HTTPSConnection("127.0.0.1", sink.http_port, context=ctx, timeout=10)
        conn.request("POST", "/v1/metrics", body=_request_bytes("tls-http"),
                     headers={"Content-Type": "application/x-protobuf"})
        assert conn.getresponse().status == 200  # not held up by the stalled client
        conn.close()
        stalled.close()
        creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        with grpc.secure_channel(f"localhost:{sink.grpc_port}", creds) as channel:
            channel.unary_unary(_METHOD)(_request_bytes("tls-grpc"), timeout=10)
        with pytest.raises(grpc.RpcError), grpc.insecure_channel(f"127.0.0.1:{sink.grpc_port}") as channel:
            channel.unary_unary(_METHOD)(_request_bytes("plain"), timeout=2)
        assert sink.flush(10)
        assert {r["run_id"] for r in sink.router.summary()["runs"]} == {"tls-http", "tls-grpc"}
    finally:
        sink.stop()


def test_backends_far_behind_get_retry_later_and_the_sink_stays_up(tmp_path: Path) -> None:
    """Backpressure: when a run's queue stays full (its backend hangs), gRPC answers UNAVAILABLE and
    HTTP 503 (OTLP senders retry those); /health keeps answering; once the backend moves again,
    every accepted request is written and new ones are taken."""
    import threading

    import grpc

    from otel_train.sink import Sink
    from otel_train.sink.settings import SinkSettings
    from otel_train.testing import InMemoryRowExporter

    release = threading.Event()

    class Stuck(InMemoryRowExporter):
        def write_metrics(self, rows: Any, histograms: Any) -> None:
            release.wait(30)
            super().write_metrics(rows, histograms)

    backend = Stuck()
    sink = Sink(SinkSettings(grpc="127.0.0.1:0", http="127.0.0.1:0"), lambda: [backend])
    # No spool (memory only) and a short queue, so that the test does not take the default 256 requests.
    sink.router._queue_windows = 2
    sink.start()
    try:
        codes = [_grpc_call(sink.grpc_port, _request_bytes("bp", range(i, i + 1)))[0] for i in range(6)]
        assert codes[:3] == [grpc.StatusCode.OK] * 3  # one in the backend, two queued
        assert grpc.StatusCode.UNAVAILABLE in codes[3:]
        status, body = _http(sink.http_port, _request_bytes("bp", range(9, 10)), {})
        assert status == 503 and "retry" in _status_message(body)
        with urllib.request.urlopen(f"http://127.0.0.1:{sink.http_port}/health", timeout=5) as resp:
            assert json.load(resp)["status"] == "ok"
        release.set()
        assert sink.flush(10)
        assert _grpc_call(sink.grpc_port, _request_bytes("bp", range(20, 21)))[0] == grpc.StatusCode.OK
        assert sink.flush(10)
    finally:
        release.set()
        sink.stop()
    accepted = sum(1 for c in codes if c == grpc.StatusCode.OK) + 1
    steps = sorted({row.step for row in backend.metrics if row.name == "train/loss"})
    assert len(steps) == accepted and steps[-1] == 20
