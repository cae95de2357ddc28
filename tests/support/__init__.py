"""Helpers shared by several test modules (the tiny fixtures themselves are in tests/conftest.py). The modules
that hold a test's asserts have them rewritten as in a test module, so that a failure shows the values."""

import pytest

pytest.register_assert_rewrite("support.decode", "support.fuzz")
