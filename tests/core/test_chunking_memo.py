"""The automatic chunk size's probes, remembered beside the persistent compilation cache
(`core.memo`): a second run of the same configuration compiles no probe and gets the chunk the
probe gives; another program or compiler misses; a bad entry is ignored; with the cache off
nothing is written and every probe compiles, as before."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest

from fedjax_pfl import compiles
from fedjax_pfl.core import chunking, execution, memo

S = jax.ShapeDtypeStruct


def wide_step(row):
    """One client's step with a [64, 64, 64] float32 temporary (1 MiB; the barrier keeps it a
    buffer) and a [64, 64] output: under the CPU's 16 MiB temporaries budget, chunks of ≤ 16."""
    return jnp.sum(jax.lax.optimization_barrier(
        jnp.sin(row[:, None, None] * row[None, :, None] * row)), axis=0)


@pytest.fixture(autouse=True)
def fresh():
    """JAX keeps compiled probes in memory for the process; each test starts as a new process
    would (and `fresh_record` clears them again before each measured call)."""
    jax.clear_caches()


def fresh_record():
    """`compiles.record()` after dropping JAX's in-memory executables, as in a new process."""
    jax.clear_caches()
    return compiles.record()


def probes(log) -> int:
    """How many programs of `wide_step` a `compiles.record()` saw."""
    return sum(name == "jit(wide_step)" for name in log.names)


@pytest.fixture
def cache_dir(tmp_path):
    """The persistent compilation cache pointed at a fresh directory for one test."""
    previous = (jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache)
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    jax.config.update("jax_enable_compilation_cache", True)
    try:
        yield tmp_path
    finally:
        jax.config.update("jax_compilation_cache_dir", previous[0])
        jax.config.update("jax_enable_compilation_cache", previous[1])


def entries(cache_dir) -> list:
    where = cache_dir / memo.SUBDIRECTORY
    return sorted(p.name for p in where.iterdir()) if where.exists() else []


def xla_numbers(fn, *args) -> tuple:
    """What XLA's analyses of the compiled probe say, read here without the engine."""
    compiled = jax.jit(fn).lower(*args).compile(
        compiler_options={"xla_backend_optimization_level": 0})
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return memory.temp_size_in_bytes, memory.output_size_in_bytes, float(cost["flops"])


def chunk_without_memo(fn, *args) -> int:
    """The chunk the probes give with the persistent cache (and so the memo) off."""
    previous = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    try:
        assert memo.directory() is None
        return chunking.auto_chunk_size(fn, *args)
    finally:
        jax.config.update("jax_compilation_cache_dir", previous)


@pytest.mark.slow
def test_a_remembered_probe_is_not_compiled_and_gives_the_probes_chunk(cache_dir):
    spec = S((64,), jnp.float32)
    expected = chunk_without_memo(wide_step, spec)
    assert 1 <= expected <= 16                       # (1 MiB temporaries a client, 16 MiB budget)
    with fresh_record() as first:
        assert chunking.auto_chunk_size(wide_step, spec) == expected
    assert probes(first) == 1 and len(entries(cache_dir)) == 1
    # The entry holds XLA's own numbers for the probe.
    path = cache_dir / memo.SUBDIRECTORY / entries(cache_dir)[0]
    assert path.stat().st_mode & 0o777 == 0o644          # readable by others, as JAX's entries
    record = json.loads(path.read_text())
    assert (record["temp_bytes"], record["output_bytes"], record["flops"]) == xla_numbers(
        wide_step, spec)
    # A fresh mapper's cache (what a new run builds) asks for it again: read, not compiled.
    with fresh_record() as second:
        got = execution.MapperCache().auto_chunk(wide_step, ("k",), ((), (spec,)), 10**6)
    assert got == expected and probes(second) == 0 and second.names == []


@pytest.mark.slow
def test_another_shape_or_compiler_misses(cache_dir, monkeypatch):
    spec = S((64,), jnp.float32)
    chunking.auto_chunk_size(wide_step, spec)
    assert len(entries(cache_dir)) == 1
    # Another shape is another program: its own probe and entry, its own chunk (a [32, 32, 32]
    # temporary is an eighth of the size).
    smaller = S((32,), jnp.float32)
    with fresh_record() as log:
        got = chunking.auto_chunk_size(wide_step, smaller)
    assert probes(log) == 1 and len(entries(cache_dir)) == 2
    assert got == chunk_without_memo(wide_step, smaller)
    # Another compiler setting (any XLA flag, here one that changes nothing) misses too.
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_dump_hlo_as_text")
    with fresh_record() as log:
        chunking.auto_chunk_size(wide_step, spec)
    assert probes(log) == 1 and len(entries(cache_dir)) == 3
    # And so does another jax version.
    monkeypatch.setattr(jax, "__version__", jax.__version__ + ".post1")
    with fresh_record() as log:
        chunking.auto_chunk_size(wide_step, spec)
    assert probes(log) == 1 and len(entries(cache_dir)) == 4


@pytest.mark.parametrize("content", [
    "{not json",
    "",
    json.dumps({"format": memo.FORMAT, "temp_bytes": "many", "output_bytes": 1, "flops": 1.0}),
    json.dumps({"format": memo.FORMAT, "temp_bytes": -1, "output_bytes": 1, "flops": 1.0}),
    json.dumps({"format": memo.FORMAT, "temp_bytes": 1, "output_bytes": 1}),
    json.dumps({"format": memo.FORMAT + 1, "temp_bytes": 1, "output_bytes": 1, "flops": 1.0}),
    json.dumps([1, 2, 3]),
], ids=["truncated", "empty", "string", "negative", "missing", "format", "list"])
def test_a_corrupt_entry_is_ignored_and_rewritten(cache_dir, content):
    spec = S((64,), jnp.float32)
    expected = chunking.auto_chunk_size(wide_step, spec)
    (name,) = entries(cache_dir)
    path = cache_dir / memo.SUBDIRECTORY / name
    good = path.read_text()
    path.write_text(content)
    with fresh_record() as log:
        assert chunking.auto_chunk_size(wide_step, spec) == expected
    assert probes(log) == 1 and path.read_text() == good and entries(cache_dir) == [name]


def test_an_unwritable_cache_is_no_error(cache_dir):
    (cache_dir / memo.SUBDIRECTORY).write_text("a file where the directory should be")
    spec = S((64,), jnp.float32)
    assert chunking.auto_chunk_size(wide_step, spec) == chunk_without_memo(wide_step, spec)


@pytest.mark.parametrize("off", ["no directory", "disabled"])
def test_with_the_cache_off_nothing_is_written_and_every_probe_compiles(cache_dir, off):
    if off == "no directory":
        jax.config.update("jax_compilation_cache_dir", None)
    else:
        jax.config.update("jax_enable_compilation_cache", False)
    spec = S((64,), jnp.float32)
    assert memo.directory() is None
    with fresh_record() as log:
        first = chunking.auto_chunk_size(wide_step, spec)
    with fresh_record() as again:
        second = chunking.auto_chunk_size(wide_step, spec)
    assert first == second and probes(log) == probes(again) == 1
    assert list(cache_dir.iterdir()) == []


_RUN = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp
    jax.config.update("jax_compilation_cache_dir", sys.argv[1])
    from fedjax_pfl import compiles
    from fedjax_pfl.core import execution
    def wide_step(row):
        return jnp.sum(jax.lax.optimization_barrier(
            jnp.sin(row[:, None, None] * row[None, :, None] * row)), axis=0)
    spec = jax.ShapeDtypeStruct((64,), jnp.float32)
    with compiles.record() as log:
        chunk = execution.MapperCache().auto_chunk(wide_step, ("k",), ((), (spec,)), 10**6)
    print(chunk, sum(n == "jit(wide_step)" for n in log.names))
""")


@pytest.mark.slow
def test_a_second_process_compiles_no_probe(tmp_path):
    """Two runs of the same configuration, as a user makes them: the second reads the first's
    entry and compiles nothing for the chunk size, which is the first's."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}

    def run() -> tuple[int, int]:
        out = subprocess.run([sys.executable, "-c", _RUN, str(tmp_path)], env=env, check=True,
                             capture_output=True, text=True, timeout=120).stdout.split()
        return int(out[0]), int(out[1])

    (cold_chunk, cold_probes), (warm_chunk, warm_probes) = run(), run()
    assert (cold_probes, warm_probes) == (1, 0)
    assert warm_chunk == cold_chunk == chunk_without_memo(wide_step, S((64,), jnp.float32))
