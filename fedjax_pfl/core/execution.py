"""How per-client work runs: the client mapper and its execution strategies.

`ClientMapper` maps a one-client function (or a `ClientLoop`, one client's computation written
as steps) over the rows of the sampled clients. Its backends: "vmap" (one vectorised call),
"chunked" (bounded vectorisation, clients grouped by length, a narrow tail stage for the longest
clients), "loop" (a Python loop of jitted one-client calls: the reference) and "debug" (no jit,
errors name the client and stage). With several devices the vectorised backends split the rows
over the mesh the trace runs in (`layout.context_mesh`: the program's, entered around its
calls). Chunk sizes come from `core.chunking`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Callable, Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_pfl.core import checks, chunking, layout
from fedjax_pfl.core import rows as rows_lib
from fedjax_pfl.core.chunking import AUTO_CHUNK, abstract, abstract_row, auto_chunk_size, traced_chunk_size
from fedjax_pfl.core.clients import gather, scatter
from fedjax_pfl.models import frozen

Params = Any
BACKENDS: tuple[str, ...] = ("vmap", "chunked", "loop", "debug")
# Backends that run clients one by one from Python, with no jit around the round.
EAGER_BACKENDS: tuple[str, ...] = ("loop", "debug")


class ClientError(RuntimeError):
    """A client's computation failed (debug backend): names the stage, the client and, once
    `Program` adds it, the round."""

    def __init__(self, stage: str, *, client: int | None, row: int, cause: BaseException,
                 round: int | None = None):
        self.stage, self.client, self.row, self.cause, self.round = stage, client, row, cause, round
        super().__init__(str(self))

    def __str__(self) -> str:
        who = f"client {self.client}" if self.client is not None else f"client row {self.row}"
        when = f"round {self.round}, " if self.round is not None else ""
        return f"{when}{self.stage}, {who}: {type(self.cause).__name__}: {self.cause}"


class MapperCache:
    """What a mapper compiles or measures once per function: jitted one-client functions (loop
    backend), whole-loop functions of `ClientLoop`s, and automatic chunk sizes."""

    def __init__(self):
        self._jitted: dict = {}
        self._whole_loops: dict = {}
        self._auto_chunk: dict = {}
        self._traced_chunk: dict = {}

    def jitted(self, fn: Callable) -> Callable:
        if fn not in self._jitted:
            # (the frozen parameters a program binds enter as an argument: `models.frozen.jit`)
            self._jitted[fn] = frozen.jit(fn)
        return self._jitted[fn]

    def whole_loop(self, loop: "ClientLoop") -> Callable:
        """The same function object for the same loop (the jit cache above is by identity)."""
        if loop not in self._whole_loops:
            self._whole_loops[loop] = _whole_loop(loop)
        return self._whole_loops[loop]

    def auto_chunk(self, fn: Callable, key: tuple, specs: tuple, rows: int) -> int:
        """auto_chunk_size for `rows` clients, computed once per (function, argument shapes), and
        not compiled at all where the traced bounds already fit all `rows` clients in one chunk:
        within the memory budgets, and within `WORK_TARGET_SLACK` times the work target (the
        work target is a plateau of speed, the memory budgets are not). auto_chunk_size would
        then give `rows` or a chunk on the same plateau, and every chunk size ≥ rows runs the same
        program (one vectorised chunk). That is most programs of small models: their probe
        compilations were ~0.4 s each, a tenth of the test suite's time, and PGFedMo's default
        run compiled one before its first round."""
        full_key = (fn, key)
        if full_key in self._auto_chunk:
            return self._auto_chunk[full_key]
        shared, row = specs
        if full_key not in self._traced_chunk:
            self._traced_chunk[full_key] = traced_chunk_size(
                fn, *shared, *row, flop_target=chunking.WORK_TARGET_SLACK * chunking.CHUNK_FLOP_TARGET)
        if rows <= self._traced_chunk[full_key]:
            return rows
        self._auto_chunk[full_key] = auto_chunk_size(fn, *shared, *row)
        return self._auto_chunk[full_key]

    def chunk_sizes(self) -> list[int]:
        """The automatic chunk sizes measured so far (benchmarks report them)."""
        return sorted(set(self._auto_chunk.values()))


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
    docs/decisions/compile-time.md).
    `large_carry` says that a client's carry is much larger than its result (an evaluation
    carries the client's model and returns a few sums): the staged execution then never holds
    every client's carry at once (`_run_capped`).
    `host_length(train_count, test_count)` (optional): `length` of every client on the host,
    from the clients' NumPy sample counts: with the counts of the trace's dataset known
    (`client_sizes`, entered by `core.Program`), the staged execution compiles its narrow
    stages only where they save enough steps (`worth_staging`).
    `shared` is a tuple of arguments common to all clients (the dataset, a global model). Written
    this way, the mapper knows each client's cost before running it and can group clients of
    similar length, so a long client does not hold up a wide vectorised batch (`ClientMapper`).
    """

    init: Callable
    step: Callable
    finish: Callable
    length: Callable
    uniform: bool = False
    large_carry: bool = False
    host_length: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None


# The sample counts (train, test) of the clients of the dataset being traced, or None.
_SIZES: contextvars.ContextVar = contextvars.ContextVar("fedjax_pfl_client_sizes", default=None)

# The staged execution's narrow stages are compiled only where they save at least this share of
# the lane-steps of one stage (`worth_staging`). Each stage is another copy of the client's loop
# in the program: on the main job (3 of 20 IID digits clients a round) the stages saved a few
# percent of the steps of rounds that take 2.5 ms, and cost 1.9-3.2 CPU s of compile
# (docs/decisions/startup.md); on skewed clients (a Dirichlet partition, natural datasets) they
# save 30-90 % and are kept.
STAGING_MIN_SAVING = 0.2


@contextlib.contextmanager
def client_sizes(train_count: np.ndarray, test_count: np.ndarray) -> Iterator[None]:
    """Within: the traced dataset's clients have these sample counts (host arrays), which
    `worth_staging` reads. `core.Program` enters it around its traces."""
    token = _SIZES.set((np.asarray(train_count, np.int64), np.asarray(test_count, np.int64)))
    try:
        yield
    finally:
        _SIZES.reset(token)


def worth_staging(loop: ClientLoop, m: int, width: int) -> bool:
    """Whether `_run_capped`'s narrow stages save at least `STAGING_MIN_SAVING` of the
    lane-steps of one stage, in expectation over 32 draws of m of the dataset's clients (every
    client where m covers them): `capped_work` against chunks of ≤ `width` clients sorted by
    length, each run to its longest. True (stage) where the counts or `host_length` are unknown."""
    sizes = _SIZES.get()
    if sizes is None or loop.host_length is None:
        return True
    lengths = np.asarray(loop.host_length(*sizes), np.int64)
    if lengths.size == 0:
        return True
    rng = np.random.default_rng(0)
    draws = ([lengths] if m >= lengths.size
             else [rng.choice(lengths, size=m, replace=False) for _ in range(32)])
    one = sum(chunked_work(d, width) for d in draws)
    staged = sum(capped_work(d, width) for d in draws)
    return one > 0 and staged <= (1.0 - STAGING_MIN_SAVING) * one


@dataclasses.dataclass(frozen=True)
class ClientMapper:
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
      "debug":   a Python loop over clients with no jit at all (`jax.disable_jit`): every
                 operation runs eagerly, so a print or breakpoint inside a client's step works,
                 and an exception becomes a `ClientError` naming the client, the stage (local
                 training, evaluation, …) and, through `Program`, the round.
    With several devices (GPUs, or one XLA:CPU device per core, see `fedjax_pfl.use_cpu_cores`)
    in the trace's mesh (`mesh`: the context's, `jax.set_mesh`, which `core.Program` enters
    around its calls; none inside a computation already split over the clients axis by hand),
    "vmap" and "chunked" split the M clients across its devices (axis "clients") with
    shard_map. Loops are dealt to devices by cost (longest first, in snake order) so devices
    finish together; plain functions take a contiguous block of rows per device.
    """

    backend: str = "chunked"
    chunk_size: int = AUTO_CHUNK
    # Compiled per-client functions and automatic chunk sizes, keyed by function identity: they
    # live exactly as long as this mapper (and the mappers `_replace` derives from it), i.e. as
    # long as the algorithm that built it; nothing is cached at module level.
    cache: "MapperCache" = dataclasses.field(default_factory=lambda: MapperCache(), compare=False,
                                             repr=False)

    def _replace(self, **changes) -> "ClientMapper":
        return dataclasses.replace(self, **changes)

    @property
    def mesh(self):
        """The mesh the clients are split over in the current trace (`layout.context_mesh`),
        or None: one device (always for the loop and debug backends)."""
        if self.backend in EAGER_BACKENDS:
            return None
        return layout.context_mesh()

    def __call__(
        self, fn: Callable, *args: Params, shared: tuple = (), cost: jax.Array | None = None,
        ids: jax.Array | None = None, stage: str = "client map",
    ) -> Params:
        """map_clients: out[i] = fn(*shared, *(a[i] for a in args)) for every client row i.

        `shared` arguments (the dataset, a global model) are passed whole to every client and are
        not copied per client. `cost` (optional, [m]) orders clients for the chunked backend.
        Pass a function object that lives as long as the algorithm: the loop backend caches its
        compiled form by identity. `ids` (the rows' client ids) and `stage` name the client and
        the computation in the debug backend's errors.
        """
        if self.backend == "debug":
            return _debug_map(fn, shared, args, ids, stage)
        if self.backend == "loop":
            return _loop_map(self.cache.jitted(fn), shared, args)
        if self.backend not in ("vmap", "chunked"):
            raise ValueError(f"unknown backend {self.backend!r}; expected one of {BACKENDS}")
        split = self._check_blocks(shared, ids)
        if self.backend == "chunked" and self.chunk_size == AUTO_CHUNK:
            mapper = self.resolved(fn, self._analysed(shared, split), args)
            return mapper(fn, *args, shared=shared, cost=cost, ids=ids, stage=stage)
        if self.mesh is None or self.mesh.size == 1:
            return self._map_on_device(fn, shared, args, cost)
        return self._map_sharded(fn, shared, args, cost, ids if split else None)

    def run(self, loop: ClientLoop, rows: Params, *, shared: tuple = (),
            probe: Callable | None = None, ids: jax.Array | None = None,
            stage: str = "client map") -> Params:
        """out[i] = the result of client i's loop, for every row i of `rows`.

        `probe(shared, row)` (optional) is one step of one client, whose memory analysis picks
        an automatic chunk size; without it the chunk size is analysed from `loop.step`.
        The loop object must live as long as the algorithm (the loop backend caches by identity).
        """
        if self.backend == "debug":
            return _debug_map(_whole_loop(loop), shared, (rows,), ids, stage)
        if self.backend == "loop":
            return _loop_map(self.cache.jitted(self.cache.whole_loop(loop)), shared, (rows,))
        if self.backend not in ("vmap", "chunked"):
            raise ValueError(f"unknown backend {self.backend!r}; expected one of {BACKENDS}")
        split = self._check_blocks(shared, ids)
        mapper = self
        if self.backend == "chunked" and self.chunk_size == AUTO_CHUNK:
            probe = probe or _step_probe(loop)
            mapper = self.resolved(probe, self._analysed(shared, split), (rows,))
        m = _num_rows(rows)
        valid = jnp.ones(m, bool)
        if mapper.mesh is None or mapper.mesh.size == 1:
            return mapper._run_on_device(loop, shared, rows, valid)
        return mapper._run_sharded(loop, shared, rows, ids if split else None)

    def _check_blocks(self, shared: tuple, ids) -> bool:
        """Whether `shared` holds client data in per-device blocks (`core.rows.DeviceBlocks`); such data
        is read only by a sharded mapper that knows the rows' clients."""
        if not rows_lib.has_blocks(shared):
            return False
        if self.mesh is None or self.mesh.size == 1:
            raise ValueError("client data in per-device blocks needs a mapper sharded over the "
                             "same devices (this one runs on one device)")
        if ids is None:
            raise ValueError("client data in per-device blocks is read only by a mapper call "
                             "that names its rows' clients (ids=): it checks that each row runs "
                             "on the device holding that client's samples")
        return True

    def _analysed(self, shared: tuple, split: bool) -> tuple:
        """What the automatic chunk size analyses: one device's block where data is split."""
        return rows_lib.local_abstract(shared, self.mesh.size) if split else shared

    def _run_on_device(self, loop, shared, rows, valid):
        if self.backend == "vmap":
            out = _vmap_rows(_whole_loop(loop, masked=True), shared, (rows, valid))
            return out
        return _run_capped(loop, shared, rows, valid, self.chunk_size)

    def _run_sharded(self, loop, shared, rows, ids=None):
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
        return self._sharded(lambda sh, rows, valid: self._run_on_device(loop, sh, rows, valid),
                             shared, rows, valid, ids, m, pad)

    def _sharded(self, per_device, shared, rows, extra, ids, m: int, pad: int):
        """shard_map of per_device(shared, rows, extra) over contiguous blocks of rows. With
        `ids` (data in per-device blocks, `core.rows.DeviceBlocks`): each device gets its own data block and
        counts its rows whose clients' samples are elsewhere (`blocks.misdealt`, noted for the
        program to check: `blocks.note`)."""
        spec = jax.sharding.PartitionSpec("clients")
        if ids is None:
            out = jax.shard_map(per_device, mesh=self.mesh,
                                in_specs=(jax.sharding.PartitionSpec(), spec, spec),
                                out_specs=spec, check_vma=False)(shared, rows, extra)
            return jax.tree.map(lambda x: x[:m], out) if pad else out
        ids = jnp.asarray(ids, jnp.int32)
        if pad:
            ids = jnp.concatenate([ids, jnp.repeat(ids[-1:], pad)])
        valid = jnp.arange(m + pad) < m

        def with_check(shared, rows, extra, ids, valid):
            misdealt = rows_lib.misdealt(rows_lib.owner_of(shared), ids, valid)
            return per_device(rows_lib.local(shared), rows, extra), misdealt

        out, misdealt = jax.shard_map(
            with_check, mesh=self.mesh, in_specs=(rows_lib.in_specs(shared), spec, spec, spec, spec),
            out_specs=(spec, spec), check_vma=False)(shared, rows, extra, ids, valid)
        checks.note("misdealt", misdealt)           # ([devices]: one count per device)
        return jax.tree.map(lambda x: x[:m], out) if pad else out

    def resolved(self, fn: Callable, shared: tuple, args: tuple) -> "ClientMapper":
        """This mapper with an automatic chunk size replaced by `auto_chunk_size` for `fn`."""
        if self.backend != "chunked" or self.chunk_size != AUTO_CHUNK:
            return self
        specs = (abstract(shared), abstract_row(args))
        leaves, treedef = jax.tree.flatten(specs)
        key = (treedef, tuple((x.shape, x.dtype) for x in leaves))
        return self._replace(chunk_size=self.cache.auto_chunk(fn, key, specs, _num_rows(args)))

    def _map_on_device(self, fn, shared, args, cost):
        if self.backend == "vmap":
            return _vmap_rows(fn, shared, args)
        return _chunked_map(fn, shared, args, self.chunk_size, cost)

    def _map_sharded(self, fn, shared, args, cost, ids=None):
        # Each device takes a contiguous block of rows: no cross-device permutation of the
        # (large) outputs. Within a device, "chunked" still sorts its block by cost.
        m = _num_rows(args)
        pad = -m % self.mesh.size
        if cost is None:
            cost = jnp.zeros(m, jnp.int32)
        if pad:  # repeat the last row; its results are dropped below
            args, cost = jax.tree.map(
                lambda x: jnp.concatenate([x, jnp.repeat(x[-1:], pad, axis=0)]), (args, cost))
        return self._sharded(lambda sh, args, cost: self._map_on_device(fn, sh, args, cost),
                             shared, args, cost, ids, m, pad)


def jit_unless_loop(mapper: ClientMapper, fn: Callable, **jit_kwargs) -> Callable:
    """`jax.jit(fn)` for the vectorised backends (inlined under an outer jit, and fast when
    called eagerly from a notebook), carrying the mapper's checks of client data in per-device
    blocks out to its caller (`checks.jit_carrying`); `fn` itself for the loop and debug
    backends, whose per-client calls are jitted separately and which must see concrete arrays to
    loop over."""
    if mapper.backend in EAGER_BACKENDS:
        return fn
    return checks.jit_carrying(fn, **jit_kwargs)


def client_mapper(backend: str = "chunked", chunk_size: int = AUTO_CHUNK) -> ClientMapper:
    """Validated ClientMapper (see its docstring)."""
    if backend not in BACKENDS:
        raise ValueError(f"--backend must be one of {BACKENDS}, got {backend!r}")
    if chunk_size < 0:
        raise ValueError(f"--chunk-size must be >= 0 (0: automatic), got {chunk_size}")
    return ClientMapper(backend, int(chunk_size))


def _num_rows(args) -> int:
    return jax.tree.leaves(args)[0].shape[0]


def _vmap_rows(fn, shared, args):
    if _num_rows(args) == 1:
        # One row runs unbatched (see _chunked_map): same values, no one-lane batching.
        out = fn(*shared, *jax.tree.map(lambda x: x[0], args))
        return jax.tree.map(lambda x: jnp.expand_dims(x, 0), out)
    return jax.vmap(fn, in_axes=(None,) * len(shared) + (0,) * len(args))(*shared, *args)


def _chunk_rows(m: int, chunk_size: int, order: jax.Array) -> jax.Array:
    """[chunks, size] row indices: `order` cut into k equal chunks of at most chunk_size rows
    (lax.map and scan then compile one body; a remainder chunk would compile a second one), the
    at most k − 1 padding slots repeating the last row of `order`."""
    chunks = -(-m // chunk_size)
    size = -(-m // chunks)
    return jnp.concatenate([order, jnp.full(chunks * size - m, order[m - 1])]).reshape(chunks, size)


def _chunked_map(fn, shared, args, chunk_size, cost):
    m = _num_rows(args)
    if chunk_size >= m:  # one chunk: plain vmap, no sorting
        return _vmap_rows(fn, shared, args)
    # k equal chunks of at most chunk_size rows (`_chunk_rows`): the padding rows repeat the
    # cheapest row.
    order = jnp.arange(m) if cost is None else jnp.argsort(-cost, stable=True)
    idx = _chunk_rows(m, chunk_size, order)
    size, padded = idx.shape[1], idx.reshape(-1)
    # Chunks of one client run unbatched: vmap over a single lane would still batch the
    # client's while-loop predicate (turning it into per-step selects of the whole carry) and
    # give every matmul a batch dimension (transposed copies of the weights on XLA:CPU). The
    # same holds for _vmap_rows of one row (the last stage of _run_capped: the longest client).
    out = jax.lax.map(lambda row: fn(*shared, *row), gather(args, padded),
                      batch_size=size if size > 1 else None)
    # Sorting by cost lets each chunk's while-loops stop at the chunk's own longest client.
    return gather(out, jnp.argsort(order))


def _loop_map(one_client, shared, args):
    outs = [one_client(*shared, *gather(args, i)) for i in range(_num_rows(args))]
    return jax.tree.map(lambda *rows: jnp.stack(rows), *outs)


def _debug_map(fn, shared, args, ids, stage):
    """The debug backend: each client's computation run eagerly (no jit anywhere), one client
    after another; an exception names the client (its id when the caller passed `ids`)."""
    outs = []
    with jax.disable_jit():
        for i in range(_num_rows(args)):
            try:
                outs.append(fn(*shared, *jax.tree.map(lambda x: x[i], args)))
            except ClientError:
                raise
            except Exception as e:
                client = None if ids is None else int(np.asarray(ids)[i])
                raise ClientError(stage, client=client, row=i, cause=e) from e
    return jax.tree.map(lambda *rows: jnp.stack(rows), *outs)


def host_max_length(loop: ClientLoop) -> int | None:
    """The most steps any client of the traced dataset takes (`ClientLoop.host_length` over the
    counts of `client_sizes`), or None where they are unknown."""
    sizes = _SIZES.get()
    if sizes is None or loop.host_length is None:
        return None
    lengths = np.asarray(loop.host_length(*sizes), np.int64)
    return int(lengths.max()) if lengths.size else 0


def _whole_loop(loop: ClientLoop, masked: bool = False) -> Callable:
    """One client's loop as a function (shared..., row) -> out (a lax.while_loop); with
    `masked`, (shared..., row, valid), where an invalid (padding) row takes no steps.

    Where every client of the traced dataset takes at most one step (`host_max_length`: an
    evaluation or a full-data pass of small clients in one batch), the step is straight-line
    code selected by `length > 0` instead of a while loop: the same arithmetic, and one loop
    less for XLA to compile (a loop's body and condition are separate computations that are
    not fused with the code around them)."""
    most = host_max_length(loop)
    one_step = masked and most is not None and most <= 1

    def run_one(*args):
        if masked:
            *shared, row, valid = args
        else:
            *shared, row = args
            valid = True
        shared = tuple(shared)
        length = jnp.where(valid, loop.length(row), 0)
        carry = loop.init(shared, row)
        if one_step:
            stepped = loop.step(shared, carry, jnp.zeros((), jnp.int32))
            carry = jax.tree.map(lambda a, b: jnp.where(length > 0, a, b), stepped, carry)
            return loop.finish(shared, carry)
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


def chunked_work(lengths, width: int) -> int:
    """Lane-steps of one stage: chunks of ≤ `width` clients sorted by length (as `_chunked_map`
    groups them), each chunk running every lane to its longest client's steps."""
    lengths = np.sort(np.asarray(lengths))
    m = len(lengths)
    if m == 0:
        return 0
    chunks = -(-m // max(1, width))
    per = -(-m // chunks)
    return sum(per * int(lengths[i * per:(i + 1) * per].max()) for i in range(chunks)
               if lengths[i * per:(i + 1) * per].size)


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
    another with no masking at all. A loop declared `large_carry` (an evaluation's carry holds
    the client's model) keeps only the results and the k longest clients' carries from stage 1
    (`_run_capped_keeping_results`).
    """
    m = _num_rows(rows)
    lengths = jnp.where(valid, jax.vmap(loop.length)(rows), 0).astype(jnp.int32)
    if width <= 1 and loop.large_carry:
        # One client after another, each gathering its own row inside the loop: no sorted copy
        # of every client's row (for an evaluation, every client's model) is made.
        one = _whole_loop(loop, masked=True)
        return jax.lax.map(lambda i: one(*shared, *gather((rows, valid), i)),
                           jnp.arange(m, dtype=jnp.int32))
    if width <= 1 or m <= 2 or loop.uniform or not worth_staging(loop, m, width):
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

    if loop.large_carry and 2 * (widths[0] + -(-m // -(-m // width))) <= m:
        # (k carries and one chunk's held instead of m: worth it where they are at most half)
        return _run_capped_keeping_results(loop, shared, rows, lengths, width, run_to, resume)
    stops = jnp.minimum(lengths, ranked[widths[0]])
    # Local training: a carry is about its result (the trained model, which `finish` passes
    # through without a copy), so stage 1 keeps every client's carry.
    t_carry = _chunked_map(run_to, shared, (rows, stops), width, stops)            # stage 1
    top = jnp.argsort(-lengths, stable=True)
    for i, k in enumerate(widths):                                                 # stages 2, 3
        stop = ranked[widths[i + 1]] if i + 1 < len(widths) else ranked[0]
        ids = top[:k]
        part = _vmap_rows(resume, shared, (gather(t_carry, ids), jnp.minimum(lengths[ids], stop)))
        t_carry = scatter(t_carry, ids, part)
    return jax.vmap(lambda c: loop.finish(shared, c))(t_carry[1])


def _run_capped_keeping_results(loop, shared, rows, lengths, width, run_to, resume):
    """`_run_capped` for a loop whose carry is much larger than its result (an evaluation
    carries the client's model): stage 1 keeps each client's result and only the carries of the
    k longest clients, which go on to stages 2 and 3, so the carries of all m clients are never
    held at once (with N clients evaluated, they were 2× every client's model)."""
    m = _num_rows(rows)
    ranked = jnp.sort(lengths)[::-1]
    widths = tail_widths(m)
    k = widths[0]
    order = jnp.argsort(-lengths, stable=True)         # longest first: its first k rows go on
    stops = jnp.minimum(lengths, ranked[k])
    idx = _chunk_rows(m, width, order)
    size = idx.shape[1]
    finish = lambda t_carry: _vmap_rows(lambda c: loop.finish(shared, c), (), (t_carry[1],))

    def chunk(kept, c_ids):
        c, ids = c_ids
        t_carry = _vmap_rows(run_to, shared, gather((rows, stops), ids))
        # Rows c·size … of the order; past the first k rows they land in the buffer's last
        # `size` rows (dynamic_update_slice clamps the start to k).
        kept = jax.tree.map(lambda b, x: jax.lax.dynamic_update_slice_in_dim(b, x, c * size, 0),
                            kept, t_carry)
        return kept, finish(t_carry)

    one = jax.eval_shape(lambda r: (jnp.zeros((), jnp.int32), loop.init(shared, r)),
                         gather(rows, 0))
    kept = jax.tree.map(lambda x: jnp.zeros((k + size,) + x.shape, x.dtype), one)
    kept, out = jax.lax.scan(chunk, kept, (jnp.arange(idx.shape[0], dtype=jnp.int32), idx))
    out = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:])[:m], out)          # in `order`
    t_top = jax.tree.map(lambda x: x[:k], kept)
    for i, w in enumerate(widths):                                                 # stages 2, 3
        stop = ranked[widths[i + 1]] if i + 1 < len(widths) else ranked[0]
        part = _vmap_rows(resume, shared, (jax.tree.map(lambda x: x[:w], t_top),
                                           jnp.minimum(lengths[order[:w]], stop)))
        t_top = jax.tree.map(lambda x, y: x.at[:w].set(y), t_top, part)
    out = jax.tree.map(lambda x, y: x.at[:k].set(y), out, finish(t_top))
    return gather(out, jnp.argsort(order))


def _steps(loop: ClientLoop, shared: tuple, t_carry, stop):
    """Steps t, t + 1, …, stop − 1 of one client's loop from (t, carry)."""
    return jax.lax.while_loop(lambda c: c[0] < stop,
                              lambda c: (c[0] + 1, loop.step(shared, c[1], c[0])), t_carry)
