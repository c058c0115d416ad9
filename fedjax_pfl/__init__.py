"""fedjax_pfl: a JAX functional simulation engine for personalized federated learning.

    import fedjax_pfl
    fedjax_pfl.use_cpu_cores()          # optional, before any JAX computation: one device per core
    fedjax_pfl.use_compile_cache()      # optional: reuse compiled rounds across runs
    fedjax_pfl.init_distributed("10.0.0.1:1234", num_processes=2, process_id=0)   # multi-process
    from fedjax_pfl import algorithms, data, models, core, ops
"""

from __future__ import annotations

import os

__version__ = "0.1.0"

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def use_cpu_cores(count: int | None = None) -> int:
    """Exposes `count` CPU cores (default: all, or $FEDJAX_PFL_CPU_DEVICES) as XLA devices.

    XLA:CPU runs one vectorised client step on about one core; with one device per core the engine
    splits the sampled clients across devices (shard_map) and uses the whole machine (1.7× on 2
    cores, docs/decisions/cpu-devices.md). It only takes effect before JAX creates its CPU backend, i.e.
    before the first computation; later it changes nothing. It does nothing either when XLA_FLAGS
    already sets the device count. GPU runs are unaffected (the flag concerns the host platform).

    Returns:
      The device count requested (1 if nothing was changed).
    """
    import jax._src.xla_bridge as xla_bridge

    env = os.environ.get("FEDJAX_PFL_CPU_DEVICES")
    count = int(env) if env else (count or os.cpu_count() or 1)
    flags = os.environ.get("XLA_FLAGS", "")
    if count <= 1 or _DEVICE_COUNT_FLAG in flags or xla_bridge.backends_are_initialized():
        return 1
    os.environ["XLA_FLAGS"] = f"{flags} {_DEVICE_COUNT_FLAG}={count}".strip()
    return count


def use_compile_cache(setting: bool | str | os.PathLike | None = None) -> str | None:
    """Turns on JAX's persistent compilation cache (or off, with False); returns the directory in
    use, or None for no cache.

    `setting` as `RunConfig.compile_cache` takes it (`fedjax_pfl.compile_cache`): None or True,
    the default directory ($FEDJAX_PFL_COMPILE_CACHE; else the user's own
    `jax_compilation_cache_dir`, e.g. $JAX_COMPILATION_CACHE_DIR; else
    $XDG_CACHE_HOME/fedjax_pfl/jax or ~/.cache/fedjax_pfl/jax; none where
    $FEDJAX_PFL_COMPILE_CACHE=off); a directory; False, off. A directory that cannot be written,
    or that every user may write, gives one warning and no cache, never an error.

    A compiled XLA executable is stored under a key of the program and compiler settings, so a
    second run of the same configuration (same algorithm, model, shapes, backend and devices)
    loads its round and evaluation instead of compiling them: the same executable, the same bits.
    `runner.prepare` / `runner.run`, the command line and the sweeps call this with the run's
    `compile_cache` (default True; --no-compile-cache: False), so a notebook needs it only to
    change the setting for code that compiles outside a run.
    """
    from fedjax_pfl import compile_cache

    return compile_cache.apply(True if setting is None else setting)


def init_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None, *, timeout: float = 60.0,
                     peer_timeout: float | None = 30.0, facts: dict | None = None) -> None:
    """Joins a multi-process run (one process per host, or several on one host): afterwards
    `jax.devices()` lists the devices of every process, and the engine's mesh, sharded client
    state and rounds span them all. Call it before any JAX computation, in every process, with the
    same coordinator address (host:port of process 0) and process count — or with no arguments
    under a launcher that JAX recognises (SLURM's srun, Open MPI's mpirun, TPU pods, Kubernetes),
    which then supplies them. Run one process per GPU host (or per GPU); on CPU, each process
    exposes $FEDJAX_PFL_CPU_DEVICES devices (default 1).

    The processes first check that they agree (process count, code, `facts`) and wait at most
    `timeout` seconds for each other; a process silent for `peer_timeout` seconds later is lost,
    and the others stop as after SIGTERM (`fedjax_pfl.distributed`). Raises
    `distributed.StartupError` (one line). On CPU the processes exchange data through gloo; on
    GPUs through NCCL. Only process 0 writes the run's files.
    """
    from fedjax_pfl import distributed

    if _backend_started():
        raise RuntimeError("init_distributed must run before the first JAX computation")
    if os.environ.get("FEDJAX_PFL_CPU_DEVICES"):     # this process's own CPU devices
        use_cpu_cores()
    distributed.start(coordinator_address, num_processes, process_id, facts=facts,
                      timeout=timeout, peer_timeout=peer_timeout)


def _backend_started() -> bool:
    import jax._src.xla_bridge as xla_bridge

    return xla_bridge.backends_are_initialized()
