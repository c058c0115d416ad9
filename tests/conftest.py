"""Shared fixtures (helper functions live in tests/helpers.py, importable as `helpers`)."""

import os
import shutil
import tempfile

# The suite runs on one XLA device, like a notebook that never calls use_cpu_cores(); the
# multi-device (sharded) path is tested in a subprocess by tests/core/test_sharding.py.
os.environ["FEDJAX_PFL_CPU_DEVICES"] = "1"

# Most of the suite's time is XLA compilation, and many tests compile the same program (a run
# and its resumed twin, the loop backend's per-client program, evaluation). One persistent
# compilation cache per test session, shared by the xdist workers and by the subprocesses the
# tests start (they inherit these variables), compiles each of them once. It lives in a fresh
# temporary directory, so a session never reads a cache from an earlier one.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="fedjax_pfl_test_jit_")
    os.environ["FEDJAX_PFL_TEST_OWNS_JIT_CACHE"] = str(os.getpid())
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

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


def pytest_unconfigure(config):
    """The session that made the compilation cache removes it."""
    if os.environ.get("FEDJAX_PFL_TEST_OWNS_JIT_CACHE") == str(os.getpid()):
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
