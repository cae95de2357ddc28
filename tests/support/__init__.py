"""Helpers shared by several test modules (the tiny fixtures themselves are in tests/conftest.py)."""
