"""The client axis: the only place where code crosses the stacked leading axis of client state.

Client state is one pytree whose leaves have a leading axis N (all clients). A round gathers the
rows of the M sampled clients, maps a one-client function over them, reduces across them, and
scatters the rows back. Algorithms use only the primitives below (DrJAX's vocabulary: broadcast,
map, reduce), so the execution strategy (vmap, chunked, a Python loop) changes here once.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from fedjax_pfl.core.analysis import Bounds, compiled_for_analysis, traced_bounds

Params = Any
BACKENDS: tuple[str, ...] = ("vmap", "chunked", "loop")

AUTO_CHUNK = 0
# Budgets of one chunk on one CPU device, calibrated on this project's 2-core machines
# (benchmarks/RESULTS.md). Speed: a chunk's temporaries (activations, im2col patches) should stay
# near the cache; the MLP has almost none (whole vmap is fastest: per-op overhead dominates) and
# the FedAvg CNN ~6.7 MB (B = 10) or ~22 MB (B = 32) per client, whose measured optima are
# chunks of 2 and 1. Memory: temporaries plus outputs (the clients' parameters and optimizer
# state) stay within a bound, so peak memory does not grow with the number of clients.
CHUNK_TEMP_BUDGET_BYTES = 16 * 2**20
# Vectorising clients pays while one client's step is too small to keep the cores busy (small
# GEMMs, per-op overhead); past about this much work per chunk step, wider chunks only spill the
# caches. Calibrated on 2 AVX2 cores (benchmarks/RESULTS.md, "chunk size"): the 784-100-10 MLP
# at B = 10 (~4.8 MFLOP per client step) was fastest at chunks of 8-16, the FedAvg CNN at B = 10
# (~250 MFLOP) at 1.
CHUNK_FLOP_TARGET = 48e6
CHUNK_MEMORY_BUDGET_BYTES = 2**30


def broadcast(tree: Params, n: int) -> Params:
    """[...] -> [n, ...]: the same value for every one of n clients."""
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *jnp.shape(x))), tree)


def gather(tree: Params, idx: jax.Array) -> Params:
    """[N, ...] -> [m, ...]: the rows of the clients in `idx`. Rows stored in bfloat16 (client
    state under --state-dtype bfloat16) come back as float32: computation stays in float32."""
    def rows(x):
        r = x[idx]
        return r.astype(jnp.float32) if r.dtype == jnp.bfloat16 else r

    return jax.tree.map(rows, tree)


def scatter(tree: Params, idx: jax.Array, rows: Params) -> Params:
    """Write `rows` [m, ...] into `tree` [N, ...] at `idx`; all other rows are unchanged bit for bit."""
    return jax.tree.map(lambda x, r: x.at[idx].set(r.astype(x.dtype)), tree, rows)


def where_clients(mask: jax.Array, if_true: Params, if_false: Params) -> Params:
    """Per-client select: row i comes from `if_true` where mask[i], else from `if_false`."""

    def select(a, b):
        m = jnp.reshape(mask, mask.shape + (1,) * (a.ndim - mask.ndim))
        return jnp.where(m, a, b)

    return jax.tree.map(select, if_true, if_false)


def sum_over_clients(tree: Params) -> Params:
    """[m, ...] -> [...]: Σ over clients."""
    return jax.tree.map(lambda x: jnp.sum(x, axis=0), tree)


def mean_over_clients(tree: Params, weights: jax.Array | None = None) -> Params:
    """[m, ...] -> [...]: the (weighted) mean over clients; weights are normalised here."""
    if weights is None:
        return jax.tree.map(lambda x: jnp.mean(x, axis=0), tree)
    def weighted(x):
        w = jnp.asarray(weights).astype(x.dtype)  # normalise in the leaf's precision
        return jnp.tensordot(w / jnp.sum(w), x, axes=1)

    return jax.tree.map(weighted, tree)


def sample_clients(key: jax.Array, num_clients: int, num_sampled: int) -> jax.Array:
    """M distinct client ids drawn uniformly without replacement, sorted ascending.

    Deterministic in `key`; every M-subset has the same probability. For N ≤ 4·M + 4096 the ids
    are the first M of a random permutation (O(N)); otherwise (M ≪ N, large-client-count runs)
    they are drawn in O(M log M) without touching all N: iid uniform draws, keeping the first
    occurrence of each id in draw order until M distinct ids are found. The first M distinct
    values of an iid uniform sequence are a uniformly random M-subset (sequential sampling with
    rejection of repeats), so both paths sample the same distribution. Sorting makes logs and
    scatters easier to read and changes nothing else (rows are keyed by client id).
    """
    if not 1 <= num_sampled <= num_clients:
        raise ValueError(f"cannot sample {num_sampled} of {num_clients} clients")
    if num_sampled == num_clients:
        return jnp.arange(num_clients, dtype=jnp.int32)
    if num_clients <= 4 * num_sampled + 4096:
        ids = jax.random.choice(key, num_clients, (num_sampled,), replace=False)
        return jnp.sort(ids).astype(jnp.int32)
    return _sample_sparse(key, num_clients, num_sampled)


def _sample_sparse(key: jax.Array, n: int, m: int) -> jax.Array:
    # Draws per attempt: the expected number of repeats among k draws is about k²/(2n) ≤ m/8
    # here, so m + m/4 + 16 draws almost always hold m distinct ids; otherwise draw again.
    k = m + m // 4 + 16

    def attempt(carry):
        i, _, _ = carry
        draws = jax.random.randint(jax.random.fold_in(key, i), (k,), 0, n, dtype=jnp.int32)
        order = jnp.argsort(draws, stable=True)          # equal ids: earliest draw first
        sorted_ids = draws[order]
        first = jnp.concatenate([jnp.ones(1, bool), sorted_ids[1:] != sorted_ids[:-1]])
        # The first occurrences, in draw order; the first m of them are the sample.
        position = jnp.where(first, order, k)            # draw index of each first occurrence
        chosen = jnp.sort(position)[:m]
        return i + 1, jnp.sum(first) >= m, draws[jnp.minimum(chosen, k - 1)]

    _, _, ids = jax.lax.while_loop(lambda c: ~c[1], attempt,
                                   (jnp.zeros((), jnp.int32), jnp.zeros((), bool),
                                    jnp.zeros(m, jnp.int32)))
    return jnp.sort(ids)


def num_sampled_clients(num_clients: int, participation: float) -> int:
    """M = ⌊N · rate + 1e-9⌋, at least 1: the exact floor of N · rate for a decimal rate.

    This is NOT always the reference codes' int(N * rate) (PGFed's `join_clients`): where the
    float product N * rate falls just below an integer, int() truncates to one client fewer.
    N = 100 at rate 0.29: 100 * 0.29 = 28.999999999999996, so int() gives 28 and we give 29;
    likewise N = 100 at 0.57 and 0.58 (56 vs 57, 57 vs 58) and N = 50 at 0.58 (28 vs 29). Where
    the product lands just above an integer (25 * 0.28 = 7.000000000000001) both give 7. To run
    with the reference's M in such a case, pass a rate a little below (0.2899 for 28 of 100).
    """
    return max(1, int(np.floor(num_clients * participation + 1e-9)))


class ClientLoop(NamedTuple):
    """One client's computation written as a loop: `length(row)` steps of `step` (local training
    steps, evaluation batches), between `init` and `finish`.

      init(shared, row) -> carry          everything the client's steps need (its model, key, …)
      step(shared, carry, t) -> carry     step t = 0, 1, …, length − 1
      finish(shared, carry) -> out        the client's result
      length(row) -> int32 scalar         the client's number of steps (0 is allowed)

    `uniform` says that every client takes either 0 steps or one common number of them (a fixed
    step count K): no client can hold up the others, so the mapper compiles one stage instead of
    the staged execution for unequal clients (twice the compile time of a small PGFed round:
    `benchmarks/compile_stages.py`).
    `shared` is a tuple of arguments common to all clients (the dataset, a global model). Written
    this way, the mapper knows each client's cost before running it and can group clients of
    similar length, so a long client does not hold up a wide vectorised batch (`ClientMapper`).
    """

    init: Callable
    step: Callable
    finish: Callable
    length: Callable
    uniform: bool = False


class ClientMapper(NamedTuple):
    """How per-client work is run over the sampled clients: the one place execution lives.

    backend:
      "vmap":    one vectorised call over all M clients; loops run to the longest client;
      "chunked": (the default) bounded vectorisation over W = `chunk_size` clients.
                 `ClientLoop`s run in chunks of at most W vectorised clients sorted by length,
                 and the few longest clients finish in a narrow second stage (`_run_capped`),
                 so a skewed client does not hold up the rest; W = 1 runs clients one after
                 another without any masking. Plain functions (`__call__`) run as vmap
                 over chunks of W clients (lax.map). chunk_size 0 means automatic
                 (`auto_chunk_size`, from XLA's memory analysis of one step);
      "loop":    a Python loop that calls the jitted one-client computation once per client. It
                 is the reference the vectorised backends are tested against, and the baseline of
                 the benchmarks. Under an outer jax.jit it still works but unrolls.
    mesh: with several devices (GPUs, or one XLA:CPU device per core, see
      `fedjax_pfl.use_cpu_cores`), "vmap" and "chunked" split the M clients across the devices
      of this 1-D mesh (axis "clients") with shard_map. Loops are dealt to devices by cost
      (longest first, in snake order) so devices finish together; plain functions take a
      contiguous block of rows per device.
    """

    backend: str = "chunked"
    chunk_size: int = AUTO_CHUNK
    mesh: Mesh | None = None

    def __call__(
        self, fn: Callable, *args: Params, shared: tuple = (), cost: jax.Array | None = None
    ) -> Params:
        """map_clients: out[i] = fn(*shared, *(a[i] for a in args)) for every client row i.

        `shared` arguments (the dataset, a global model) are passed whole to every client and are
        not copied per client. `cost` (optional, [m]) orders clients for the chunked backend.
        Pass a function object that lives as long as the algorithm: the loop backend caches its
        compiled form by identity.
        """
        if self.backend == "loop":
            return _loop_map(fn, shared, args)
        if self.backend not in ("vmap", "chunked"):
            raise ValueError(f"unknown backend {self.backend!r}; expected one of {BACKENDS}")
        if self.backend == "chunked" and self.chunk_size == AUTO_CHUNK:
            return self.resolved(fn, shared, args)(fn, *args, shared=shared, cost=cost)
        if self.mesh is None or self.mesh.size == 1:
            return self._map_on_device(fn, shared, args, cost)
        return self._map_sharded(fn, shared, args, cost)

    def run(self, loop: ClientLoop, rows: Params, *, shared: tuple = (),
            probe: Callable | None = None) -> Params:
        """out[i] = the result of client i's loop, for every row i of `rows`.

        `probe(shared, row)` (optional) is one step of one client, whose memory analysis picks
        an automatic chunk size; without it the chunk size is analysed from `loop.step`.
        The loop object must live as long as the algorithm (the loop backend caches by identity).
        """
        if self.backend == "loop":
            return _loop_map(_whole_loop(loop), shared, (rows,))
        if self.backend not in ("vmap", "chunked"):
            raise ValueError(f"unknown backend {self.backend!r}; expected one of {BACKENDS}")
        mapper = self
        if self.backend == "chunked" and self.chunk_size == AUTO_CHUNK:
            probe = probe or _step_probe(loop)
            mapper = self.resolved(probe, shared, (rows,))
        m = _num_rows(rows)
        valid = jnp.ones(m, bool)
        if mapper.mesh is None or mapper.mesh.size == 1:
            return mapper._run_on_device(loop, shared, rows, valid)
        return mapper._run_sharded(loop, shared, rows)

    def _run_on_device(self, loop, shared, rows, valid):
        if self.backend == "vmap":
            out = _vmap_rows(_whole_loop(loop, masked=True), shared, (rows, valid))
            return out
        return _run_capped(loop, shared, rows, valid, self.chunk_size)

    def _run_sharded(self, loop, shared, rows):
        # Each device takes a contiguous block of rows (padded with rows that take no steps), so
        # outputs stay where they were computed: reductions over clients are local sums plus a
        # small all-reduce, never a gather of every client's output. Callers order rows so that
        # the blocks carry equal work (`balanced_order`; Engine.sample does).
        d = self.mesh.size
        m = _num_rows(rows)
        pad = -m % d
        valid = jnp.arange(m + pad) < m
        if pad:  # repeat the last row; it is marked invalid and takes no steps
            rows = jax.tree.map(lambda x: jnp.concatenate([x, jnp.repeat(x[-1:], pad, axis=0)]), rows)

        def per_device(shared, rows, valid):
            return self._run_on_device(loop, shared, rows, valid)

        spec = jax.sharding.PartitionSpec("clients")
        out = jax.shard_map(per_device, mesh=self.mesh,
                            in_specs=(jax.sharding.PartitionSpec(), spec, spec),
                            out_specs=spec, check_vma=False)(shared, rows, valid)
        return jax.tree.map(lambda x: x[:m], out) if pad else out

    def resolved(self, fn: Callable, shared: tuple, args: tuple) -> "ClientMapper":
        """This mapper with an automatic chunk size replaced by `auto_chunk_size` for `fn`."""
        if self.backend != "chunked" or self.chunk_size != AUTO_CHUNK:
            return self
        specs = (abstract(shared), abstract_row(args))
        leaves, treedef = jax.tree.flatten(specs)
        key = (treedef, tuple((x.shape, x.dtype) for x in leaves))
        return self._replace(chunk_size=_cached_auto_chunk(fn, key, specs, _num_rows(args)))

    def _map_on_device(self, fn, shared, args, cost):
        if self.backend == "vmap":
            return _vmap_rows(fn, shared, args)
        return _chunked_map(fn, shared, args, self.chunk_size, cost)

    def _map_sharded(self, fn, shared, args, cost):
        # Each device takes a contiguous block of rows: no cross-device permutation of the
        # (large) outputs. Within a device, "chunked" still sorts its block by cost.
        m = _num_rows(args)
        pad = -m % self.mesh.size
        if cost is None:
            cost = jnp.zeros(m, jnp.int32)
        if pad:  # repeat the last row; its results are dropped below
            args, cost = jax.tree.map(
                lambda x: jnp.concatenate([x, jnp.repeat(x[-1:], pad, axis=0)]), (args, cost))

        def per_device(shared, args, cost):
            return self._map_on_device(fn, shared, args, cost)

        rows = jax.sharding.PartitionSpec("clients")
        out = jax.shard_map(per_device, mesh=self.mesh, in_specs=(jax.sharding.PartitionSpec(), rows, rows),
                            out_specs=rows, check_vma=False)(shared, args, cost)
        return jax.tree.map(lambda x: x[:m], out) if pad else out


def jit_unless_loop(mapper: ClientMapper, fn: Callable, **jit_kwargs) -> Callable:
    """`jax.jit(fn)` for the vectorised backends (inlined under an outer jit, and fast when
    called eagerly from a notebook); `fn` itself for the loop backend, whose per-client calls are
    jitted separately and which must see concrete arrays to loop over."""
    return fn if mapper.backend == "loop" else jax.jit(fn, **jit_kwargs)


def client_mesh() -> Mesh | None:
    """A 1-D mesh ("clients") over all devices (of every process), or None with a single one."""
    devices = jax.devices()
    return Mesh(np.array(devices), ("clients",)) if len(devices) > 1 else None


def replicated_sharding(mesh: Mesh) -> NamedSharding:
    """The sharding of a value held whole on every device of `mesh`."""
    return NamedSharding(mesh, jax.sharding.PartitionSpec())


def replicate(tree: Params, mesh: Mesh | None) -> Params:
    """Places `tree` on every device of `mesh` once (a no-op without a mesh), so jitted rounds do
    not copy the dataset between devices on every call."""
    if mesh is None:
        return tree
    return jax.device_put(tree, replicated_sharding(mesh))


def is_client_leaf(leaf: Any, num_clients: int) -> bool:
    """Whether a state leaf is per-client: an array whose leading axis has N rows."""
    shape = getattr(leaf, "shape", ())
    return len(shape) >= 1 and shape[0] == num_clients


def client_shardings(tree: Params, num_clients: int, mesh: Mesh) -> Params:
    """Shardings for a state pytree: per-client leaves (leading axis N, `is_client_leaf`) split
    along the client axis over the mesh, every other leaf replicated. N must be a multiple of
    the device count (`FederatedData.pad_clients`). Works on abstract trees (eval_shape)."""
    rows = NamedSharding(mesh, jax.sharding.PartitionSpec("clients"))
    whole = replicated_sharding(mesh)
    return jax.tree.map(lambda x: rows if is_client_leaf(x, num_clients) else whole, tree)


def cast_client_leaves(tree: Params, num_clients: int, dtype) -> Params:
    """Per-client float leaves stored as `dtype` (e.g. bfloat16 for --state-dtype); other leaves
    unchanged. `gather` returns such rows as float32 again."""
    def cast(x):
        if not (is_client_leaf(x, num_clients) and jnp.issubdtype(x.dtype, jnp.floating)):
            return x
        if isinstance(x, jax.ShapeDtypeStruct):                 # abstract shapes (memory plans)
            return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
        return x.astype(dtype)

    return jax.tree.map(cast, tree)


def auto_chunk_size(one_client_fn: Callable, *abstract_args: Any,
                    temp_budget_bytes: int = CHUNK_TEMP_BUDGET_BYTES,
                    memory_budget_bytes: int = CHUNK_MEMORY_BUDGET_BYTES,
                    flop_target: float = CHUNK_FLOP_TARGET) -> int:
    """The largest chunk within the budgets on a CPU device.

    One client's temporaries, outputs and floating-point operations are what XLA's memory and
    cost analyses of `one_client_fn`, compiled for a single client, report (shared inputs such as
    the dataset are not counted). The chunk keeps chunk·temp ≤ temp_budget,
    chunk·(temp + out) ≤ memory_budget and chunk·flops ≤ flop_target (rounded down, at least 1).
    Accelerators get no limit (whole vmap): they want the widest batch.
    """
    if jax.default_backend() != "cpu":
        return 1 << 30
    try:
        compiled = compiled_for_analysis(one_client_fn, *abstract_args)
        analysis = compiled.memory_analysis()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        one_client = Bounds(analysis.temp_size_in_bytes, analysis.output_size_in_bytes,
                            float((cost or {}).get("flops", 0.0)))
    except Exception:  # no memory analysis on this backend: a conservative fixed chunk
        return 32
    return _chunk_within(one_client, temp_budget_bytes, memory_budget_bytes, flop_target)


def traced_chunk_size(one_client_fn: Callable, *abstract_args: Any,
                      temp_budget_bytes: int = CHUNK_TEMP_BUDGET_BYTES,
                      memory_budget_bytes: int = CHUNK_MEMORY_BUDGET_BYTES,
                      flop_target: float = CHUNK_FLOP_TARGET) -> int:
    """A chunk size no larger than `auto_chunk_size`'s, without compiling: the same budgets
    applied to upper bounds of one client's temporaries, outputs and flops read off its traced
    program (`analysis.traced_bounds`). 0 where no bound is known."""
    bounds = traced_bounds(one_client_fn, *abstract_args)
    if bounds is None:
        return 0
    return _chunk_within(bounds, temp_budget_bytes, memory_budget_bytes, flop_target)


def _chunk_within(one_client: Bounds, temp_budget_bytes: int, memory_budget_bytes: int,
                  flop_target: float) -> int:
    temp, flops = one_client.temp_bytes, one_client.flops
    total = temp + one_client.output_bytes
    by_speed = temp_budget_bytes // temp if temp > 0 else 1 << 30
    by_work = flop_target // flops if flops > 0 else 1 << 30
    return max(1, int(min(by_speed, by_work, memory_budget_bytes // max(total, 1))))


_AUTO_CHUNK_CACHE: dict = {}
_TRACED_CHUNK_CACHE: dict = {}


def _cached_auto_chunk(fn: Callable, key: tuple, specs: tuple, rows: int) -> int:
    """auto_chunk_size for `rows` clients, computed once per (function, argument shapes), and
    not compiled at all where the traced bounds already fit all `rows` clients in one chunk:
    auto_chunk_size would then give at least `rows` too, and every chunk size ≥ rows runs the
    same program (one vectorised chunk). That is most programs of small models: their probe
    compilations were ~0.4 s each, a tenth of the test suite's time."""
    full_key = (fn, key)
    if full_key in _AUTO_CHUNK_CACHE:
        return _AUTO_CHUNK_CACHE[full_key]
    shared, row = specs
    if jax.default_backend() == "cpu":
        if full_key not in _TRACED_CHUNK_CACHE:
            _TRACED_CHUNK_CACHE[full_key] = traced_chunk_size(fn, *shared, *row)
        if rows <= _TRACED_CHUNK_CACHE[full_key]:
            return rows
    _AUTO_CHUNK_CACHE[full_key] = auto_chunk_size(fn, *shared, *row)
    return _AUTO_CHUNK_CACHE[full_key]


def abstract_row(tree: Params) -> Params:
    """Shape/dtype stand-ins for one client's row of a stacked tree (works on tracers too)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), tree)


def abstract(tree: Params) -> Params:
    """Shape/dtype stand-ins for a whole tree."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


_SINGLE_DEVICE = [False]


@contextlib.contextmanager
def single_device_clients():
    """Within this block `client_mapper` keeps each computation's clients on one device (no
    mesh): a sweep that already splits whole runs across devices builds its algorithms here."""
    previous = _SINGLE_DEVICE[0]
    _SINGLE_DEVICE[0] = True
    try:
        yield
    finally:
        _SINGLE_DEVICE[0] = previous


def client_mapper(backend: str = "chunked", chunk_size: int = AUTO_CHUNK, shard: bool = True) -> ClientMapper:
    """Validated ClientMapper (see its docstring). With `shard` and several devices, the
    vectorised backends split clients across devices."""
    if backend not in BACKENDS:
        raise ValueError(f"--backend must be one of {BACKENDS}, got {backend!r}")
    if chunk_size < 0:
        raise ValueError(f"--chunk-size must be >= 0 (0: automatic), got {chunk_size}")
    shard = shard and not _SINGLE_DEVICE[0]
    mesh = client_mesh() if shard and backend != "loop" else None
    return ClientMapper(backend, int(chunk_size), mesh)


def _num_rows(args) -> int:
    return jax.tree.leaves(args)[0].shape[0]


def _vmap_rows(fn, shared, args):
    if _num_rows(args) == 1:
        # One row runs unbatched (see _chunked_map): same values, no one-lane batching.
        out = fn(*shared, *jax.tree.map(lambda x: x[0], args))
        return jax.tree.map(lambda x: jnp.expand_dims(x, 0), out)
    return jax.vmap(fn, in_axes=(None,) * len(shared) + (0,) * len(args))(*shared, *args)


def _chunked_map(fn, shared, args, chunk_size, cost):
    m = _num_rows(args)
    if chunk_size >= m:  # one chunk: plain vmap, no sorting
        return _vmap_rows(fn, shared, args)
    # k equal chunks of at most chunk_size rows: lax.map then compiles one body (a remainder
    # chunk would compile a second one); the at most k − 1 padding rows repeat the cheapest row.
    chunks = -(-m // chunk_size)
    size = -(-m // chunks)
    order = jnp.arange(m) if cost is None else jnp.argsort(-cost, stable=True)
    padded = jnp.concatenate([order, jnp.full(chunks * size - m, order[m - 1])])
    # Chunks of one client run unbatched: vmap over a single lane would still batch the
    # client's while-loop predicate (turning it into per-step selects of the whole carry) and
    # give every matmul a batch dimension (transposed copies of the weights on XLA:CPU). The
    # same holds for _vmap_rows of one row (the last stage of _run_capped: the longest client).
    out = jax.lax.map(lambda row: fn(*shared, *row), gather(args, padded),
                      batch_size=size if size > 1 else None)
    # Sorting by cost lets each chunk's while-loops stop at the chunk's own longest client.
    return gather(out, jnp.argsort(order))


@functools.lru_cache(maxsize=64)
def _jitted(fn):
    return jax.jit(fn)


def _loop_map(fn, shared, args):
    one_client = _jitted(fn)
    outs = [one_client(*shared, *gather(args, i)) for i in range(_num_rows(args))]
    return jax.tree.map(lambda *rows: jnp.stack(rows), *outs)


# Above this many rows balanced_order deals them in snake order (vectorised): with many rows
# it is within a fraction of a percent of even, and the greedy pass costs O(m²) a swap (0.8 ms
# at 300 rows, 6 ms at 1,000 on one core; the snake order 0.1 and 0.5 ms).
_GREEDY_MAX_ROWS = 256


def balanced_order(costs: jax.Array, num_devices: int) -> jax.Array:
    """A permutation of m rows such that contiguous blocks of ⌈m/D⌉ rows (one per device, the
    last blocks short by the padding) carry about equal total cost; within a block, rows stay in
    decreasing cost. With one device, the identity.

    Longest processing time first: rows by decreasing cost, each to the least-loaded device with
    room left; then, while a swap of one row between the most and the least loaded device brings
    their loads closer, the best such swap. A device runs its clients one after another, so the
    round lasts as long as its busiest device: on PGFed's Dirichlet split (6 of 25 clients with
    828–3,724 samples, 2 devices) the busiest holds 1.8 % more than half the steps on average,
    the best equal-count split, against 5.8 % for the snake order (0, 1, …, D−1, D−1, …, 0, …)
    used above _GREEDY_MAX_ROWS rows."""
    m = costs.shape[0]
    if num_devices <= 1 or m <= 1:
        return jnp.arange(m)
    if m > _GREEDY_MAX_ROWS:
        return _snake_order(costs, num_devices)
    block = -(-m // num_devices)
    room = jnp.asarray([min(block, max(0, m - d * block)) for d in range(num_devices)], jnp.int32)
    by_cost = jnp.argsort(-costs, stable=True)
    sorted_costs = costs[by_cost]
    if not jnp.issubdtype(sorted_costs.dtype, jnp.floating):
        sorted_costs = sorted_costs.astype(jnp.int32)
    loads = jnp.zeros(num_devices, sorted_costs.dtype)

    def deal(i, carry):
        loads, counts, device = carry
        d = jnp.argmin(jnp.where(counts < room, loads, jnp.max(loads) + sorted_costs[0] + 1))
        return loads.at[d].add(sorted_costs[i]), counts.at[d].add(1), device.at[i].set(d)

    loads, _, device = jax.lax.fori_loop(
        0, m, deal, (loads, jnp.zeros(num_devices, jnp.int32), jnp.zeros(m, jnp.int32)))

    # Each swap moves 0 < δ < gap from the busiest to the idlest device, so the sum of squared
    # loads falls strictly and the loop ends; the bound only guards against float rounding.
    delta = sorted_costs[:, None] - sorted_costs[None, :]        # row i leaves, row j arrives

    def swap(carry):
        loads, device, _, it = carry
        hi = jnp.argmax(loads)
        lo = jnp.argmin(jnp.where(room > 0, loads, loads[hi]))      # (a device without rows)
        gap = loads[hi] - loads[lo]
        allowed = (device == hi)[:, None] & (device == lo)[None, :] & (delta > 0)
        new_gap = jnp.where(allowed, jnp.abs(gap - 2 * delta), gap)
        flat = jnp.argmin(new_gap)
        i, j = flat // m, flat % m
        better = new_gap[i, j] < gap
        moved = jnp.where(better, delta[i, j], 0)
        device = jnp.where(better, device.at[i].set(lo).at[j].set(hi), device)
        return loads.at[hi].add(-moved).at[lo].add(moved), device, better, it + 1

    loads, device, _, _ = jax.lax.while_loop(
        lambda c: c[2] & (c[3] < 4 * m), swap,
        (loads, device, jnp.ones((), bool), jnp.zeros((), jnp.int32)))
    # Swaps of one row can stop short of the best split; then the snake order may be the better
    # one (a few percent of small random cases): take whichever leaves the busiest device less.
    # Its labels are the positional blocks it fills (for D > 2 they need not be its devices).
    snake_block = jnp.zeros(m, jnp.int32).at[_snake_order(costs, num_devices)].set(
        jnp.arange(m, dtype=jnp.int32) // block)[by_cost]
    snake_loads = jax.ops.segment_sum(sorted_costs, snake_block, num_segments=num_devices)
    device = jnp.where(jnp.max(loads) <= jnp.max(snake_loads), device, snake_block)
    # Grouped by device, longest first within each block, so that a chunk of several clients
    # holds clients of similar length.
    return by_cost[jnp.argsort(device * m + jnp.arange(m), stable=True)]


def _snake_order(costs: jax.Array, num_devices: int) -> jax.Array:
    """balanced_order for many rows: rows dealt longest first in snake order (0, 1, …, D−1,
    D−1, …, 0, …), then grouped by device."""
    m = costs.shape[0]
    by_cost = jnp.argsort(-costs, stable=True)
    rank = jnp.arange(m)
    lap, pos = rank // num_devices, rank % num_devices
    device = jnp.where(lap % 2 == 0, pos, num_devices - 1 - pos)
    # The blocks are ⌈m/D⌉ rows with the padding in the last: the devices that receive the
    # partial lap's extra rows must be the first ones, so mirror the labels when that lap runs
    # backwards (an odd number of full laps before it).
    if (m // num_devices) % 2 == 1:
        device = num_devices - 1 - device
    return by_cost[jnp.argsort(device * m + rank, stable=True)]


@functools.lru_cache(maxsize=64)
def _whole_loop(loop: ClientLoop, masked: bool = False) -> Callable:
    """One client's loop as a function (shared..., row) -> out (a lax.while_loop); with
    `masked`, (shared..., row, valid), where an invalid (padding) row takes no steps. Cached, so
    the same loop gives the same function object (the loop backend's jit cache is by identity)."""

    def run_one(*args):
        if masked:
            *shared, row, valid = args
        else:
            *shared, row = args
            valid = True
        shared = tuple(shared)
        length = jnp.where(valid, loop.length(row), 0)
        carry = loop.init(shared, row)
        _, carry = jax.lax.while_loop(lambda c: c[0] < length,
                                      lambda c: (c[0] + 1, loop.step(shared, c[1], c[0])),
                                      (jnp.zeros((), jnp.int32), carry))
        return loop.finish(shared, carry)

    return run_one


def _step_probe(loop: ClientLoop) -> Callable:
    """(shared..., row) -> one step of one client: what the automatic chunk size analyses."""
    def probe(*args):
        *shared, row = args
        shared = tuple(shared)
        return loop.step(shared, loop.init(shared, row), jnp.zeros((), jnp.int32))

    return probe


def tail_widths(m: int) -> list[int]:
    """How many of the longest clients go on to each later stage of `_run_capped`: m/16 of them,
    then the longest one alone (each stage only where it is narrower than the one before)."""
    widths = [k for k in (m // 16, 1) if 1 <= k < m]
    return sorted(set(widths), reverse=True)


def capped_work(lengths, width: int) -> int:
    """Lane-steps (masked lanes included) of `_run_capped` for clients with these step counts."""
    lengths = np.sort(np.asarray(lengths))[::-1]
    m = len(lengths)
    if width <= 1 or m <= 2:
        return int(lengths.sum())
    stops = [int(lengths[k]) for k in tail_widths(m)] + [int(lengths[0])]
    first = np.minimum(lengths, stops[0])[::-1]      # ascending, as the chunks see them
    chunks = -(-m // width)
    per = -(-m // chunks)
    work = sum(per * int(first[i * per:(i + 1) * per].max()) for i in range(chunks)
               if first[i * per:(i + 1) * per].size)
    for k, start, stop in zip(tail_widths(m), stops[:-1], stops[1:]):
        work += k * (stop - start)
    return work


def _run_capped(loop: ClientLoop, shared: tuple, rows: Params, valid: jax.Array, width: int) -> Params:
    """Size-aware execution in stages, so a few long clients do not hold up the rest.

    Stage 1 runs every client for min(its steps, cap) steps, cap = the step count of the
    (k+1)-th longest client (k = m/16), in chunks of at most `width` vectorised clients sorted
    by length; stage 2 continues the k longest clients up to the second-longest's count, k
    lanes wide; stage 3 finishes the longest alone (`tail_widths`). With equal clients the later
    stages take no steps; one client of 2,000 steps among 99 of 2 runs ~2,000 single-lane steps
    instead of 2,000 steps of every lane (`capped_work`). A lane whose client is done is masked
    (it still computes, which the narrow stages keep small). `width` = 1 runs clients one after
    another with no masking at all.
    """
    m = _num_rows(rows)
    lengths = jnp.where(valid, jax.vmap(loop.length)(rows), 0).astype(jnp.int32)
    if width <= 1 or m <= 2 or loop.uniform:
        return _chunked_map(_whole_loop(loop, masked=True), shared, (rows, valid), width, lengths)
    ranked = jnp.sort(lengths)[::-1]                                   # longest first
    widths = tail_widths(m)

    def run_to(*args):
        """(shared..., row, stop) -> (steps taken, carry after min(length, stop) steps)."""
        *sh, row, stop = args
        sh = tuple(sh)
        return _steps(loop, sh, (jnp.zeros((), jnp.int32), loop.init(sh, row)), stop)

    def resume(*args):
        *sh, t_carry, stop = args
        return _steps(loop, tuple(sh), t_carry, stop)

    stops = jnp.minimum(lengths, ranked[widths[0]])
    t_carry = _chunked_map(run_to, shared, (rows, stops), width, stops)            # stage 1
    top = jnp.argsort(-lengths, stable=True)
    for i, k in enumerate(widths):                                                 # stages 2, 3
        stop = ranked[widths[i + 1]] if i + 1 < len(widths) else ranked[0]
        ids = top[:k]
        part = _vmap_rows(resume, shared, (gather(t_carry, ids), jnp.minimum(lengths[ids], stop)))
        t_carry = scatter(t_carry, ids, part)
    return jax.vmap(lambda c: loop.finish(shared, c))(t_carry[1])


def _steps(loop: ClientLoop, shared: tuple, t_carry, stop):
    """Steps t, t + 1, …, stop − 1 of one client's loop from (t, carry)."""
    return jax.lax.while_loop(lambda c: c[0] < stop,
                              lambda c: (c[0] + 1, loop.step(shared, c[1], c[0])), t_carry)
