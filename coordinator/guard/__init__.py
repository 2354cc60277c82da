"""The memory guard: aborts the runaway prefill before a node runs out of memory.

policy.py (Guard) and phases.py decide (pure), engine.py talks to rank 0, runner.py reads the
agents' memory streams and carries decisions out, events.py words the journal events,
settings.py holds and reads the settings. The map and the design: docs/guard-internals.md.
"""
