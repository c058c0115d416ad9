"""Shared fixtures (helper functions live in tests/helpers.py, importable as `helpers`)."""

import jax
import pytest

from helpers import make_data


@pytest.fixture
def ragged_data():
    """Four clients with 7, 23, 12 and 1 training samples."""
    return make_data([7, 23, 12, 1])


@pytest.fixture
def x64():
    """Runs the test with 64-bit floats (references computed in float64)."""
    with jax.enable_x64(True):
        yield
