"""JAX's persistent compilation cache, on by default where it is safe: which directory a run's
setting means (`choose`, pure) and the one switch every front end goes through (`apply`).

A compiled XLA executable is stored under a key of the program, the compiler's settings, the
backend and the devices, so a second run of the same configuration loads its round and
evaluation instead of compiling them: the same executable, the same bits (benchmarks/RESULTS.md,
"Start-up": the main job's XLA compile 10.7 s cold, 0.4 s warm). The setting
(`RunConfig.compile_cache`; run.py's and sweep.py's --no-compile-cache set it False;
`fedjax_pfl.use_compile_cache(setting)` from a notebook):

  True    the default: $FEDJAX_PFL_COMPILE_CACHE if it names a directory; else the user's own
          JAX cache (`jax_compilation_cache_dir`, e.g. from $JAX_COMPILATION_CACHE_DIR: the test
          suite's session cache, tests/conftest.py); else $XDG_CACHE_HOME/fedjax_pfl/jax or
          ~/.cache/fedjax_pfl/jax. Off where $FEDJAX_PFL_COMPILE_CACHE is one of `OFF_WORDS`
          ("off", "0", "false", "no", "none") or the user turned JAX's cache off
          (`jax_enable_compilation_cache` False, $JAX_ENABLE_COMPILATION_CACHE=false).
  "DIR"   that directory (a choice made in code wins over the environment).
  False   off.

What "safe" excludes, each time with one `CompileCacheWarning` per directory and process and
the run going on without the cache (a cache is never a reason for a run to fail):
  * a directory that cannot be created or written (a read-only home or file system, a path
    through a file, no permission): JAX would otherwise warn once per program it fails to write;
  * a directory every user may write (mode o+w, /tmp itself): JAX deserialises and runs what
    it finds there, so anyone who can write an entry can run code in the run
    (docs.jax.dev, "Persistent compilation cache": the cache is trusted). The default directory
    is created private (0700).
What needs no exclusion: programs holding a host callback (JAX never writes them); a
multi-process run (JAX writes from process 0 only, every process reads); a cache written by
another jaxlib, backend or device count (the key holds them: a miss, not a wrong program).
"""

from __future__ import annotations

import dataclasses
import os
import stat
import tempfile
import warnings
from typing import Mapping

from fedjax_pfl.errors import OptionError, OptionWarning, arg

ENV = "FEDJAX_PFL_COMPILE_CACHE"
OFF_WORDS = ("off", "0", "false", "no", "none")


class CompileCacheWarning(OptionWarning):
    """The cache the run's setting named cannot be used safely; the run compiles without it.
    (An OptionWarning: the command lines say it in one line, "run.py: warning: …".)"""


def default_directory(environ: Mapping[str, str] = os.environ) -> str:
    """$XDG_CACHE_HOME/fedjax_pfl/jax, or ~/.cache/fedjax_pfl/jax (the XDG base directory
    specification's user cache)."""
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "fedjax_pfl", "jax")


def check_setting(setting: object) -> None:
    """OptionError naming `compile_cache` unless it is True, False or a directory's path."""
    if not (isinstance(setting, bool) or (isinstance(setting, (str, os.PathLike))
                                          and str(os.fspath(setting)).strip())):
        raise OptionError(f"{arg('compile_cache')} must be True (the default directory), False "
                          f"(no cache) or a directory, got {setting!r}")


def choose(setting: bool | str | os.PathLike, *, environ: Mapping[str, str] = os.environ,
           jax_dir: str | None = None, jax_enabled: bool = True) -> str | None:
    """The directory `setting` means (the module docstring's table), or None for no cache.

    Args:
      setting: True, False or a directory (`RunConfig.compile_cache`).
      environ: the environment ($FEDJAX_PFL_COMPILE_CACHE, $XDG_CACHE_HOME).
      jax_dir, jax_enabled: the user's own `jax_compilation_cache_dir` and
        `jax_enable_compilation_cache` (as they were before this module changed them).
    """
    check_setting(setting)
    if setting is False:
        return None
    if setting is not True:
        return os.path.abspath(os.path.expanduser(os.fspath(setting)))
    env = environ.get(ENV, "").strip()
    if env.lower() in OFF_WORDS:
        return None
    if env:
        return os.path.abspath(os.path.expanduser(env))
    if not jax_enabled:
        return None
    return jax_dir or default_directory(environ)


def unusable(directory: str) -> str | None:
    """Why `directory` cannot serve as the cache (None: it can), after creating it (private,
    0700) where it is missing. Written to, not only checked with os.access: root passes every
    permission check, and only a write says whether the file system takes one."""
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        if os.stat(directory).st_mode & stat.S_IWOTH:
            return "every user may write it (the cache holds code the run executes)"
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".fedjax_pfl-probe-")
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        return f"{type(e).__name__}: {e.strerror or e}"
    return None


@dataclasses.dataclass
class _State:
    """What this module found in JAX's configuration before changing it (the user's own
    settings) and what it last wrote there (to tell the user's later changes from its own)."""

    user_dir: str | None
    user_enabled: bool
    wrote: tuple[str | None, bool]


_state: _State | None = None
_warned: set[str] = set()


def _jax_settings() -> tuple[str | None, bool]:
    import jax

    return jax.config.jax_compilation_cache_dir, bool(jax.config.jax_enable_compilation_cache)


def apply(setting: bool | str | os.PathLike = True) -> str | None:
    """Sets JAX's persistent compilation cache as `setting` says (`choose`); returns the
    directory in use, or None when the run compiles without a cache. Call it before the run
    compiles (`runner.prepare` does); calling it again with the same setting changes nothing.

    A directory that cannot be used safely (`unusable`) gives one `CompileCacheWarning` per
    directory and process, and no cache. Each program is kept whatever its compile time and
    size (JAX keeps only those over 1 s by default; even small ones add up over a sweep), unless
    $JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS / _MIN_ENTRY_SIZE_BYTES say otherwise.
    """
    global _state
    import jax

    now = _jax_settings()
    if _state is None or now != _state.wrote:     # (first call, or the user changed them since)
        _state = _State(now[0], now[1], now)
    directory = choose(setting, jax_dir=_state.user_dir, jax_enabled=_state.user_enabled)
    if directory is not None:
        why = unusable(directory)         # (each time: a directory may be fixed, or filled up)
        if why is not None:
            if directory not in _warned:
                _warned.add(directory)
                warnings.warn(CompileCacheWarning(
                    f"the compilation cache {directory} cannot be used ({why}); compiling "
                    f"without it (set ${ENV} to another directory, or off)"), stacklevel=2)
            directory = None
    wanted = (directory if directory is not None else now[0], directory is not None)
    if wanted != now:
        from jax.experimental.compilation_cache import compilation_cache

        if directory is not None:
            jax.config.update("jax_compilation_cache_dir", directory)
        jax.config.update("jax_enable_compilation_cache", directory is not None)
        # JAX opens its cache once, at the first compile, and decides once whether to use it:
        # a later change of directory or switch takes effect only after a reset.
        compilation_cache.reset_cache()
    _state.wrote = wanted
    if directory is not None:
        if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        if "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES" not in os.environ:
            jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return directory


def active() -> str | None:
    """The directory JAX's persistent cache reads and writes now, or None (off, or no directory)."""
    directory, enabled = _jax_settings()
    return directory if enabled and directory else None
