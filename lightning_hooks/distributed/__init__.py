"""Across ranks.

One gradient measurement per optimizer step shared by every callback, agreed by one collective and
read back in one host transfer. Imports ``measure`` and ``core``.
"""
