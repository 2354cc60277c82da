"""Shared pieces of dsv41: the version and the generated wire stubs (dsv41.v1)."""
