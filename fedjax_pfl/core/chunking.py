"""How many clients one vectorised chunk holds: budgets on a CPU device and their calibration,
and a memory bound on accelerators.

The chunked backend (`core.execution`) runs the sampled clients W at a time. W comes from
budgets on one client's temporaries, outputs and floating-point operations, read from XLA's
memory and cost analyses of one client's step (or from upper bounds of them off the traced
program, `core.analysis`, which need no compilation). With the persistent compilation cache on,
the analysed numbers are remembered beside it (`core.memo`), so a later run compiles no probe.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import numpy as np

from fedjax_pfl.core import memo
from fedjax_pfl.core.analysis import Bounds, compiled_for_analysis, traced_bounds

Params = Any

AUTO_CHUNK = 0
# Budgets of one chunk on one CPU device, calibrated on this project's 2-core machines
# (benchmarks/RESULTS.md, "Automatic chunk size"). Speed: a chunk's temporaries (activations,
# im2col patches) should stay near the cache; the MLP has almost none (whole vmap is fastest:
# per-op overhead dominates) and the FedAvg CNN ~6.7 MB (B = 10) or ~22 MB (B = 32) per client,
# whose measured optimum is a chunk of 1 (more clients spill their im2col patches out of the L2;
# docs/decisions/cnn-step.md).
# Memory: temporaries plus outputs (the clients' parameters and optimizer state) stay within a
# bound, so peak memory does not grow with the number of clients.
CHUNK_TEMP_BUDGET_BYTES = 16 * 2**20
# Vectorising clients pays while one client's step is too small to keep the cores busy (small
# GEMMs, per-op overhead); past about this much work per chunk step, wider chunks only spill the
# caches. Calibrated on 2 AVX2 cores (benchmarks/RESULTS.md, "Automatic chunk size";
# docs/decisions/mlp-round.md): the 784-100-10 MLP at B = 10 (3.3 MFLOP per client step by
# XLA's cost analysis) was fastest at chunks of 8-16 and gets 14, the FedAvg CNN at B = 10
# (253 MFLOP) gets 1.
CHUNK_FLOP_TARGET = 48e6
# The work target marks a plateau, not an edge: the MLP's measured optimum spans chunks of 8-16
# around the 14 it gets. So where the traced bounds fit a device's clients in one chunk within
# this multiple of the work target (and within the memory budgets themselves), the engine runs
# them as one chunk and compiles no probe (`core.execution.MapperCache.auto_chunk`): PGFedMo's
# default run, 5 clients a device whose traced step bound is 1.4x XLA's count, compiled a probe
# before round 1 only to be told 5 (docs/decisions/startup.md).
WORK_TARGET_SLACK = 2.0
CHUNK_MEMORY_BUDGET_BYTES = 2**30
# Accelerators want the widest batch, so a chunk there is limited by memory alone: one chunk's
# temporaries and outputs within this fraction of the device's memory. Without it, a mapper call
# over every client (an evaluation of N personal models) vectorised all of them at once:
# 3,400 clients × ~25 MB of a CNN's evaluation activations is more than any one GPU holds.
ACCELERATOR_CHUNK_MEMORY_FRACTION = 0.25


def on_cpu() -> bool:
    """Whether computations run on XLA:CPU (the budgets above), not on an accelerator."""
    return jax.default_backend() == "cpu"


@functools.lru_cache(maxsize=1)
def device_memory_limit() -> int:
    """Bytes of memory of the smallest device this run computes on (0 where the backend reports
    none): this process's devices, and in a run of several processes every process's, agreed by
    one exchange at the first call, since every process must build the same program and so the
    same chunks (every process reaches the first call at the same point of the same trace)."""
    limits = [int((d.memory_stats() or {}).get("bytes_limit", 0)) for d in jax.local_devices()]
    limit = min(limits) if limits else 0
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        every = np.asarray(multihost_utils.process_allgather(np.asarray([limit // 2**20], np.int32)))
        limit = int(every.min()) * 2**20                  # (in MiB: JAX holds int32 without x64)
    return limit


def accelerator_chunk_budget() -> int:
    """Bytes one chunk's temporaries and outputs may take on an accelerator (0: no limit known)."""
    return int(ACCELERATOR_CHUNK_MEMORY_FRACTION * device_memory_limit())


def _accelerator_budgets() -> tuple[int, int, float] | None:
    """(temp, memory, flop) budgets of a chunk on an accelerator: memory alone (0: no budget of
    that kind); None where the device reports no memory (then the whole vmap)."""
    memory = accelerator_chunk_budget()
    return (0, memory, 0.0) if memory > 0 else None


def auto_chunk_size(one_client_fn: Callable, *abstract_args: Any,
                    temp_budget_bytes: int = CHUNK_TEMP_BUDGET_BYTES,
                    memory_budget_bytes: int = CHUNK_MEMORY_BUDGET_BYTES,
                    flop_target: float = CHUNK_FLOP_TARGET) -> int:
    """The largest chunk within the budgets on a CPU device.

    One client's temporaries, outputs and floating-point operations are what XLA's memory and
    cost analyses of `one_client_fn`, compiled for a single client, report (shared inputs such as
    the dataset are not counted). The chunk keeps chunk·temp ≤ temp_budget,
    chunk·(temp + out) ≤ memory_budget and chunk·flops ≤ flop_target (rounded down, at least 1).
    Accelerators want the widest batch: there only chunk·(temp + out) ≤
    `accelerator_chunk_budget()` (a quarter of the device's memory) limits it, and nothing where
    the device reports no memory; the budget arguments are the CPU's and are not used there.
    """
    accelerator = not on_cpu()
    if accelerator:
        budgets = _accelerator_budgets()
        if budgets is None:
            return 1 << 30
        temp_budget_bytes, memory_budget_bytes, flop_target = budgets
    one_client = measured_step(one_client_fn, *abstract_args)
    if one_client is None:
        # No memory analysis on this backend: a conservative fixed chunk on a CPU; on an
        # accelerator, whose analysis did not work either, the whole vmap as before.
        return 1 << 30 if accelerator else 32
    return _chunk_within(one_client, temp_budget_bytes, memory_budget_bytes, flop_target)


def measured_step(one_client_fn: Callable, *abstract_args: Any) -> Bounds | None:
    """One client's temporaries, outputs and flops as XLA's memory and cost analyses of the
    compiled probe report them (None where the backend has no such analysis).

    With the persistent compilation cache on, the numbers are remembered beside it
    (`core.memo`) under a hash of the probe's lowered program and of the compiler, so a second
    run of the same configuration reads them instead of compiling (or loading) the probe again
    (issue 56; on the peers' CIFAR-10 job 2.5 CPU s of probes cold, 0.33 s loading them from a
    warm cache, 0.20 s with the memo: the lowering that gives the key). The analyses are
    deterministic functions of that key: the same numbers, so the same chunk."""
    where = memo.directory()
    entry = None
    if where is not None:
        try:
            # (The lowering is cached: compiled_for_analysis below does not lower again.)
            text = jax.jit(one_client_fn).lower(*abstract_args).as_text()
            entry = memo.key(text, compiled_for_analysis)
        except Exception:
            entry = None                  # not lowerable here: compiled_for_analysis decides
        remembered = memo.load(where, entry) if entry is not None else None
        if remembered is not None:
            return Bounds(*remembered)
    try:
        compiled = compiled_for_analysis(one_client_fn, *abstract_args)
        analysis = compiled.memory_analysis()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        one_client = Bounds(int(analysis.temp_size_in_bytes),
                            int(analysis.output_size_in_bytes),
                            float((cost or {}).get("flops", 0.0)))
    except Exception:
        return None
    if where is not None and entry is not None:
        memo.store(where, entry, *one_client, program=getattr(one_client_fn, "__name__", ""))
    return one_client


def traced_chunk_size(one_client_fn: Callable, *abstract_args: Any,
                      temp_budget_bytes: int = CHUNK_TEMP_BUDGET_BYTES,
                      memory_budget_bytes: int = CHUNK_MEMORY_BUDGET_BYTES,
                      flop_target: float = CHUNK_FLOP_TARGET) -> int:
    """A chunk size no larger than `auto_chunk_size`'s, without compiling: the same budgets
    applied to upper bounds of one client's temporaries, outputs and flops read off its traced
    program (`analysis.traced_bounds`). 0 where no bound is known."""
    if not on_cpu():
        budgets = _accelerator_budgets()
        if budgets is None:
            return 1 << 30
        temp_budget_bytes, memory_budget_bytes, flop_target = budgets
    bounds = traced_bounds(one_client_fn, *abstract_args)
    if bounds is None:
        return 0
    return _chunk_within(bounds, temp_budget_bytes, memory_budget_bytes, flop_target)


def _chunk_within(one_client: Bounds, temp_budget_bytes: int, memory_budget_bytes: int,
                  flop_target: float) -> int:
    """The chunk within the budgets (a budget of 0: none of that kind)."""
    temp, flops = one_client.temp_bytes, one_client.flops
    total = temp + one_client.output_bytes
    by_speed = temp_budget_bytes // temp if temp > 0 and temp_budget_bytes > 0 else 1 << 30
    by_work = flop_target // flops if flops > 0 and flop_target > 0 else 1 << 30
    by_memory = memory_budget_bytes // total if total > 0 and memory_budget_bytes > 0 else 1 << 30
    return max(1, int(min(by_speed, by_work, by_memory, 1 << 30)))


def abstract_row(tree: Params) -> Params:
    """Shape/dtype stand-ins for one client's row of a stacked tree (works on tracers too)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), tree)


def abstract(tree: Params) -> Params:
    """Shape/dtype stand-ins for a whole tree."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
