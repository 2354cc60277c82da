"""The memory guard: aborts the runaway prefill before a node runs out of memory.

policy.py decides (pure), engine.py talks to rank 0, runner.py reads the agents' memory streams
and carries decisions out, events.py words the journal events, settings.py reads cluster.env.
"""
