"""otel-train (under construction)."""
