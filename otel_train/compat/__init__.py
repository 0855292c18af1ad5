"""otel_train.compat (being built)."""
