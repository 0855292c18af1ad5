"""Implementation details; nothing here is public API."""
