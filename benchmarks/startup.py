#!/usr/bin/env python
"""Start-up by phase: where a run's seconds go before and around its rounds, cold (an
empty persistent compilation cache) and warm (the cache the cold run filled), every run a fresh
process; and the cold start of pfl-research and Flower on their CIFAR-10 job beside ours.

    python benchmarks/startup.py                                      # every job, medians of 3
    python benchmarks/startup.py --jobs fedavg --repeats 1
    python benchmarks/startup.py --jobs cifar10 --peers pfl-research flower --json startup.json
    python benchmarks/startup.py --jobs fedavg --rounds 2 --run-args "--model cnn"
    python benchmarks/startup.py --script my_script.py --script-args "--flag 1" --modes cold

Jobs:
  fedavg, pgfedmo, ditto   `python experiments/run.py --algo ALGO --out TMP` (its defaults: 50
                           rounds on the embedded digits, plots and checkpoints written; --rounds
                           and --run-args add flags). Cold: $FEDJAX_PFL_COMPILE_CACHE an empty
                           directory; warm: the next process, on the directory the cold run filled.
  cifar10                  benchmarks/peers/run_fedjax.py on the peers' CIFAR-10 job (pfl-
                           research's cifar10_iid: 1,000 clients of 50 images, 50 a round;
                           prepare.py writes it once into --work-dir from the real CIFAR-10 when
                           found, else synthetic images of the same shape and client sizes),
                           --cifar-rounds rounds (default 5), with --compile-cache. --peers runs
                           the same job cold in pfl-research and Flower (harness.py's venvs;
                           OMP_WAIT_POLICY=PASSIVE, telemetry off), interleaved with ours.
  --script PATH            any other Python script, by phase as below.

Phases. A run of ours goes through this script's own bootstrap (`--child`), which runs the job's
script with `runpy` after it has hooked, from outside the library:
  imports          interpreter start, and every module import wherever it happens
                   (importlib's `_find_and_load`, nested imports counted once)
  data and set-up  fedjax_pfl.runner.loop.load_data / prepare
  trace + lower    JAX's '/jax/core/compile/jaxpr_trace_duration' and
                   '/jax/core/compile/jaxpr_to_mlir_module_duration' events, and the rest of
                   core.Program.compile (the engine's own Python there)
  XLA compile      '/jax/core/compile/backend_compile_duration' events (a warm run: the cache read)
  initial state    core.Program.init, its own program's trace and compile included
  plots            every function of fedjax_pfl.plots
  checkpoints      fedjax_pfl.checkpoint.save / restore, fedjax_pfl.runner.checkpoints.save / load,
                   their compiles included
  rounds and evaluations   Program.run_rounds / evaluate, CachedEvaluation, the runner's round
                   loop (fedjax_pfl.runner.loop._rounds); a compile inside counts as compile
  other            the rest of the process's run: argument parsing, files, summaries
  teardown         from the end of the job's script to the process's exit, as the parent sees it
  total            launch to exit (parent); CPU: the child's rusage (os.wait4)
Time goes to the innermost phase open in the thread that carries the run: the main thread, or the
worker `fedjax_pfl.interrupts.compute` hands a call to while the main thread waits; a
`jax.block_until_ready` outside any phase is charged to the phase last left (the work it waits
for). So the phases add up to the total, wall and CPU (CPU: the whole process's while the run is
in that phase). Work in other threads (a concurrent compile, a background plot) is listed apart,
"in other threads", with its threads' own CPU: it overlaps the phases above. Programs are counted
with fedjax_pfl.compiles (how many, how many from the cache) and by the phase they compiled in.
The hooks are looked up by name when their module is imported: one that is not there (renamed,
moved) is listed as not found and its phase, if nothing else fed it, prints "–", never an error.

A peer's run reports no phases: its RESULT line's start-up (process start to round 1, harness.py's
definition; ours is reported the same way on the cifar10 job), round 1, the rounds, and the
parent's total wall and CPU (Flower's Ray workers are not the child's descendants it waits for,
so its CPU misses them). A peer that cannot be installed is said so in one line and skipped.

Order: per repeat every job's cold then warm run, and each peer, the units rotated every repeat
so drift hits them alike; cells are medians over --repeats, wall / CPU seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEERS_DIR = os.path.join(ROOT, "benchmarks", "peers")
LAUNCH_ENV = "STARTUP_LAUNCH_T"             # the parent's time.time() just before the child starts

PHASES = ("imports", "data and set-up", "trace + lower", "XLA compile", "initial state", "plots",
          "checkpoints", "rounds and evaluations", "other", "teardown")
# Phases that keep the compiles inside them: the initial state's own program, a checkpoint's
# slices are costs of that step, not of the round and evaluation.
ABSORBING = frozenset({"initial state", "plots", "checkpoints"})
BASE = "other"
JAX_EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace + lower",
              "/jax/core/compile/jaxpr_to_mlir_module_duration": "trace + lower",
              "/jax/core/compile/backend_compile_duration": "XLA compile"}
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"

# (phase, module, attribute): functions, or Class.method, wrapped when `module` is first imported.
# The defining modules, so that later `from module import name` gets the wrapper; "*" is every
# function the module defines.
REGIONS = (
    ("data and set-up", "fedjax_pfl.runner.loop", "load_data"),
    ("data and set-up", "fedjax_pfl.runner.loop", "prepare"),
    ("trace + lower", "fedjax_pfl.core", "Program.compile"),
    ("initial state", "fedjax_pfl.core", "Program.init"),
    ("rounds and evaluations", "fedjax_pfl.core", "Program.run_rounds"),
    ("rounds and evaluations", "fedjax_pfl.core", "Program.evaluate"),
    ("rounds and evaluations", "fedjax_pfl.core", "CachedEvaluation.__call__"),
    ("rounds and evaluations", "fedjax_pfl.runner.loop", "_rounds"),
    ("plots", "fedjax_pfl.plots", "*"),
    ("checkpoints", "fedjax_pfl.checkpoint", "save"),
    ("checkpoints", "fedjax_pfl.checkpoint", "restore"),
    ("checkpoints", "fedjax_pfl.runner.checkpoints", "save"),
    ("checkpoints", "fedjax_pfl.runner.checkpoints", "load"),
)
HANDOFFS = (("fedjax_pfl.interrupts", "compute"),)      # compute(fn, ...): fn may run in a worker
WAITS = (("jax", "block_until_ready"),)

JOBS = ("fedavg", "pgfedmo", "ditto", "cifar10")
PEERS = {"pfl-research": ("pfl", "run_pfl.py"), "flower": ("flower", "run_flower.py")}
DASH = "–"
# Figures the runs report themselves, shown below the total where a run has them.
EXTRA_ROWS = ("start-up to round 1 (RESULT)", "round 1 (RESULT)", "all rounds (RESULT)",
              "compile_time_s (summary.json)")


# ---------------------------------------------------------------- the child: the phase ledger


class Ledger:
    """Wall and CPU seconds per phase, charged at every phase boundary to the innermost phase open
    in the thread that carries the run (`fg`); other threads' phases are kept apart (`bg_*`) with
    their own thread CPU. Thread-safe: JAX reports compiles from any thread."""

    def __init__(self, imports_wall: float) -> None:
        self.lock = threading.Lock()
        self.fg = threading.get_ident()
        self.stacks: dict[int, list[tuple[str, object, str]]] = {self.fg: [(BASE, None, BASE)]}
        self.wall: dict[str, float] = {"imports": imports_wall}
        self.cpu: dict[str, float] = {"imports": time.process_time()}   # the interpreter's start
        self.bg_wall: dict[str, float] = {}
        self.bg_cpu: dict[str, float] = {}
        self.mark: dict[int, tuple[float, float]] = {self.fg: (time.perf_counter(), time.process_time())}
        self.left: dict[int, str] = {}            # per thread: the phase it last left
        self.by_context: dict[str, int] = {}      # programs compiled, by the phase they compiled in

    def _charge(self, t: int) -> None:
        """Charges thread t's time since its last boundary to its innermost phase (lock held)."""
        now = time.perf_counter()
        cpu = time.process_time() if t == self.fg else time.thread_time()
        last = self.mark.get(t)
        self.mark[t] = (now, cpu)
        stack = self.stacks.get(t)
        if last is None or not stack:
            return
        wall, cpus = (self.wall, self.cpu) if t == self.fg else (self.bg_wall, self.bg_cpu)
        label = stack[-1][0]
        wall[label] = wall.get(label, 0.0) + now - last[0]
        cpus[label] = cpus.get(label, 0.0) + cpu - last[1]

    def top(self, t: int) -> str:
        stack = self.stacks.get(t)
        return stack[-1][0] if stack else BASE

    def enter(self, phase: str, token: object) -> None:
        """Opens `phase` in this thread; inside an absorbing phase everything but imports stays
        in that phase."""
        t = threading.get_ident()
        with self.lock:
            self._charge(t)
            context = self.top(t)
            label = context if context in ABSORBING and phase != "imports" else phase
            self.stacks.setdefault(t, []).append((label, token, context))

    def leave(self, token: object) -> str | None:
        """Closes this thread's innermost phase opened with `token`; returns its context."""
        t = threading.get_ident()
        with self.lock:
            self._charge(t)
            stack = self.stacks.get(t) or []
            for i in range(len(stack) - 1, -1, -1):
                if stack[i][1] is token or stack[i][1] == token:
                    label, _, context = stack.pop(i)
                    self.left[t] = label
                    return context
            return None

    def wait_phase(self) -> str:
        """The phase a wait outside any phase belongs to: the one this thread last left."""
        t = threading.get_ident()
        with self.lock:
            inside = any(token is not None for _, token, _ in self.stacks.get(t) or [])
            return self.top(t) if inside else self.left.get(t, BASE)

    def adopt(self, caller: int) -> bool:
        """This thread carries on `caller`'s run (caller waits for it): its phases, its clock."""
        me = threading.get_ident()
        if me == caller:
            return False
        with self.lock:
            self.stacks[me] = list(self.stacks.get(caller, [(BASE, None, BASE)]))
            if self.fg == caller:
                self._charge(caller)
                self.fg = me
                self.mark[me] = (time.perf_counter(), time.process_time())
            else:
                self.mark.pop(me, None)
                self._charge(me)
        return True

    def release(self, caller: int) -> None:
        me = threading.get_ident()
        with self.lock:
            self._charge(me)
            if self.fg == me:
                self.fg = caller
                self.mark[caller] = (time.perf_counter(), time.process_time())
            self.stacks.pop(me, None)
            self.mark.pop(me, None)
            if me in self.left:
                self.left[caller] = self.left.pop(me)

    def close(self) -> None:
        with self.lock:
            self._charge(self.fg)


def _wrapped(ledger: Ledger, fn, phase: str, token: object):
    import functools

    @functools.wraps(fn)
    def region(*args, **kwargs):
        ledger.enter(phase, token)
        try:
            return fn(*args, **kwargs)
        finally:
            ledger.leave(token)

    region.__startup_original__ = fn
    return region


class Hooks:
    """Patches REGIONS, HANDOFFS and WAITS into their modules as those are imported."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.pending: dict[str, list[tuple[str, str, str]]] = {}
        for phase, module, attr in REGIONS:
            self.pending.setdefault(module, []).append(("region", phase, attr))
        for module, attr in HANDOFFS:
            self.pending.setdefault(module, []).append(("handoff", "", attr))
        for module, attr in WAITS:
            self.pending.setdefault(module, []).append(("wait", "", attr))
        self.pending.setdefault("jax", []).append(("jax", "", ""))
        self.not_found: list[str] = []
        self.compile_log = None           # fedjax_pfl.compiles.Log of the whole run, if there

    def after_import(self, name: str) -> None:
        todo = self.pending.pop(name, None)
        if todo is None:
            return
        module = sys.modules.get(name)
        if module is None:
            self.pending[name] = todo     # (its import failed: maybe a later one succeeds)
            return
        for kind, phase, attr in todo:
            try:
                self._patch(module, kind, phase, attr)
            except Exception as e:        # a hook must never break the run it measures
                self.not_found.append(f"{name}:{attr or kind} ({type(e).__name__}: {e})")

    def _resolve(self, module, attr: str):
        """(owner, name, function) of `attr` ("f" or "Class.method") in `module`."""
        owner, *rest = attr.split(".")
        if not rest:
            return module, attr, getattr(module, attr)
        cls = getattr(module, owner)
        return cls, rest[0], getattr(cls, rest[0])

    def _patch(self, module, kind: str, phase: str, attr: str) -> None:
        name = module.__name__
        if kind == "jax":
            return self._listen()
        if attr == "*":
            fns = [(k, v) for k, v in vars(module).items()
                   if hasattr(v, "__code__") and getattr(v, "__module__", None) == name]
            if not fns:
                self.not_found.append(f"{name}:* (no functions)")
            for k, v in fns:
                setattr(module, k, _wrapped(self.ledger, v, phase, (name, k)))
            return
        try:
            owner, key, fn = self._resolve(module, attr)
        except AttributeError:
            self.not_found.append(f"{name}:{attr}")
            return
        if not callable(fn) or hasattr(fn, "__startup_original__"):
            if not callable(fn):
                self.not_found.append(f"{name}:{attr} (not callable)")
            return
        if kind == "region":
            setattr(owner, key, _wrapped(self.ledger, fn, phase, (name, attr)))
        elif kind == "handoff":
            setattr(owner, key, self._handoff(fn))
        elif kind == "wait":
            setattr(owner, key, self._wait(fn))

    def _handoff(self, fn):
        import functools

        ledger = self.ledger

        @functools.wraps(fn)
        def handoff(call, *args, **kwargs):
            caller = threading.get_ident()

            def carried(*a, **k):
                adopted = ledger.adopt(caller)
                try:
                    return call(*a, **k)
                finally:
                    if adopted:
                        ledger.release(caller)

            return fn(carried, *args, **kwargs)

        handoff.__startup_original__ = fn
        return handoff

    def _wait(self, fn):
        import functools

        ledger = self.ledger

        @functools.wraps(fn)
        def wait(*args, **kwargs):
            token = object()
            ledger.enter(ledger.wait_phase(), token)
            try:
                return fn(*args, **kwargs)
            finally:
                ledger.leave(token)

        wait.__startup_original__ = fn
        return wait

    def _listen(self) -> None:
        """JAX's compile events: each one a phase of its own thread, from start (the scalar JAX
        records on entering) to end (the duration it records on leaving)."""
        from jax import monitoring

        ledger = self.ledger

        def on_scalar(event, value, **kwargs):
            if event in JAX_EVENTS:
                ledger.enter(JAX_EVENTS[event], event)

        def on_duration(event, duration, **kwargs):
            if event in JAX_EVENTS:
                context = ledger.leave(event)
                if event == BACKEND_COMPILE and context is not None:
                    with ledger.lock:
                        ledger.by_context[context] = ledger.by_context.get(context, 0) + 1

        monitoring.register_scalar_listener(on_scalar)
        monitoring.register_event_duration_secs_listener(on_duration)
        try:
            from fedjax_pfl import compiles

            self._recorder = compiles.record()
            self.compile_log = self._recorder.__enter__()
        except Exception as e:            # (a checkout without fedjax_pfl.compiles)
            self.not_found.append(f"fedjax_pfl.compiles ({type(e).__name__})")


def _hook_imports(ledger: Ledger, hooks: Hooks) -> bool:
    """Times every import: importlib's `_find_and_load` (what an import statement and
    importlib.import_module call for a module not yet in sys.modules)."""
    import importlib._bootstrap as bootstrap

    original = getattr(bootstrap, "_find_and_load", None)
    if original is None:
        hooks.not_found.append("importlib._bootstrap._find_and_load")
        return False
    token = "import"

    def find_and_load(name, import_):
        ledger.enter("imports", token)
        try:
            return original(name, import_)
        finally:
            ledger.leave(token)
            hooks.after_import(name)

    bootstrap._find_and_load = find_and_load
    return True


def child(ledger_path: str, script: str, args: list[str]) -> None:
    """Runs `script` as `python script args...` would, by phase, and writes the ledger."""
    import runpy
    import traceback

    launch = float(os.environ.get(LAUNCH_ENV, time.time()))
    ledger = Ledger(imports_wall=max(0.0, time.time() - launch))
    hooks = Hooks(ledger)
    _hook_imports(ledger, hooks)
    for name in list(hooks.pending):     # (modules the bootstrap itself has imported)
        if name in sys.modules:
            hooks.after_import(name)
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    status = 0
    real_exit, left = os._exit, []

    def leaving(code: int = 0) -> None:   # the script's own exit without teardown (run.py's)
        left.append(code)
        raise SystemExit(code)

    os._exit = leaving
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        status = 1
    finally:
        os._exit = real_exit
    ledger.close()
    log = hooks.compile_log
    record = dict(
        wall=ledger.wall, cpu=ledger.cpu, bg_wall=ledger.bg_wall, bg_cpu=ledger.bg_cpu,
        programs=None if log is None else len(log.programs),
        from_cache=None if log is None else log.from_cache,
        programs_by_phase=ledger.by_context, not_found=hooks.not_found,
        pending=sorted(hooks.pending), status=status,
        t_end=time.time(), cpu_end=time.process_time())
    with open(ledger_path, "w") as f:
        json.dump(record, f)
    sys.stdout.flush()
    if left:                               # (as the script would have left: no teardown)
        sys.stderr.flush()
        real_exit(status)
    sys.exit(status)


# ---------------------------------------------------------------- the parent: runs and tables


def measure(cmd: list[str], env: dict, log_path: str, ledger_path: str | None = None,
            timeout: float = 1800) -> dict:
    """One fresh process: total wall (launch to exit) and CPU (its rusage), its ledger if it
    went through the bootstrap, its RESULT line if it printed one (the peers' runners)."""
    if ledger_path and os.path.exists(ledger_path):
        os.remove(ledger_path)
    env = dict(env)
    with open(log_path, "w") as out:
        t0 = time.time()
        env[LAUNCH_ENV] = env["PEERS_LAUNCH_T"] = repr(t0)
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        deadline = t0 + timeout
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.time() > deadline:
                proc.kill()
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.005)
        t_exit = time.time()
    proc.returncode = os.waitstatus_to_exitcode(status)
    run = dict(cmd=cmd, status=proc.returncode, total_wall=t_exit - t0,
               total_cpu=usage.ru_utime + usage.ru_stime, log=log_path)
    text = open(log_path, errors="replace").read()
    results = [line for line in text.splitlines() if line.startswith("RESULT ")]
    if results:
        try:
            run["result"] = json.loads(results[-1][len("RESULT "):])
        except json.JSONDecodeError:
            pass
    if ledger_path and os.path.exists(ledger_path):
        with open(ledger_path) as f:
            ledger = json.load(f)
        ledger["wall"]["teardown"] = max(0.0, t_exit - ledger["t_end"])
        ledger["cpu"]["teardown"] = max(0.0, run["total_cpu"] - ledger["cpu_end"])
        run["ledger"] = ledger
    if proc.returncode != 0:
        run["error"] = text[-2000:]
    return run


def job_command(job: str, args, cifar_path: str | None) -> list[str]:
    """The job's script and arguments (run through the bootstrap)."""
    if job == "cifar10":
        return [os.path.join(PEERS_DIR, "run_fedjax.py"), cifar_path, "--rounds", str(args.cifar_rounds),
                "--algo", "fedavg", "--compile-cache"]
    if job == "script":
        return [args.script, *shlex.split(args.script_args)]
    flags = ["--algo", job]
    if args.rounds:
        flags += ["--rounds", str(args.rounds)]
    return [os.path.join(ROOT, "experiments", "run.py"), *flags, *shlex.split(args.run_args)]


def run_ours(job: str, args, cifar_path: str | None, scratch: str, rep: int) -> list[dict]:
    """The job cold (an empty cache directory) then, per --modes, warm (the same directory)."""
    cache = tempfile.mkdtemp(prefix="cache-", dir=scratch)
    env = {**os.environ, "FEDJAX_PFL_COMPILE_CACHE": cache, "OMP_WAIT_POLICY": "PASSIVE"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    runs = []
    for mode in args.modes:
        script, *rest = job_command(job, args, cifar_path)
        if job in ("fedavg", "pgfedmo", "ditto"):
            rest += ["--out", os.path.join(scratch, f"{job}-{mode}-{rep}")]
        stem = os.path.join(scratch, f"{job}-{mode}-{rep}")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", stem + ".ledger.json", script, *rest]
        run = measure(cmd, env, stem + ".log", stem + ".ledger.json", args.timeout)
        summary = os.path.join(scratch, f"{job}-{mode}-{rep}", "summary.json")
        if os.path.exists(summary):
            with open(summary) as f:
                run["summary_compile_s"] = json.load(f).get("compile_time_s")
        run.update(job=job, mode=mode, repeat=rep, side="fedjax_pfl")
        runs.append(run)
        say(run)
    return runs


def run_peer(peer: str, python: str, args, cifar_path: str, scratch: str, rep: int) -> dict:
    _, runner = PEERS[peer]
    cmd = [python, os.path.join(PEERS_DIR, runner), cifar_path, "--rounds", str(args.cifar_rounds),
           "--device", "cpu"]
    cmd += (["--threads", str(os.cpu_count())] if peer == "pfl-research"
            else ["--client-cpus", "2", "--client-gpus", "0.25"])
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", FLWR_TELEMETRY_ENABLED="0",
               RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)
    stem = os.path.join(scratch, f"{peer}-cold-{rep}")
    run = measure(cmd, env, stem + ".log", None, args.timeout)
    run.update(job="cifar10", mode="cold", repeat=rep, side=peer)
    say(run)
    return run


def say(run: dict) -> None:
    what = f"{run['job']} {run['side']} {run['mode']} (repeat {run['repeat'] + 1})"
    if run["status"] != 0:
        print(f"[startup] {what}: FAILED (exit {run['status']}), log {run['log']}", flush=True)
        return
    print(f"[startup] {what}: {run['total_wall']:.1f} s wall / {run['total_cpu']:.1f} s CPU",
          flush=True)


def peer_pythons(args) -> dict[str, str]:
    """The peers' interpreters (harness.py's venvs, made if missing); a peer that cannot be
    installed is said in one line and left out."""
    if not args.peers:
        return {}
    sys.path.insert(0, PEERS_DIR)
    import harness  # (imports only the standard library and common.py)

    pythons = {}
    for peer in args.peers:
        try:
            pythons[peer] = harness.ensure_venv(PEERS[peer][0], args.venv_dir, args.torch_wheel)
        except (SystemExit, OSError, subprocess.SubprocessError) as e:
            print(f"[startup] {peer}: not run: could not install its environment ({e})", flush=True)
    return pythons


def cifar_job(args) -> str:
    sys.path.insert(0, PEERS_DIR)
    import harness

    os.makedirs(args.work_dir, exist_ok=True)
    # At least 5 rounds scheduled: the job's file (and its synthetic images) is then the same for
    # any shorter run, written once.
    return harness.prepare("cifar10", max(5, args.cifar_rounds), 0, False, args.work_dir)


# ---------------------------------------------------------------- tables


def phase_cells(run: dict) -> dict[str, tuple[float, float] | None]:
    """phase -> (wall, CPU), None where the run has no figure for it."""
    cells: dict[str, tuple[float, float] | None] = {}
    ledger = run.get("ledger")
    for p in PHASES:
        if ledger and p in ledger["wall"]:
            cells[p] = (ledger["wall"][p], ledger["cpu"].get(p, 0.0))
        else:
            cells[p] = None
    if run["status"] == 0:
        cells["total"] = (run["total_wall"], run["total_cpu"])
    result = run.get("result") or {}
    if "startup_s" in result:
        cells["start-up to round 1 (RESULT)"] = (result["startup_s"], float("nan"))
        rounds = result.get("round_s") or []
        if rounds:
            cells["round 1 (RESULT)"] = (rounds[0], float("nan"))
            cells["all rounds (RESULT)"] = (sum(rounds), float("nan"))
    if run.get("summary_compile_s") is not None:
        cells["compile_time_s (summary.json)"] = (run["summary_compile_s"], float("nan"))
    return cells


def median_cell(runs: list[dict], row: str) -> str:
    values = [c for c in (phase_cells(r).get(row) for r in runs) if c is not None]
    if not values:
        return DASH
    wall = statistics.median(v[0] for v in values)
    cpus = [v[1] for v in values if v[1] == v[1]]
    return f"{wall:.2f} / {statistics.median(cpus):.2f}" if cpus else f"{wall:.2f}"


def programs_cell(runs: list[dict]) -> str:
    ledgers = [r["ledger"] for r in runs if r.get("ledger")]
    counts = [lg["programs"] for lg in ledgers if lg.get("programs") is not None]
    if not counts:
        return DASH
    hits = [lg["from_cache"] for lg in ledgers if lg.get("from_cache") is not None]
    return f"{statistics.median(counts):g}, {statistics.median(hits):g} cached"


def by_phase_cell(runs: list[dict]) -> str:
    ledgers = [r["ledger"] for r in runs if r.get("ledger")]
    if not ledgers:
        return DASH
    where = ledgers[0].get("programs_by_phase") or {}
    # A compile whose innermost phase was "trace + lower" ran inside Program.compile (or while a
    # trace computed something eagerly).
    named = {"trace + lower": "Program.compile"}
    return ", ".join(f"{named.get(k, k)} {v}"
                     for k, v in sorted(where.items(), key=lambda kv: -kv[1])) or DASH


def background_cell(runs: list[dict]) -> str:
    ledgers = [r["ledger"] for r in runs if r.get("ledger")]
    if not ledgers:
        return DASH
    walls = ledgers[0].get("bg_wall") or {}
    shown = [f"{k} {statistics.median(lg['bg_wall'].get(k, 0.0) for lg in ledgers):.2f}"
             f"/{statistics.median(lg['bg_cpu'].get(k, 0.0) for lg in ledgers):.2f}"
             for k in walls]
    return ", ".join(shown) or "none"


def columns_of(job: str, runs: list[dict]) -> list[tuple[str, list[dict]]]:
    cols = []
    for side in ["fedjax_pfl", *PEERS]:
        for mode in ("cold", "warm"):
            sel = [r for r in runs if r["job"] == job and r["side"] == side and r["mode"] == mode
                   and r["status"] == 0]
            if sel:
                cols.append((mode if side == "fedjax_pfl" else f"{side} {mode}", sel))
    return cols


def table(job: str, runs: list[dict], title: str) -> list[str]:
    """The job's phases × columns (cold, warm, peers), medians over repeats, wall / CPU s."""
    cols = columns_of(job, runs)
    failed = [r for r in runs if r["job"] == job and r["status"] != 0]
    lines = [f"\n{title}"]
    if not cols:
        return lines + [f"  no successful run ({len(failed)} failed; logs: "
                        f"{', '.join(r['log'] for r in failed)})"]
    n = max(len(c[1]) for c in cols)
    lines.append(f"  medians of {n}, wall / CPU s")
    rows = list(PHASES) + ["total"]
    present = {k for _, sel in cols for r in sel for k in phase_cells(r)}
    rows += [k for k in EXTRA_ROWS if k in present]
    width = max(len(r) for r in rows + ["programs (fedjax_pfl.compiles)"]) + 2
    cw = 22
    lines.append("  " + "phase".ljust(width) + "".join(name.rjust(cw) for name, _ in cols))
    for row in rows:
        cells = [median_cell(sel, row) for _, sel in cols]
        if row == "total":
            lines.append("  " + "-" * (width + cw * len(cols)))
        lines.append("  " + row.ljust(width) + "".join(c.rjust(cw) for c in cells))
    ours = [(name, sel) for name, sel in cols if sel[0]["side"] == "fedjax_pfl"]
    if ours:
        lines.append("  " + "programs (fedjax_pfl.compiles)".ljust(width)
                     + "".join(programs_cell(sel).rjust(cw) for _, sel in ours))
        for name, sel in ours:
            lines.append(f"  {name}: programs compiled by phase: {by_phase_cell(sel)}")
            lines.append(f"  {name}: in other threads (overlapping the above), wall/CPU s: "
                         f"{background_cell(sel)}")
        missing = sorted({m for _, sel in ours for r in sel for m in r["ledger"].get("not_found", [])})
        if missing:
            lines.append(f"  hooks not found: {'; '.join(missing)}")
    for r in failed:
        lines.append(f"  FAILED: {r['side']} {r['mode']} repeat {r['repeat'] + 1} (exit {r['status']}), "
                     f"log {r['log']}")
    return lines


def titles(args, cifar_path: str | None) -> dict[str, str]:
    out = {}
    for job in args.jobs:
        cmd = job_command(job, args, cifar_path)
        shown = " ".join(os.path.relpath(c, ROOT) if os.path.isabs(c) else c for c in cmd)
        out[job] = f"{job}: python {shown}"
    return out


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:                # the bootstrap: --child LEDGER SCRIPT ARGS...
        child(argv[1], argv[2], argv[3:])
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", nargs="*", default=list(JOBS), choices=JOBS, help="default: all four")
    p.add_argument("--script", help="time this Python script by phase instead of --jobs")
    p.add_argument("--script-args", default="", help="--script's arguments, one string")
    p.add_argument("--modes", nargs="+", default=["cold", "warm"], choices=("cold", "warm"),
                   help="cold: an empty compilation cache; warm: the one the cold run filled")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats (default 3)")
    p.add_argument("--rounds", type=int, default=0,
                   help="fedavg/pgfedmo/ditto: --rounds for run.py (default: its own, 50)")
    p.add_argument("--run-args", default="", help="more experiments/run.py flags, one string")
    p.add_argument("--cifar-rounds", type=int, default=5, help="the cifar10 job's rounds (default 5)")
    p.add_argument("--peers", nargs="*", default=[], choices=list(PEERS),
                   help="also run the cifar10 job cold in these peers (harness.py's venvs)")
    p.add_argument("--venv-dir", default=os.path.join(PEERS_DIR, ".venvs"))
    p.add_argument("--work-dir", default=os.path.join(PEERS_DIR, "work"),
                   help="where the cifar10 job is prepared (default benchmarks/peers/work)")
    p.add_argument("--torch-wheel", default=os.environ.get("PEERS_TORCH_WHEEL"),
                   help="a torch wheel for new peer venvs (default $PEERS_TORCH_WHEEL)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds a run (default 1800)")
    p.add_argument("--json", help="write every run and the tables here")
    p.add_argument("--keep", help="keep the runs' logs, ledgers and outputs in this directory")
    args = p.parse_args(argv)
    if args.script:
        args.jobs = ["script"]
    if args.peers and "cifar10" not in args.jobs:
        p.error("--peers runs the cifar10 job: add cifar10 to --jobs")
    scratch = args.keep or tempfile.mkdtemp(prefix="startup-")
    os.makedirs(scratch, exist_ok=True)
    cifar_path = cifar_job(args) if "cifar10" in args.jobs else None
    pythons = peer_pythons(args)
    units = [("ours", job) for job in args.jobs] + [("peer", peer) for peer in pythons]
    runs: list[dict] = []
    for rep in range(args.repeats):
        k = rep % len(units)
        for kind, name in units[k:] + units[:k]:
            if kind == "ours":
                runs += run_ours(name, args, cifar_path, scratch, rep)
            else:
                runs.append(run_peer(name, pythons[name], args, cifar_path, scratch, rep))
    named = titles(args, cifar_path)
    lines = [f"machine: {os.cpu_count()} cores; load {os.getloadavg()[0]:.2f}; "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"]
    for job in args.jobs:
        lines += table(job, runs, named[job])
    for peer in args.peers:
        if peer not in pythons:
            lines.append(f"\n{peer}: not run (could not install its environment; see above)")
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(runs=runs, tables="\n".join(lines), argv=argv), f, indent=1, default=str)
    if not args.keep:
        import shutil

        shutil.rmtree(scratch, ignore_errors=True)
    return 0 if all(r["status"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
