"""Shared fixtures (helper functions live in tests/support/helpers.py, importable as `helpers`)."""

import ctypes.util
import gc
import importlib.metadata
import os
import shutil
import signal
import tempfile

# The suite runs on one XLA device, like a notebook that never calls use_cpu_cores(); the
# multi-device (sharded) path is tested in a subprocess by tests/core/test_sharding.py.
os.environ["FEDJAX_PFL_CPU_DEVICES"] = "1"

# Most of the suite's time is compiling (JAX tracing and lowering, then XLA), and many tests
# compile the same program (a run and its resumed twin, the loop backend's per-client program,
# evaluation). One persistent compilation cache per test session, shared by the xdist workers and
# by the subprocesses the tests start (they inherit these variables), compiles each of them once
# in XLA (tracing and lowering are still paid per process). It lives in a fresh temporary
# directory, so a session never reads a cache from an earlier one.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="fedjax_pfl_test_jit_")
    os.environ["FEDJAX_PFL_TEST_OWNS_JIT_CACHE"] = str(os.getpid())
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

# XLA's CPU backend, for the suite's small programs, at LLVM -O0 instead of its default -O2 and
# with its older elemental emitters instead of the fusion emitters: compiling a PGFed round of the
# default configuration takes 1.7 s instead of 5.8 s (docs/decisions/compile-time.md, each
# setting in a fresh process). The programs then run ~5x
# slower (67 vs 12 ms a default PGFed round), which the suite's few-round tests never notice (the
# default configurations' runs stop at their accuracy bar). Full suite: 1,116 s at -O1 with the
# fusion emitters, 656 s at -O1 without, 440–669 s at -O0 without. Two different programs may
# then differ by an ulp where XLA's defaults agree: such claims are tested at XLA's defaults
# (`helpers.product_jit`: PGFed with mu = 0 against FedAvg). The placements' claims (host against
# device, two processes against one, private against plain uplinks) hold bit for bit at these
# settings too and are tested here (rechecked 2026-11-28, jaxlib 0.10.2). Subprocesses that tests
# start inherit the flags.
# XLA from jaxlib 0.11 has no elemental-emitter switch and aborts on the unknown flag, so it is
# set only for older jaxlibs.
# XLA:CPU also splits each program's LLVM module into parts compiled in parallel; on two cores
# shared by two test workers that buys nothing and costs each part its own target machine set-up
# (`--xla_cpu_parallel_codegen_split_count=1`: about 5 % of the suite's CPU time, measured with the
# other settings below, docs/decisions/test-suite-settings.md).
_FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_cpu_parallel_codegen_split_count=1")
if tuple(int(p) for p in importlib.metadata.version("jaxlib").split(".")[:2]) < (0, 11):
    _FAST_COMPILE += ("--xla_cpu_use_fusion_emitters=false",)
for _flag in _FAST_COMPILE:
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

# glibc's malloc was about 14 % of the suite's CPU time (`perf`: _int_malloc, malloc_consolidate,
# unlink_chunk while JAX traces, lowers and XLA compiles); jemalloc cuts the suite's CPU by 7–13 %.
# Set here, in the pytest process that starts the xdist workers, so that the workers and every
# subprocess a test starts load it (the dynamic loader reads LD_PRELOAD when a process starts, so
# the first process itself keeps glibc's). Used when the system's library search finds jemalloc
# (Debian's libjemalloc2: `.ci/run` installs it); FEDJAX_PFL_TEST_MALLOC=system turns it off. A
# preload the user set (another allocator, a sanitizer) is left as it is.
if os.environ.get("FEDJAX_PFL_TEST_MALLOC", "jemalloc") == "jemalloc" and not os.environ.get("LD_PRELOAD"):
    _jemalloc = ctypes.util.find_library("jemalloc")     # a soname; ld.so searches it as for any library
    if _jemalloc:
        os.environ["LD_PRELOAD"] = _jemalloc

import jax  # noqa: E402
import pytest  # noqa: E402

import fedjax_pfl  # noqa: E402, F401

# Python's cyclic garbage collector was about 5 % of the suite's CPU time: JAX's tracing allocates
# many short-lived containers, and each full collection walked every object the imports made.
# Those are frozen out of the collector's view, and it runs a young-generation pass every 20,000
# net allocations instead of 700 (5–6 % less CPU, docs/decisions/test-suite-settings.md;
# FEDJAX_PFL_TEST_GC=default keeps Python's settings).
if os.environ.get("FEDJAX_PFL_TEST_GC") != "default":
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)

import helpers  # noqa: E402
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


@pytest.fixture(autouse=True)
def _ctrl_c_still_works():
    """A run inside a notebook or test must leave Ctrl-C as it found it: the runner swaps SIGINT's
    handler around critical sections, and a handler left behind would make Ctrl-C do nothing."""
    before = signal.getsignal(signal.SIGINT)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    yield
    after, after_mask = signal.getsignal(signal.SIGINT), signal.pthread_sigmask(signal.SIG_BLOCK, ())
    signal.signal(signal.SIGINT, before)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    assert after is before, f"the test left SIGINT's handler at {after!r} (was {before!r})"
    assert after_mask == mask, f"the test left the signal mask at {after_mask} (was {mask})"


@pytest.fixture(autouse=True)
def _no_figures(request, monkeypatch):
    """Runs write no PNGs unless the test is marked `figures`: every `plots.plot_*` writer does
    nothing. Drawing a run's three figures (~0.8 s each) was 160 s of the suite's worker time
    and two thirds of the per-algorithm resume checks (`helpers.check_resume_equals_uninterrupted`),
    and what they show is not what a run must compute or resume. Tests marked `figures` check
    that runs write them (tests/runner/test_plots.py, test_fairness_cost.py, test_resume.py's
    interrupted run, tests/cli/test_cli.py's short runs); subprocess tests choose between
    experiments/run.py and tests/support/run_no_figures.py."""
    if request.node.get_closest_marker("figures") is None:
        import no_figures

        no_figures.stub_all(monkeypatch.setattr)


def pytest_unconfigure(config):
    """The session that made the compilation cache removes it."""
    if os.environ.get("FEDJAX_PFL_TEST_OWNS_JIT_CACHE") == str(os.getpid()):
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


# Longest first, so that the two xdist workers (stealing each other's queued tests, see --dist in
# pyproject.toml) end together instead of one waiting for a long test that started last.
_LONGEST_FIRST = ("tests/runner/test_defaults_train.py", "tests/core/test_sharding.py",
                  "tests/system/test_interrupts.py", "tests/system/test_distributed.py",
                  "tests/cli/test_cli_fuzz.py")


def pytest_addoption(parser):
    parser.addoption(
        "--extended", action="store_true",
        help="also run the extended cases: every algorithm of each matrix test (without it, "
             "helpers.REPRESENTATIVE and each matrix's quick cases) and the tests and cases "
             "marked `extended` (variants of a placement or fault that another case covers)")


def _extended_only(item) -> bool:
    """A case that only `--extended` runs: marked `extended`, or an algorithm in a `matrix` test
    that is neither in helpers.REPRESENTATIVE nor one of its module's `QUICK` cases."""
    if item.get_closest_marker("extended"):
        return True
    if not item.get_closest_marker("matrix"):
        return False
    name = item.callspec.params.get("name") if hasattr(item, "callspec") else None
    quick = getattr(item.module, "QUICK", ())
    quick = {quick} if isinstance(quick, str) else {q if isinstance(q, str) else q[0] for q in quick}
    return isinstance(name, str) and name not in {*helpers.REPRESENTATIVE, *quick}


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--extended"):
        extended = [_extended_only(item) for item in items]
        dropped = [item for item, e in zip(items, extended) if e]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = [item for item, e in zip(items, extended) if not e]

    def rank(item):
        path = item.nodeid.split("::")[0]
        return _LONGEST_FIRST.index(path) if path in _LONGEST_FIRST else len(_LONGEST_FIRST)

    items.sort(key=rank)          # stable: the usual order otherwise
