"""Booted systemd-nspawn nodes with the project's packages, shared by the test tiers, the demo
(tools/demo.py) and the benches: the node harness (nspawn), the package build (debs), three spark
nodes on the stand-in engine (sparks) and the CPU rehearsal with real SGLang ranks (rehearsal).
Nothing here imports tests/: the demo runs from a tree without them."""
