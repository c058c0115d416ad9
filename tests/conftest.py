"""Shared fixtures (helper functions live in tests/helpers.py, importable as `helpers`)."""

import os

# The suite runs on one XLA device, like a notebook that never calls use_cpu_cores(); the
# multi-device (sharded) path is tested in a subprocess by tests/core/test_sharding.py.
os.environ["FEDJAX_PFL_CPU_DEVICES"] = "1"

import jax  # noqa: E402
import pytest  # noqa: E402

from helpers import make_data  # noqa: E402


@pytest.fixture
def ragged_data():
    """Four clients with 7, 23, 12 and 1 training samples."""
    return make_data([7, 23, 12, 1])


@pytest.fixture
def x64():
    """Runs the test with 64-bit floats (references computed in float64)."""
    with jax.enable_x64(True):
        yield
