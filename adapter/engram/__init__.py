"""Packed Engram shards: the format codec (format), the rank's row reader (store), dequantisation.

Imported by the agent too (``from adapter.engram import format``), so nothing here may import agent/
or coordinator/, and nothing outside the standard library is needed at import time.
"""
