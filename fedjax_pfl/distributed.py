"""Several processes as one run: a start-up that ends in one line, agreement before any compile,
and a watchdog that ends the run when a process is lost.

    from fedjax_pfl import distributed
    distributed.start("10.0.0.1:1234", num_processes=2, process_id=0,
                      facts={"flags": vars(args)}, timeout=60, peer_timeout=30)

**Start-up** (`start`). Before JAX's distributed service starts, the processes meet on the
coordinator's port in a plain-socket handshake: process 0 listens, every other process connects
(retrying until `timeout`) and says its process id, process count, code version and `facts` (the
run's configuration). Process 0 answers every process with one verdict: go, or the first
disagreement ("process 1 has num_processes 3, process 0 has 2"), which every process raises as
`StartupError` (the command line: one line, exit 2). Only then is `jax.distributed.initialize`
called (gloo on CPU), on the port the handshake has freed. Doing the checks in the handshake is
what keeps them out of XLA's coordination client, which ends the process with a C++ abort on a
registration it refuses and on its own time-outs. The waits poll, so SIGINT and SIGTERM end them
at once (the signal's exception is raised in the main thread; the caller leaves with `os._exit`,
since the initialisation thread may be inside C++). Under a launcher (`start()` without an
address, `--distributed auto`) there is no handshake; the facts are compared through JAX's
key-value store right after the initialisation instead.

**A lost process** (`Watchdog`). Every process publishes a counter in the coordination service's
key-value store every `period` seconds and reads the others'. A process whose counter has not moved
for `peer_timeout` seconds, or a coordinator that does not answer for as long, is lost: the
watchdog records it (`lost()`) and interrupts the main thread as SIGTERM would, and the signal
handlers of `fedjax_pfl.interrupts` then raise `PeerLost` (a KeyboardInterrupt) instead of
`Terminated`. The runner records the run as interrupted by "lost process K" (summary.json, the
last complete checkpoint resumable) and the command line exits with `EXIT_LOST_PEER` (75,
sysexits' EX_TEMPFAIL: try again later, with --resume). A collective that fails because its peer
is gone (gloo: "Connection closed by peer") is explained the same way (`explain`). A main thread
stuck inside a collective whose peer hangs cannot take the exception: after `grace` seconds the
watchdog runs the runner's `on_abandon` hook (the interrupted record) and ends the process itself.

A process is judged by its watchdog thread, not by its progress: a slow peer (a long compile,
a large dataset to read) is not lost. The traffic is 2·(P-1) key-value calls per process and
period, fine for tens of processes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import sys
import threading
import time
from typing import Any, Callable

from fedjax_pfl import interrupts
from fedjax_pfl.errors import MarkedError, arg

EXIT_LOST_PEER = interrupts.EXIT_LOST_PEER   # sysexits.h EX_TEMPFAIL: temporary; resume later
_PREFIX = "fedjax_pfl"
_POLL = 0.2                        # seconds between polls of a wait (how soon a signal is taken)
_DONE = "done"                     # a watchdog's last sign of life: its process ended normally


class StartupError(MarkedError, RuntimeError):
    """The processes cannot start as one run (unreachable coordinator, disagreement); one line,
    naming the arguments (`fedjax_pfl.errors.arg`)."""


class PeerLost(KeyboardInterrupt):
    """A process of the run died or stopped answering (raised in the main thread)."""

    def __init__(self, process: int, reason: str):
        super().__init__(f"lost process {process}: {reason}")
        self.process, self.reason = process, reason
        self.signal = f"lost process {process}"


# ---- the facts every process must agree on ---------------------------------------------------

def code_version() -> str:
    """A digest of the package's source files (the same code, not just the same release)."""
    import fedjax_pfl

    root = os.path.dirname(os.path.abspath(fedjax_pfl.__file__))
    digest = hashlib.sha256(fedjax_pfl.__version__.encode())
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            digest.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()[:16]


def _describe(value: Any) -> str:
    if value is None:
        return "(not given)"
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def conflict(mine: dict, theirs: dict, who: int, me: int = 0) -> str | None:
    """The first fact on which process `who` disagrees with process `me`, in words, or None.
    Facts are flat or one level nested ({"flags": {...}}): a nested fact names its key."""
    for key in sorted(set(mine) | set(theirs)):
        a, b = mine.get(key), theirs.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            for sub in sorted(set(a) | set(b)):
                if _describe(a.get(sub)) != _describe(b.get(sub)):
                    return (f"process {who} was started with {arg(sub)} {_describe(b.get(sub))}, "
                            f"process {me} with {_describe(a.get(sub))}: start every process "
                            "with the same flags")
        elif _describe(a) != _describe(b):
            if key == "code":
                return (f"process {who} runs other code than process {me} (fedjax_pfl source "
                        f"digest {b} vs {a}): install the same version on every host")
            return (f"process {who} has {arg(key)} {_describe(b)}, process {me} has "
                    f"{_describe(a)}")
    return None


# ---- start-up ---------------------------------------------------------------------------------

def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise StartupError(f"{arg('coordinator')} must be HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def _send(sock: socket.socket, message: dict) -> None:
    sock.sendall((json.dumps(message, default=str) + "\n").encode())


def _receive(sock: socket.socket, deadline: float) -> dict | None:
    """One JSON line, or None when the peer closed or the deadline passed (polling, so that a
    signal is taken at once)."""
    data = b""
    while b"\n" not in data:
        if time.monotonic() > deadline:
            return None
        sock.settimeout(_POLL)
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            continue
        except OSError:
            return None
        if not chunk:
            return None
        data += chunk
    try:
        return json.loads(data.split(b"\n", 1)[0])
    except ValueError:
        return None


def _lead(port: int, num_processes: int, hello: dict, timeout: float) -> None:
    """Process 0's side of the handshake: every other process's hello, one verdict to all."""
    server = socket.socket(socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    with contextlib.suppress(OSError, AttributeError):
        server.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)   # IPv4 peers too
    try:
        server.bind(("", port))
    except OSError as e:
        server.close()
        raise StartupError(f"process 0 cannot listen on the {arg('coordinator')} port {port} "
                           f"({e.strerror}): another process 0 or another program holds it") from None
    server.listen(max(num_processes, 8))
    server.settimeout(_POLL)
    peers: dict[int, socket.socket] = {}
    problem = None
    deadline = time.monotonic() + timeout
    try:
        while len(peers) < num_processes - 1 and problem is None:
            if time.monotonic() > deadline:
                missing = sorted(set(range(1, num_processes)) - set(peers))
                raise StartupError(
                    f"process 0 waited {timeout:g} s ({arg('coordinator_timeout')}) for the other "
                    f"processes of {arg('num_processes')} {num_processes}; process"
                    f"{'es' if len(missing) > 1 else ''} {', '.join(map(str, missing))} did not "
                    "join (started? the same --coordinator?)")
            try:
                sock, _ = server.accept()
            except socket.timeout:
                continue
            theirs = _receive(sock, time.monotonic() + 10)
            if theirs is None:
                sock.close()
                continue
            who = theirs.get("process_id")
            if not isinstance(who, int) or not 0 < who < max(num_processes, theirs.get("num_processes", 0)):
                problem = (f"a process joined with {arg('process_id')} {who}, outside 1 .. "
                           f"{num_processes - 1} of process 0's {arg('num_processes')} {num_processes}")
            elif who in peers:
                problem = f"two processes were started with {arg('process_id')} {who}"
            else:
                problem = conflict(hello, {k: v for k, v in theirs.items() if k != "process_id"},
                                   who)
            peers.setdefault(who, sock)
            if peers[who] is not sock:
                _send(sock, {"ok": False, "error": problem})
                sock.close()
        verdict = {"ok": problem is None, "error": problem}
        for sock in peers.values():
            with contextlib.suppress(OSError):
                _send(sock, verdict)
        # The peers close first (their sockets, not the coordinator's, wait in TIME_WAIT), so
        # that JAX's service can bind the same port at once.
        for sock in peers.values():
            _receive(sock, time.monotonic() + 5)
    finally:
        for sock in peers.values():
            sock.close()
        server.close()
    if problem is not None:
        raise StartupError(problem)


def _join(host: str, port: int, hello: dict, timeout: float) -> None:
    """The other processes' side: connect (retrying until `timeout`), say hello, take the
    verdict."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=1.0)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise StartupError(
                    f"process {hello['process_id']}: no answer from the {arg('coordinator')} "
                    f"{host}:{port} within {timeout:g} s ({arg('coordinator_timeout')}): is "
                    "process 0 running, at that address and port?") from None
            time.sleep(_POLL)
    with sock:
        _send(sock, hello)
        verdict = _receive(sock, deadline + 10)
    if verdict is None:
        raise StartupError(f"process {hello['process_id']}: the {arg('coordinator')} {host}:{port} "
                           "closed the handshake without a verdict (is it a fedjax_pfl process 0?)")
    if not verdict.get("ok"):
        raise StartupError(str(verdict.get("error")))


def _serve(port: int, num_processes: int, heartbeat: int, linger: float, timeout: float):
    """JAX's coordination service in a process of its own (`python -m fedjax_pfl.distributed`),
    so that it outlives process 0: when process 0 dies the others keep a service to talk to,
    find process 0 lost and stop in one line (with the service inside process 0 they would end
    in XLA's abort). It ends when process 0 says it is done, or `linger` seconds after process
    0 ended without saying so."""
    import subprocess

    child = subprocess.Popen(
        [sys.executable, "-m", "fedjax_pfl.distributed", str(port), str(num_processes),
         str(heartbeat), str(linger)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        start_new_session=True)                # a terminal's Ctrl-C is for the run, not for it
    assert child.stdout is not None
    line = _line_within(child.stdout, timeout)
    if line.strip() != "ready":
        child.kill()
        raise StartupError(f"JAX's coordination service did not start on the {arg('coordinator')} "
                           f"port {port}: {line.strip() or 'no answer'}")
    return child


def _line_within(stream, timeout: float) -> str:
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(stream, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if sel.select(_POLL):
                return stream.readline()
    return ""


def _connect(coordinator: str, num_processes: int, process_id: int, heartbeat: int,
             timeout: float) -> None:
    """What `jax.distributed.initialize` does for a process whose service runs elsewhere: the
    client connected, JAX's distributed state set (jax.devices() then spans the processes)."""
    from jax._src import distributed as jax_distributed
    from jax._src.lib import _jax

    state = jax_distributed.global_state
    state.coordinator_address, state.process_id, state.num_processes = (
        coordinator, process_id, num_processes)
    state.client = _jax.get_distributed_runtime_client(
        coordinator, process_id, init_timeout=int(timeout) + 3600, use_compression=True,
        heartbeat_timeout=heartbeat)
    state.client.connect()
    state.initialize_preemption_sync_manager()


def _initialize(connect: Callable[[], None], timeout: float) -> None:
    """`connect()` in a thread (its waits are in C++, deaf to signals), given far more time
    than `timeout` by its caller so that our own deadline, not XLA's abort, ends a stuck start.
    Collectives on CPU through gloo."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    box: dict = {}

    def target():
        try:
            connect()
        except BaseException as e:          # handed to the main thread
            box["error"] = e

    worker = threading.Thread(target=target, name="fedjax_pfl-distributed-init", daemon=True)
    worker.start()
    deadline = time.monotonic() + timeout
    while worker.is_alive():
        if time.monotonic() > deadline:
            raise StartupError(f"JAX's distributed service did not start within {timeout:g} s "
                               f"({arg('coordinator_timeout')})")
        worker.join(_POLL)
    if "error" in box:
        first = str(box["error"]).strip().splitlines() or [type(box["error"]).__name__]
        raise StartupError(f"jax.distributed.initialize: {first[0]}")


def start(coordinator: str | None = None, num_processes: int | None = None,
          process_id: int | None = None, *, facts: dict | None = None, timeout: float = 60.0,
          peer_timeout: float | None = 30.0) -> None:
    """Joins a multi-process run (see the module's docstring): the handshake, JAX's
    distributed service (gloo on CPU), the facts checked, the watchdog started.

    Args:
      coordinator, num_processes, process_id: process 0's HOST:PORT, the process count and this
        process's index; all None under a launcher JAX recognises (SLURM, Open MPI, TPU pods,
        Kubernetes), which supplies them.
      facts: what every process must agree on besides the layout and the code version (the
        command line: its flags but --process-id), JSON-able.
      timeout: seconds to wait for the other processes before `StartupError`.
      peer_timeout: seconds without a sign of life before a process counts as lost (None: no
        watchdog).

    Raises StartupError (one line). SIGINT/SIGTERM during the waits raise KeyboardInterrupt /
    `interrupts.Terminated` in the main thread; leave with `os._exit` then.
    """
    import jax

    if not timeout > 0:
        raise StartupError(f"{arg('coordinator_timeout')} must be > 0 seconds, got {timeout}")
    if peer_timeout is not None and not peer_timeout > 0:
        raise StartupError(f"{arg('peer_timeout')} must be > 0 seconds, got {peer_timeout}")
    hello = {"num_processes": num_processes, "code": code_version(), **(facts or {})}
    layout = (coordinator, num_processes, process_id)
    if None not in layout:
        assert coordinator is not None and num_processes is not None and process_id is not None
        host, port = _split_address(coordinator)
        # XLA's own heartbeat verdict ends a process with an abort: it must come well after
        # the watchdog's.
        heartbeat = int(max(100.0, 2 * (peer_timeout or 0) + 60))
        if num_processes > 1:
            if process_id == 0:
                _lead(port, num_processes, hello, timeout)
            else:
                _join(host, port, {**hello, "process_id": process_id}, timeout)
        if process_id == 0:
            linger = 4 * (peer_timeout or 30.0) + 60
            service = _serve(port, num_processes, heartbeat, linger, timeout)
            _at_exit_release(service)
        _initialize(lambda: _connect(coordinator, num_processes, process_id, heartbeat,
                                     timeout), timeout)
    else:
        if any(x is not None for x in layout):
            raise StartupError(f"give all of {arg('coordinator')}, {arg('num_processes')} and "
                               f"{arg('process_id')}, or none (a launcher's)")
        from jax._src import clusters

        if not any(env.is_env_present() for env in clusters.ClusterEnv._cluster_types) \
                and not os.environ.get("JAX_COORDINATOR_ADDRESS"):
            raise StartupError(
                f"{arg('distributed')} auto: no launcher's process layout here (SLURM's srun, "
                "Open MPI's mpirun, a TPU pod, Kubernetes, or $JAX_COORDINATOR_ADDRESS): start "
                f"the processes under one, or give {arg('coordinator')}, {arg('num_processes')} "
                f"and {arg('process_id')}")
        _initialize(lambda: jax.distributed.initialize(initialization_timeout=int(timeout) + 3600),
                    timeout)
        hello["num_processes"] = jax.process_count()
        _agree_through_store(hello, timeout)
    if peer_timeout is not None and jax.process_count() > 1:
        Watchdog(peer_timeout).start()


def _at_exit_release(service) -> None:
    """At a normal exit: JAX's distributed client shut down first (its barrier needs the
    service), then the service told it may end."""
    import atexit

    def release():
        from jax._src import api

        with contextlib.suppress(BaseException):
            api.clean_up()                   # (registered by JAX before us: it would run after)
        with contextlib.suppress(BaseException):
            service.stdin.write("done\n")
            service.stdin.close()

    atexit.register(release)


def _client():
    from jax._src import distributed as jax_distributed

    return jax_distributed.global_state.client


def _agree_through_store(hello: dict, timeout: float) -> None:
    """The facts compared through the coordination service's key-value store (under a
    launcher, after the initialisation): every process reads every other's."""
    import jax

    client, me, n = _client(), jax.process_index(), jax.process_count()
    client.key_value_set(f"{_PREFIX}/facts/{me}", json.dumps(hello, default=str))
    deadline = time.monotonic() + timeout
    for who in range(n):
        if who == me:
            continue
        while True:
            try:
                theirs = json.loads(client.blocking_key_value_get(f"{_PREFIX}/facts/{who}",
                                                                  int(_POLL * 1000)))
                break
            except Exception:                # not there yet (deadline exceeded): poll again
                if time.monotonic() > deadline:
                    raise StartupError(f"process {who} did not publish its configuration within "
                                       f"{timeout:g} s ({arg('coordinator_timeout')})") from None
        problem = conflict(hello, theirs, who, me)
        if problem is not None:
            raise StartupError(problem)


# ---- the watchdog -----------------------------------------------------------------------------

_lost: PeerLost | None = None
_handling = threading.Event()          # the main thread is recording the loss: don't interrupt
_on_abandon: list[Callable[[PeerLost], None]] = []


def reset() -> None:
    """Forgets a loss (a notebook's next run, tests); a watchdog that found it then leaves the
    process alone."""
    global _lost
    _lost = None
    _handling.clear()
    Watchdog.running = None
    interrupts.note_lost_peer(None)


def lost() -> PeerLost | None:
    """The loss the watchdog found, or None."""
    return _lost


@contextlib.contextmanager
def on_abandon(hook: Callable[[PeerLost], None]):
    """Within the block, `hook(loss)` is what the watchdog runs before ending a process whose
    main thread is stuck in a collective (the runner: summary.json marked interrupted)."""
    _on_abandon.append(hook)
    try:
        yield
    finally:
        _on_abandon.remove(hook)


def explain(error: BaseException, wait: float | None = None) -> PeerLost | None:
    """The loss behind `error` when it is a collective that failed for a lost peer (or when the
    watchdog has found one), else None. Waits up to `wait` seconds (default: the watchdog's
    peer timeout and a margin) for the watchdog to name the process."""
    if isinstance(error, PeerLost):
        return error
    if Watchdog.running is None:
        return None
    text = str(error)
    collective = any(s in text for s in ("Gloo", "gloo", "Connection closed", "UNAVAILABLE",
                                         "Connection reset", "DEADLINE_EXCEEDED", "NCCL"))
    if _lost is None and not collective:
        return None
    _handling.set()
    deadline = time.monotonic() + (wait if wait is not None else Watchdog.running.timeout + 5)
    while _lost is None and time.monotonic() < deadline:
        time.sleep(_POLL)
    return _lost


class Watchdog(threading.Thread):
    """Signs of life through the coordination service (see the module's docstring)."""

    running: Watchdog | None = None

    def __init__(self, timeout: float, period: float | None = None, grace: float = 10.0, *,
                 client=None, process: int | None = None, processes: int | None = None):
        super().__init__(name="fedjax_pfl-watchdog", daemon=True)
        self._stopping = threading.Event()
        self.timeout, self.grace = float(timeout), float(grace)
        self.period = period if period is not None else min(2.0, self.timeout / 5)
        # (JAX's coordination client and layout by default; tests give a key-value store)
        self.client, self.process, self.processes = client, process, processes

    def start(self) -> None:
        import atexit

        Watchdog.running = self
        super().start()
        # (registered after JAX's shutdown and `_at_exit_release`: runs before them)
        atexit.register(self.stop)

    def stop(self, timeout: float = 5.0) -> None:
        """Ends the watch at a normal exit: publishes "done" (the others stop watching this
        process, which may wait at JAX's shutdown barrier for longer than their timeout) and
        joins the thread. A daemon thread still inside a call of the coordination client at the
        interpreter's finalisation is ended by a forced unwind through C++ frames that do not
        rethrow it: "FATAL: exception not rethrown", an abort (exit -6) after a finished run."""
        self._stopping.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout)

    def run(self) -> None:
        import jax

        global _lost
        client = self.client if self.client is not None else _client()
        me = self.process if self.process is not None else jax.process_index()
        n = self.processes if self.processes is not None else jax.process_count()
        others = [p for p in range(n) if p != me]
        seen: dict[int, tuple[str | None, float]] = {p: (None, time.monotonic()) for p in others}
        store_ok = time.monotonic()
        beat = 0
        while _lost is None and not self._stopping.is_set():
            now = time.monotonic()
            try:
                beat += 1
                client.key_value_set(f"{_PREFIX}/alive/{me}", str(beat), allow_overwrite=True)
                for p in others:
                    try:
                        value = client.key_value_try_get(f"{_PREFIX}/alive/{p}")
                    except Exception:         # not published yet
                        value = None
                    if value == _DONE:               # ended normally: no longer watched
                        seen[p] = (value, float("inf"))
                    elif value != seen[p][0]:
                        seen[p] = (value, now)
                store_ok = now
            except Exception:                 # the coordination service does not answer
                if me != 0 and now - store_ok > self.timeout:
                    _lost = PeerLost(0, f"the coordinator has not answered for {self.timeout:g} s")
                    break
            for p in others:
                if now - seen[p][1] > self.timeout:
                    _lost = PeerLost(p, f"no sign of life for {self.timeout:g} s")
                    break
            if _lost is None:
                self._stopping.wait(self.period)
        if _lost is None:                     # stopped (`stop`): say so, and leave
            with contextlib.suppress(Exception):
                client.key_value_set(f"{_PREFIX}/alive/{me}", _DONE, allow_overwrite=True)
            return
        loss = _lost
        interrupts.note_lost_peer(loss)
        if not _handling.is_set():
            import _thread
            import signal

            _thread.interrupt_main(signal.SIGTERM)   # the handlers raise PeerLost
        time.sleep(self.grace)
        if _handling.is_set():                       # the main thread is writing the record
            time.sleep(3 * self.grace)
        if _lost is not loss:                        # (forgotten: `reset`)
            return
        # The main thread is stuck (a collective whose peer hangs): record and leave.
        print(f"process {me}: {_lost}; ending this process", file=sys.stderr, flush=True)
        for hook in list(_on_abandon):
            with contextlib.suppress(BaseException):
                hook(_lost)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_LOST_PEER)


def _service_main(argv: list[str]) -> None:
    """`python -m fedjax_pfl.distributed PORT N HEARTBEAT LINGER`: the coordination service
    (`_serve`); "ready" on stdout once it listens; ends on "done" on stdin, or LINGER seconds
    after stdin closed without it."""
    port, num_processes, heartbeat, linger = int(argv[0]), int(argv[1]), int(argv[2]), float(argv[3])
    from jax._src.lib import _jax

    try:
        service = _jax.get_distributed_runtime_service(f"[::]:{port}", num_processes,
                                                       heartbeat_timeout=heartbeat)
    except Exception as e:
        print(" ".join(str(e).split())[:300], flush=True)
        os._exit(1)
    print("ready", flush=True)
    said = sys.stdin.read()
    if "done" not in said:                   # process 0 is gone: let the others find out
        time.sleep(linger)
    del service
    os._exit(0)


if __name__ == "__main__":
    _service_main(sys.argv[1:])
