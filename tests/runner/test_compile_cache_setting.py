"""`RunConfig.compile_cache` and `fedjax_pfl.compile_cache`: which directory a setting means,
which directories are refused, and what the notebook API's runs write and read there (the
command line's runs: tests/system/test_compile_cache.py)."""

import os
import stat
import warnings

import helpers
import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache as jax_cache

from fedjax_pfl import compile_cache, compiles, runner, sweep
from fedjax_pfl.errors import OptionError

HOME_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "fedjax_pfl", "jax")


# -- which directory a setting means (pure) ------------------------------------------------------

@pytest.mark.parametrize("setting, environ, jax_dir, jax_enabled, want", [
    (False, {"FEDJAX_PFL_COMPILE_CACHE": "/env"}, "/jaxdir", True, None),
    ("/mine", {"FEDJAX_PFL_COMPILE_CACHE": "off"}, "/jaxdir", False, "/mine"),  # code wins
    (True, {"FEDJAX_PFL_COMPILE_CACHE": "/env"}, "/jaxdir", True, "/env"),
    (True, {"FEDJAX_PFL_COMPILE_CACHE": "/env"}, None, False, "/env"),
    (True, {"FEDJAX_PFL_COMPILE_CACHE": "off"}, "/jaxdir", True, None),
    (True, {"FEDJAX_PFL_COMPILE_CACHE": "OFF"}, None, True, None),
    (True, {"FEDJAX_PFL_COMPILE_CACHE": "0"}, None, True, None),
    (True, {"FEDJAX_PFL_COMPILE_CACHE": "false"}, None, True, None),
    (True, {"FEDJAX_PFL_COMPILE_CACHE": ""}, "/jaxdir", True, "/jaxdir"),   # empty: unset
    (True, {}, "/jaxdir", True, "/jaxdir"),                  # the user's own JAX cache
    (True, {}, "/jaxdir", False, None),                      # the user turned JAX's cache off
    (True, {"XDG_CACHE_HOME": "/xdg"}, None, True, "/xdg/fedjax_pfl/jax"),
    (True, {}, None, True, HOME_CACHE),
])
def test_a_setting_means_one_directory_or_none(setting, environ, jax_dir, jax_enabled, want):
    assert compile_cache.choose(setting, environ=environ, jax_dir=jax_dir,
                                jax_enabled=jax_enabled) == want


def test_a_relative_directory_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert compile_cache.choose("jit", environ={}) == str(tmp_path / "jit")


@pytest.mark.parametrize("bad", [None, "", "  ", 3, 0.5])
def test_a_bad_setting_is_an_option_error_naming_it(bad):
    with pytest.raises(OptionError, match="^compile_cache must be True"):
        compile_cache.check_setting(bad)
    with pytest.raises(OptionError, match="^compile_cache must be True"):
        runner.RunConfig(compile_cache=bad).validate()


def test_the_suite_keeps_its_own_session_cache_not_the_home_one():
    """tests/conftest.py's session cache is the user's own JAX cache here: runs of the suite
    (in process and in the subprocesses it starts, which inherit the variable) use it, never
    ~/.cache/fedjax_pfl/jax."""
    session = os.environ["JAX_COMPILATION_CACHE_DIR"]
    assert "FEDJAX_PFL_COMPILE_CACHE" not in os.environ
    assert compile_cache.choose(True, environ=os.environ, jax_dir=session) == session
    assert compile_cache.apply(True) == session == compile_cache.active()
    assert not os.path.abspath(session).startswith(os.path.dirname(HOME_CACHE))


# -- which directories are refused ---------------------------------------------------------------

def test_a_missing_directory_is_created_private(tmp_path):
    target = tmp_path / "a" / "b"
    assert compile_cache.unusable(str(target)) is None
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o700
    assert os.listdir(target) == []                         # (the write probe is gone)


def test_a_path_through_a_file_and_a_world_writable_directory_are_refused(tmp_path):
    (tmp_path / "file").write_text("")
    assert "NotADirectoryError" in compile_cache.unusable(str(tmp_path / "file" / "jit"))
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    assert "every user may write it" in compile_cache.unusable(str(open_dir))


@pytest.mark.skipif(not os.path.isdir("/sys/kernel"), reason="needs Linux's sysfs")
def test_a_directory_that_takes_no_file_is_refused_by_writing_to_it():
    """sysfs takes no new file, even from root, though its mode (0555) and os.access say
    otherwise to root: only a write tells."""
    assert "PermissionError" in compile_cache.unusable("/sys")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_a_read_only_directory_is_refused(tmp_path):
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro").chmod(0o555)
    assert "PermissionError" in compile_cache.unusable(str(tmp_path / "ro"))


# -- what the notebook API's runs write and read -------------------------------------------------

@pytest.fixture
def own_jax_cache(monkeypatch):
    """The test may point JAX's cache elsewhere: afterwards the suite's settings are back (the
    next `apply` takes them as the user's own again) and JAX's in-memory programs forgotten,
    so each run of the test compiles its programs anew (from the disk cache, or XLA). Something
    compiles first, as in a notebook that ran a cell before: JAX has opened its cache then, and
    a run that names another must make JAX let go of it."""
    before = (jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache)
    monkeypatch.delenv("FEDJAX_PFL_COMPILE_CACHE", raising=False)
    jax.jit(lambda x: x * 3 + 1)(jax.numpy.float32(2)).block_until_ready()
    jax.clear_caches()
    yield
    jax.config.update("jax_compilation_cache_dir", before[0])
    jax.config.update("jax_enable_compilation_cache", before[1])
    jax_cache.reset_cache()


def _tiny(out, **fields):
    cfg = runner.RunConfig.from_options(rounds=2, clients=6, quiet=True, out=str(out),
                                        checkpoint_every=0)
    for name, value in fields.items():
        setattr(cfg, name, value)
    return cfg


@pytest.mark.slow
def test_a_warm_cache_gives_every_program_and_the_same_bits(tmp_path, monkeypatch, own_jax_cache):
    """The default setting writes into the directory the environment gives; a second run reads
    every program from it and writes nothing; compile_cache=False reads and writes nothing; the
    three runs' metrics are equal bit for bit."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("FEDJAX_PFL_COMPILE_CACHE", str(cache))
    with compiles.record() as cold:
        first = runner.run(_tiny(tmp_path / "first"), log=lambda *_: None)
    written = set(os.listdir(cache))
    # Every program compiled from scratch went into the cache, one entry each (a fresh directory:
    # none came from it), counted by the run itself and by this test's own record.
    assert first["compile"]["cache_dir"] == str(cache)
    assert first["compile"]["from_cache"] == 0 == cold.from_cache
    assert first["compile"]["programs"] == len(cold.programs) == len(written) > 0
    assert {"jit(rounds)"} <= set(cold.names)

    jax.clear_caches()
    with compiles.record() as warm:
        second = runner.run(_tiny(tmp_path / "second"), log=lambda *_: None)
    assert set(os.listdir(cache)) == written                 # nothing compiled from scratch
    assert warm.from_cache == len(warm.programs) == len(written)
    assert second["compile"]["from_cache"] == second["compile"]["programs"] == len(written)

    jax.clear_caches()
    off = tmp_path / "off-cache"
    monkeypatch.setenv("FEDJAX_PFL_COMPILE_CACHE", str(off))
    with compiles.record() as uncached:
        third = runner.run(_tiny(tmp_path / "third", compile_cache=False), log=lambda *_: None)
    assert not off.exists() and set(os.listdir(cache)) == written
    assert uncached.from_cache == 0 and len(uncached.programs) == len(written)
    assert third["compile"] == {**third["compile"], "cache_dir": None, "from_cache": 0,
                                "programs": len(written)}
    rows = [helpers.metric_rows(tmp_path / name) for name in ("first", "second", "third")]
    assert rows[0] == rows[1] == rows[2] and len(rows[0]) == 2


@pytest.mark.slow
def test_an_unusable_directory_warns_once_and_the_runs_finish(tmp_path, own_jax_cache):
    """A directory the run cannot write (here a path through a file: refused for root too) gives
    one CompileCacheWarning over two runs, and both runs finish without a cache."""
    (tmp_path / "file").write_text("")
    blocked = str(tmp_path / "file" / "jit")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summaries = [runner.run(_tiny(tmp_path / name, compile_cache=blocked),
                                log=lambda *_: None) for name in ("a", "b")]
    said = [w for w in caught if issubclass(w.category, compile_cache.CompileCacheWarning)]
    assert len(said) == 1 and blocked in str(said[0].message)
    assert "\n" not in str(said[0].message)
    assert [s["last_completed_round"] for s in summaries] == [2, 2]
    assert [s["compile"]["cache_dir"] for s in summaries] == [None, None]
    assert helpers.metric_rows(tmp_path / "a") == helpers.metric_rows(tmp_path / "b")


@pytest.mark.slow
def test_a_sweep_group_writes_into_its_cache(tmp_path, own_jax_cache):
    """sweep.run_seeds (one vmapped program over the seeds) sets the cache as runner.run does,
    and each seed's summary counts the programs the group compiled."""
    cache = tmp_path / "cache"
    cfg = _tiny(tmp_path / "seeds", compile_cache=str(cache))
    _, summaries = sweep.run_seeds(cfg, [0, 1], progress=False)
    entries = os.listdir(cache)
    assert entries
    record = summaries[0]["compile"]
    assert record["cache_dir"] == str(cache) and record["from_cache"] == 0
    assert 0 < record["programs"] <= len(entries)      # (the data's own programs come before)
