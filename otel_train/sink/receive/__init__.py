"""The sink's receivers: OTLP/gRPC and OTLP/HTTP on one event loop, the old Metrics Service API, and the
ingest entry point they share (auth, counters, health).
"""
