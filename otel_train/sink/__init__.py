"""otel_train.sink (being built)."""
