"""otel_train.integrations (being built)."""
