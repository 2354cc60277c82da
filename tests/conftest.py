"""Test modules declare their tier with `pytestmark`; shared helpers live in tests/configtext.py."""
