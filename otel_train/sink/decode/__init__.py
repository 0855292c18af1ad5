"""OTLP requests -> rows: pure functions and caches, no run state.
"""
