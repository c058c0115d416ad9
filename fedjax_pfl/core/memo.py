"""What a probe program measured, remembered beside JAX's persistent compilation cache.

The automatic chunk size (`core.chunking.auto_chunk_size`) compiles a probe of one client's
step only to read XLA's memory and cost analyses: 2.4-2.7 CPU s for the two probes of the
peers' CIFAR-10 job on a cold start (issue 56). The persistent compilation cache keeps the
probes' executables only where its thresholds let it (JAX's default skips programs compiled in
under 1 s; `fedjax_pfl.use_compile_cache` keeps all), and even then a warm run loads them
(0.33 CPU s on that job) to read three numbers. The numbers a probe gives are a function of
the program and of the compiler that analyses it, so they are kept here under a hash of both:

- the probe's lowered StableHLO text (lowering the CIFAR-10 job's probes takes 0.2 s, compiling
  them 2.5 s): shapes, dtypes, constants, shardings and every lowering option are in it;
- how it is compiled (the compiling function's code and constants, e.g. its optimisation level);
- the compiler: jax and jaxlib versions, the backend's platform and platform version, the
  device kind and count, the host CPU (XLA:CPU compiles for its features), `XLA_FLAGS` and
  `LIBTPU_INIT_ARGS` in full (any flag may change buffer assignment; a changed flag only costs
  one probe).

Entries are small JSON files in a subdirectory of `jax.config.jax_compilation_cache_dir`,
written atomically (a temporary file renamed over the entry), so processes sharing the cache
never read half an entry; an unreadable or malformed entry is ignored and measured again.
With the persistent cache off (no directory, or `jax_enable_compilation_cache` false, or a
remote directory such as gs://) nothing is read or written and the probes compile as before.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import platform
import tempfile
from pathlib import Path
from typing import Callable

import jax

SUBDIRECTORY = "fedjax_pfl-probe-memo"
# Bump when what an entry means changes (its fields, or what the key leaves out).
FORMAT = 1
_FIELDS = ("temp_bytes", "output_bytes", "flops")


def directory() -> Path | None:
    """Where entries live: beside the persistent compilation cache when it is on and local;
    None otherwise (then nothing is remembered)."""
    cache = jax.config.jax_compilation_cache_dir
    if not cache or not jax.config.jax_enable_compilation_cache or "://" in str(cache):
        return None
    return Path(cache) / SUBDIRECTORY


@functools.lru_cache(maxsize=1)
def _host_cpu() -> str:
    """The host CPU's model and feature flags (Linux; the machine name elsewhere): XLA:CPU
    compiles for the features of the CPU it runs on, so a cache shared by machines must not
    answer one with the other's numbers."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            lines = [line.strip() for line in f if line.startswith(("model name", "flags"))]
        return " | ".join(lines[:2])
    except OSError:
        return platform.processor()


def _code_of(fn: Callable) -> str:
    """A function's bytecode, constants and names: changes when its options change."""
    code = fn.__code__
    return repr((code.co_code.hex(), code.co_consts, code.co_names))


def environment(compile_fn: Callable) -> dict:
    """Everything besides the program that decides what XLA's analyses report (module doc)."""
    import jaxlib

    device = jax.devices()[0]
    return {
        "format": FORMAT,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "platform": device.platform,
        "platform_version": getattr(device.client, "platform_version", ""),
        "device_kind": device.device_kind,
        "devices": jax.device_count(),
        "machine": platform.machine(),
        "cpu": _host_cpu(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "libtpu_init_args": os.environ.get("LIBTPU_INIT_ARGS", ""),
        "compile": _code_of(compile_fn),
    }


def key(lowered_text: str, compile_fn: Callable) -> str:
    """The entry's name: a SHA-256 of the lowered program and its environment."""
    facts = json.dumps(environment(compile_fn), sort_keys=True)
    return hashlib.sha256(f"{facts}\n{lowered_text}".encode()).hexdigest()


def load(where: Path, entry: str) -> tuple[int, int, float] | None:
    """(temp bytes, output bytes, flops) of an entry; None where it is missing, unreadable or
    malformed (then the caller measures again and overwrites it)."""
    try:
        record = json.loads((where / f"{entry}.json").read_text(encoding="utf-8"))
        temp, out, flops = (record[f] for f in _FIELDS)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    ints_ok = all(type(v) is int and v >= 0 for v in (temp, out))
    if record.get("format") != FORMAT or not ints_ok:
        return None
    if type(flops) not in (int, float) or not math.isfinite(flops) or flops < 0:
        return None
    return temp, out, float(flops)


def store(where: Path, entry: str, temp_bytes: int, output_bytes: int, flops: float,
          program: str = "") -> None:
    """Writes an entry atomically; a cache directory that cannot be written is no error (the
    next run measures again)."""
    record = {"format": FORMAT, "temp_bytes": int(temp_bytes),
              "output_bytes": int(output_bytes), "flops": float(flops), "program": program}
    temporary = None
    try:
        where.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=where, prefix=f".{entry}.", suffix=".tmp")
        with os.fdopen(handle, "w", encoding="utf-8") as f:
            json.dump(record, f)
        os.chmod(temporary, 0o644)            # (mkstemp's 0600; the cache's own files are 0644)
        os.replace(temporary, where / f"{entry}.json")
    except OSError:
        if temporary is not None:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
