"""The session's lifecycle: start (wiring the reader, the backends, the exporter process), where this
process runs in its job, exit and signals, the shutdown summary, children.
"""
