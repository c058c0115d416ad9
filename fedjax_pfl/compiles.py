"""What a run compiles: each XLA program's name, seconds and whether the persistent compilation
cache gave it, counted from `jax.monitoring`'s events.

    with compiles.record() as log:
        ...                                   # anything that compiles, in any thread
    log.programs          # [Program(name="jit(rounds)", seconds=2.1, cached=False), ...]
    log.describe()        # "2.3 s, 1 of 3 programs from the cache"

JAX reports `/jax/core/compile/backend_compile_duration` once per program it compiles or loads
from the cache (with the program's name), and `/jax/compilation_cache/cache_hits` just before
the end of a compile that the cache answered, in the same thread; so a hit belongs to the next
program the thread reports. Listeners are registered once per process; recorders nest and
overlap (each sees every program compiled while it is open).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator

_COMPILED = "/jax/core/compile/backend_compile_duration"
_HIT = "/jax/compilation_cache/cache_hits"


@dataclasses.dataclass(frozen=True)
class Program:
    """One compiled (or cache-loaded) XLA program."""

    name: str          # JAX's name for it, e.g. "jit(rounds)"
    seconds: float     # the backend compile, or the cache read
    cached: bool       # from the persistent compilation cache


@dataclasses.dataclass
class Log:
    """The programs compiled while a `record()` was open, in the order they finished."""

    programs: list[Program] = dataclasses.field(default_factory=list)

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.programs]

    @property
    def from_cache(self) -> int:
        return sum(p.cached for p in self.programs)

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.programs)

    def describe(self) -> str:
        """e.g. "3 of 3 programs from the cache" (or "5 programs, none from the cache")."""
        n = len(self.programs)
        if n == 0:
            return "no program compiled"
        if self.from_cache == 0:
            return f"{n} program{'s' * (n != 1)}, none from the cache"
        return f"{self.from_cache} of {n} program{'s' * (n != 1)} from the cache"

    def summary(self) -> dict:
        """The JSON-ready record a run's summary keeps."""
        return {"programs": len(self.programs), "from_cache": self.from_cache,
                "backend_seconds": round(self.seconds, 4)}


_lock = threading.Lock()
_open: list[Log] = []
_hit = threading.local()
_registered = False


def _on_event(event: str, **_kwargs) -> None:
    if event == _HIT:
        _hit.pending = True


def _on_duration(event: str, seconds: float, **kwargs) -> None:
    if event != _COMPILED:
        return
    cached = bool(getattr(_hit, "pending", False))
    _hit.pending = False
    program = Program(str(kwargs.get("fun_name", "?")), float(seconds), cached)
    with _lock:
        for log in _open:
            log.programs.append(program)


def _register() -> None:
    global _registered
    with _lock:
        if _registered:
            return
        from jax import monitoring

        monitoring.register_event_listener(_on_event)
        monitoring.register_event_duration_secs_listener(_on_duration)
        _registered = True


@contextlib.contextmanager
def record() -> Iterator[Log]:
    """A `Log` of the programs compiled (in any thread) while the context is open."""
    _register()
    log = Log()
    with _lock:
        _open.append(log)
    try:
        yield log
    finally:
        with _lock:
            _open.remove(log)
