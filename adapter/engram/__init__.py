"""Packed Engram shards in the rank: the row reader (store), its cache and dequantisation.

The shard format itself (names, row ranges, header codec) is dsv41/engram_format.py, shared with
the agent's pack job and the coordinator's pack check.
"""
