"""Stopping a run cleanly: SIGINT (Ctrl-C) and SIGTERM (kill, timeout, SLURM's preemption and
time limits) in one place.

Only the standard library is imported here, so the command line can guard its own start-up
(importing JAX) with `deferred_signals()` before anything heavy is loaded.

  * `stop_signals()`: within the block, SIGTERM raises `Terminated` (a KeyboardInterrupt) in the
    main thread just as SIGINT raises KeyboardInterrupt, so one `except KeyboardInterrupt`
    records an interrupted run whichever signal stopped it. `exit_status(e)` is 130 for SIGINT
    and 143 (128 + 15) for SIGTERM, the shells' convention.
  * `deferred_signals()`: SIGINT and SIGTERM are held back for the duration of the block (a
    round's record being written, a checkpoint being saved) and raised when it ends, so the
    run's files are never cut between two consistent states.
  * `compute(fn, ...)`: under `interruptible()` the call runs in a worker thread while the main
    thread waits, so a signal is handled at once even during a long XLA compilation (the
    exception is raised in the main thread, never inside JAX or orbax).
  * A lost process of a multi-process run (`fedjax_pfl.distributed`'s watchdog) is delivered as
    a SIGTERM to the main thread after `note_lost_peer(loss)`: the handlers then raise the loss
    (`distributed.PeerLost`, a KeyboardInterrupt) instead, and `exit_status` is 75.
  * `WarningSignal`: a scheduler's warning before the kill (SLURM's `--signal=USR1@60`) sets a
    flag the round loop reads at the next round boundary (`--checkpoint-on-signal`).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Callable

_WORKER = "fedjax_pfl-compute"
_state = threading.local()
_lost: list[KeyboardInterrupt] = []        # a lost peer, noted by the watchdog (any thread)
EXIT_LOST_PEER = 75                         # (fedjax_pfl.distributed.EXIT_LOST_PEER)


def note_lost_peer(loss: KeyboardInterrupt | None) -> None:
    """From now on the SIGTERM handlers raise `loss` (a lost process of the run; None: no
    longer)."""
    _lost[:] = [] if loss is None else [loss]


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived (raised in the main thread within `stop_signals()`)."""


def signal_name(e: BaseException) -> str:
    """"SIGTERM" for a `Terminated` (or an exception recording it, `runner.Interrupted`),
    "lost process K" for a lost peer, else "SIGINT"."""
    recorded = getattr(e, "signal", None)
    if isinstance(recorded, str) and recorded.startswith("lost process"):
        return recorded
    terminated = isinstance(e, Terminated) or recorded == "SIGTERM"
    return "SIGTERM" if terminated else "SIGINT"


def exit_status(e: BaseException) -> int:
    """130 for an interrupt (SIGINT), 143 for a termination (SIGTERM): 128 + the signal; 75
    (EX_TEMPFAIL) for a lost process of the run."""
    name = signal_name(e)
    return EXIT_LOST_PEER if name.startswith("lost") else 143 if name == "SIGTERM" else 130


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _raise_terminated(signum, frame):
    if _lost:
        raise _lost[0]
    raise Terminated()


@contextlib.contextmanager
def stop_signals():
    """SIGTERM raises `Terminated` in the main thread within this block (SIGINT raises
    KeyboardInterrupt as always). Elsewhere than the main thread, a no-op."""
    if not _main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def signals_taken():
    """Within the block (even inside `deferred_signals`), SIGINT raises KeyboardInterrupt and
    SIGTERM `Terminated` at once: for waits that must end when asked (processes meeting at
    start-up). Elsewhere than the main thread, a no-op."""
    if not _main_thread():
        yield
        return
    previous = {signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler),
                signal.SIGTERM: signal.signal(signal.SIGTERM, _raise_terminated)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def deferred_signals(*, raise_after: bool = True):
    """SIGINT and SIGTERM held back during the block; the first one that arrived is raised at its
    end (as KeyboardInterrupt or `Terminated`) unless the block raised, or `raise_after` is
    False (then it is dropped: the block is already writing an interrupted run's record)."""
    if not _main_thread() or getattr(_state, "deferring", False):
        yield                                # nested: the outermost block raises at its end
        return
    hit: list[int] = []

    def note(signum, frame):
        hit.append(signum)

    previous = {s: signal.signal(s, note) for s in (signal.SIGINT, signal.SIGTERM)}
    _state.deferring = True
    failed = False
    try:
        yield
    except BaseException:
        failed = True
        raise
    finally:
        _state.deferring = False
        for s, handler in previous.items():
            signal.signal(s, handler)
        if hit and raise_after and not failed:
            if _lost and hit[0] == signal.SIGTERM:
                raise _lost[0]
            raise Terminated() if hit[0] == signal.SIGTERM else KeyboardInterrupt()


class interruptible:
    """Context manager (the command line's): `compute` calls go to a worker thread so that a
    signal interrupts them promptly. After an interrupt, end the process with `os._exit` when
    `busy()`: a worker still inside XLA cannot be stopped, and interpreter teardown around it is
    what used to segfault."""

    def __enter__(self):
        _state.on = _main_thread()
        return self

    def __exit__(self, *exc):
        _state.on = False
        return False

    @staticmethod
    def busy() -> bool:
        return any(t.name == _WORKER and t.is_alive() for t in threading.enumerate())


def compute(fn: Callable, *args, **kwargs) -> Any:
    """Calls `fn`; under `interruptible()`, in a worker thread while the main thread waits."""
    if not getattr(_state, "on", False):
        return fn(*args, **kwargs)
    box: dict = {}

    def target():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as e:           # handed to the main thread below
            box["error"] = e

    worker = threading.Thread(target=target, name=_WORKER, daemon=True)
    worker.start()
    worker.join()                            # interruptible by a signal (POSIX lock wait)
    if "error" in box:
        raise box["error"]
    return box["value"]


class WarningSignal:
    """A flag set by `signum` (e.g. SIGUSR1) while installed: a scheduler's warning that the job
    will be stopped soon. `take()` returns whether it arrived since the last call."""

    def __init__(self, signum: int | None):
        self.signum, self._hit, self._previous = signum, False, None

    def __enter__(self):
        if self.signum is not None and _main_thread():
            def note(signum, frame):
                self._hit = True
            self._previous = signal.signal(self.signum, note)
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(self.signum, self._previous)
        return False

    def take(self) -> bool:
        hit, self._hit = self._hit, False
        return hit


def parse_signal(name: str) -> int:
    """'USR1', 'SIGUSR1' or '10' -> the signal number (OptionError naming the run's
    `checkpoint_on_signal` otherwise)."""
    from fedjax_pfl.errors import OptionError, arg

    text = str(name).upper()
    try:
        if text.isdigit():
            return int(signal.Signals(int(text)))
        return int(signal.Signals[text if text.startswith("SIG") else f"SIG{text}"])
    except (KeyError, ValueError):
        raise OptionError(f"{arg('checkpoint_on_signal')} must name a signal (e.g. USR1, "
                          f"SIGUSR2), got {name!r}") from None
