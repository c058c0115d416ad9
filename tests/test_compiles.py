"""`fedjax_pfl.compiles`: the programs a block compiles, by name, and which the persistent cache
gave (the run summary's hit rate and the compile-count regression tests rest on it)."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_pfl import compiles


def test_counts_each_program_once_by_name_in_any_thread():
    def doubled_plus_one(x):
        return x * 2 + 1

    def tripled(x):
        return x * 3

    x = jnp.asarray(np.arange(5.0))       # (created outside: its own programs are not counted)
    f, g = jax.jit(doubled_plus_one), jax.jit(tripled)
    with compiles.record() as log:
        f(x).block_until_ready()
        f(x).block_until_ready()           # the same shapes: no second program
        t = threading.Thread(target=lambda: g(x).block_until_ready())
        t.start()
        t.join()
    assert sorted(log.names) == ["jit(doubled_plus_one)", "jit(tripled)"]
    assert all(p.seconds >= 0 for p in log.programs)
    with compiles.record() as again:
        f(x).block_until_ready()
    assert again.names == [] and again.describe() == "no program compiled"


@pytest.mark.slow
def test_a_warm_persistent_cache_is_counted_as_hits(tmp_path):
    previous = (jax.config.jax_compilation_cache_dir,
                jax.config.jax_persistent_cache_min_compile_time_secs,
                jax.config.jax_persistent_cache_min_entry_size_bytes)
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    try:
        def cubed_minus_seven(x):
            return x ** 3 - 7.0

        x = jnp.asarray(np.arange(3.0))
        with compiles.record() as cold:
            jax.jit(cubed_minus_seven)(x).block_until_ready()
        jax.clear_caches()                  # (the in-memory cache: the next jit asks the disk)
        with compiles.record() as warm:
            jax.jit(cubed_minus_seven)(x).block_until_ready()
    finally:
        for name, value in zip(("jax_compilation_cache_dir",
                                "jax_persistent_cache_min_compile_time_secs",
                                "jax_persistent_cache_min_entry_size_bytes"), previous):
            jax.config.update(name, value)
    mine = lambda log: [p for p in log.programs if p.name == "jit(cubed_minus_seven)"]
    assert [p.cached for p in mine(cold)] == [False]
    assert [p.cached for p in mine(warm)] == [True]
    assert warm.from_cache >= 1 and "from the cache" in warm.describe()
    assert warm.summary()["programs"] == len(warm.programs)
