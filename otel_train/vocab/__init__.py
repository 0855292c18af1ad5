"""The vocabulary every layer shares: rows, run identity, run folders, names, semantic conventions, the
step-order rule. Imports nothing of the layers above it.
"""
