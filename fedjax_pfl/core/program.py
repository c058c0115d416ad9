"""An algorithm compiled for one dataset: its placements, its jitted rounds, its memory plan.

`Program` is what the runner and the sweep tool execute. It picks two placements once:

  * a data placement (`core.data_placement`): where the clients' samples wait between rounds,
    every device (`DeviceData`), the host (`HostData`) or each device its own range
    (`core.sharded.ShardedData`);
  * a state placement (`core.state_placement`): where the per-client state rows wait, sharded
    over the devices (`DeviceState`) or in a host store (`HostState`);

and runs one path for every combination: stage the call's data, enter its state, call the
compiled rounds, leave (write back). The mesh is the program's: it is entered around every
trace (`jax.set_mesh`), and the engine's client mapper and sampling read it from there
(`layout.mesh_devices`), so an algorithm is built once for any layout. Every compiled function
returns, beside its results, the checks its trace noted (`core.checks`), read once per call.

With `rounds_per_call` = K, K rounds run in one `lax.scan` (sampling and metrics on device),
which removes the per-round dispatch that dominates small models. Per-client float state can
be stored in bfloat16 (`state_dtype`); `core.gather` hands rows back as float32, so all
arithmetic stays float32. `memory_plan()` adds up the bytes per device before anything is
allocated (from abstract shapes and XLA's memory analysis of the compiled round).

A model's frozen parameters (`Model.frozen`, `Algorithm.frozen`: a pretrained base under
adapters, `models.frozen`) are placed once, whole on every device, and passed to every
compiled program (the rounds, the evaluations, the initial state) as its last argument, which
the program binds while it traces (`models.frozen.binding`): an input, never a constant of the
program, never a client row, never in the state or a checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from fedjax_pfl.core import checks, execution, layout, placing, transfer
from fedjax_pfl.core.data_placement import DeviceData, HostData
from fedjax_pfl.core.evaluate import default_eval_group
from fedjax_pfl.core.execution import ClientError
from fedjax_pfl.core.memory import MemoryPlan, memory_plan, nbytes
from fedjax_pfl.core.sharded import ShardedData
from fedjax_pfl.core.state_placement import DeviceState, HostState
from fedjax_pfl.models import frozen as frozen_lib

Params = Any


class Placements(NamedTuple):
    data: Any     # DeviceData | HostData | ShardedData
    state: Any    # DeviceState | HostState


class Program:
    """`algo` compiled for `data`: init, rounds (one or K per call) and evaluation.

    Args:
      algo: an `algorithms.Algorithm`.
      data: the federated dataset; the program places it and keeps the placed copy as
        `self.data`.
      mesh: the device mesh, or None (one device; then nothing is sharded).
      jit: False for the loop and debug backends (their per-client calls run from Python).
      state_dtype: "float32" or "bfloat16" storage of per-client float state.
      rounds_per_call: K rounds per compiled call (lax.scan).
      data_placement: "device", "host", "sharded" or "auto" (`core.placing.data_placement`);
        every placement computes the rounds of "device" bit for bit.
      state_placement: "device", "host" or "auto" (`core.placing.state_placement`); "host" for
        algorithms that declare `Algorithm.host_state`, bit for bit the rounds of "device".
    """

    def __init__(self, algo, data, *, mesh: Mesh | None, jit: bool = True,
                 state_dtype: str = "float32", rounds_per_call: int = 1,
                 data_placement: str = "device", state_placement: str = "device"):
        poisson = (algo.hparams or {}).get("sampling") == "poisson"
        placing.check_options(state_dtype, rounds_per_call, jit, data_placement,
                              state_placement, poisson)
        self.algo, self.mesh, self.jit = algo, mesh, jit
        self.rounds_per_call = int(rounds_per_call)
        self.data_whole_bytes = nbytes((data.x, data.y))
        # Poisson-sampled rounds fill their unused slots with an empty padding client.
        data = data.pad_clients(mesh.size if mesh is not None else 1, minimum=int(poisson))
        self.num_clients = data.num_clients
        # The clients' sample counts, on the host, for the traces' staging decisions
        # (`execution.client_sizes`).
        self._sizes = tuple(np.asarray(jax.device_get(c), np.int64)
                            for c in (data.clients.train_count, data.clients.test_count))
        self.eval_group = min(default_eval_group(algo, data),
                              self.num_clients // algo.client_blocks)
        abstract = self._abstract_state(data)
        self.state_placement = placing.state_placement(state_placement, algo, abstract, jit)
        self.data_placement = placing.data_placement(data_placement, algo, data, abstract,
                                                     mesh, jit, self.state_placement)
        storage = jnp.bfloat16 if state_dtype == "bfloat16" else None
        streamed = self.data_placement != "device"
        self._probe = (self._jitted_probe(data) if streamed or self.state_placement == "host"
                       else None)
        # The next call's samples and rows are staged in the background while a call runs on
        # accelerators; on CPU the thread competes with the round for the same cores (FEMNIST
        # shape, 2 devices, quiet: host ÷ device 1.23 with it and 1.16 without at M = 10;
        # docs/decisions/host-prefetch.md).
        prefetch = jax.local_devices()[0].platform != "cpu"
        self.placements = Placements(
            self._data_placement(data, prefetch),
            self._state_placement(abstract, storage, prefetch))
        self.data = self.placements.data.data
        self._compiled: dict = {}
        self._round_compiled = self._init_compiled = None
        # The evaluation programs compiled ahead, by (name, whole, ids length or None).
        self._eval_compiled: dict[tuple, Any] = {}
        self.world_crossings = 0
        # The model's frozen parameters, whole on every device, the last argument of every
        # compiled program ({} without any: nothing is added to a program).
        frozen = getattr(algo, "frozen", None)
        self.frozen_bytes = 0 if frozen is None else frozen_lib.nbytes(frozen.value)
        self._frozen = frozen_lib.bound(
            frozen, None if frozen is None else transfer.put_whole(frozen.value, mesh))

    # -- construction -----------------------------------------------------------------------------

    def _abstract_state(self, data):
        key_spec = jax.eval_shape(lambda: jax.random.key(0))
        try:                       # (the state's shapes do not depend on where the data waits)
            with self._in_mesh():
                return jax.eval_shape(self.algo.init, key_spec, data)
        except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError,
                jax.errors.TracerBoolConversionError, jax.errors.TracerIntegerConversionError):
            # An init that needs concrete data (FedPC builds its kNN graph on the host, so its
            # state's shapes depend on the data): it runs eagerly, once, in `init`.
            return None

    def _data_placement(self, data, prefetch: bool):
        if self.data_placement == "device":
            return DeviceData(data, self.mesh, self.eval_group)
        data = dataclasses.replace(data, x=_on_host(data.x), y=_on_host(data.y),
                                   clients=transfer.put_whole(data.clients, self.mesh))
        if self.data_placement == "sharded":
            return ShardedData(data, self._probe, self.mesh, eval_group=self.eval_group)
        return HostData(data, self._probe, self.mesh, eval_group=self.eval_group,
                        prefetch=prefetch, blocks=getattr(self.algo, "data_blocks", True))

    def _state_placement(self, abstract, storage, prefetch: bool):
        if self.state_placement == "device":
            return DeviceState(abstract, self.num_clients, self.mesh, storage)
        # M, the clients of a round's participants, from the probe's shape (nothing is run).
        with self._in_mesh():
            per_round = int(jax.eval_shape(lambda c, k, f: self._probe.unwrapped(c, k, f, 1),
                                           self.data_clients_spec(),
                                           jax.eval_shape(lambda: jax.random.key(0)),
                                           jax.ShapeDtypeStruct((), jnp.int32)).shape[-1])
        return HostState(abstract, self.num_clients, self.mesh, storage, per_round=per_round,
                         rounds_per_call=self.rounds_per_call, eval_group=self.eval_group,
                         participants=self._participants, prefetch=prefetch,
                         where=self.algo.name, blocks=self.algo.client_blocks)

    def data_clients_spec(self):
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                            self._probe_data.clients)

    def _jitted_probe(self, data) -> Callable:
        """(clients, round_keys, first, count) -> [count, M] the rounds' participants
        (`Algorithm.participants`, declared by the algorithm), from the keys and the clients'
        counts alone: the data is a one-row stand-in."""
        if self.algo.participants is None:
            raise ValueError(f"{self.algo.name} does not declare the clients whose data a round "
                             "reads (Algorithm.participants), so its data cannot be staged from "
                             "the host: use --data-placement device")
        self._probe_data = dataclasses.replace(
            data, x=np.zeros((1,) + data.x.shape[1:], data.x.dtype),
            y=np.zeros((1,) + data.y.shape[1:], data.y.dtype))
        stub = self._probe_data

        def probe(clients, round_keys, first, count):
            d = dataclasses.replace(stub, clients=clients)
            return jnp.stack([self.algo.participants(d, round_key(round_keys, first + i))
                              for i in range(count)])

        return self._in_mesh_fn(jax.jit(probe, static_argnums=3))

    def _participants(self, round_keys: jax.Array, first: int, count: int) -> np.ndarray:
        """[count, M] participants of rounds first … first + count − 1 (the probe)."""
        return np.asarray(jax.device_get(self._probe(
            self.data.clients, round_keys, np.int32(first), count)), np.int64)

    @contextlib.contextmanager
    def _in_mesh(self):
        """The program's mesh as the trace's context (`jax.set_mesh`; nothing with one device),
        where the client mapper and sampling read it, and its clients' sample counts
        (`execution.client_sizes`), where the staged execution reads them."""
        with (jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()), \
                execution.client_sizes(*self._sizes):
            yield

    def _in_mesh_fn(self, fn: Callable) -> Callable:
        """`fn` (a jitted function) traced, lowered and called within the program's mesh."""
        return layout.InMesh(fn, self._in_mesh)

    def _jitted(self, name: str, fn: Callable, **kwargs) -> Callable:
        """The jitted `fn`, returning (fn's result, the checks its trace noted); the loop and
        debug backends run `fn` itself (checks noted outside a program are checked at once)."""
        if name not in self._compiled:
            if not self.jit:
                self._compiled[name] = lambda *args: (fn(*args[:-1]), {})
            else:
                if "out_shardings" in kwargs:
                    kwargs = {**kwargs, "out_shardings": (kwargs["out_shardings"], None)}
                self._compiled[name] = self._in_mesh_fn(jax.jit(checks.checked(
                    _with_frozen(fn)), **kwargs))
        return self._compiled[name]

    def _frozen_spec(self):
        """The frozen parameters' shapes, dtypes and shardings (what `compile` lowers with)."""
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(
            a.shape, a.dtype, sharding=a.sharding if self.mesh is not None else None),
            self._frozen)

    def _read(self, found: dict, where: str) -> None:
        """Stops on a misdealt row or a missed client row of a call (`core.checks`); counts the
        calls whose rows crossed a dealt world's devices."""
        if not found:
            return
        result = checks.Found.of(transfer.to_host(found))
        self.world_crossings += result.crossed
        result.raise_if_any(where, self.algo.name)

    # -- the rounds: stage → enter → call → leave -----------------------------------------------

    def init(self, key: jax.Array) -> Params:
        """The algorithm's initial state, created directly in its placement (by the program
        `compile` made of it, where it ran first)."""
        data = self.data
        with self._in_mesh():
            # (a sweep's batch of keys is another program than the one key compiled ahead)
            ahead = self._init_compiled if jnp.shape(key) == () else None
            return self.placements.state.init(self.algo.init, key, data, jit=self.jit,
                                              compiled=ahead, frozen=self._frozen)

    def run_rounds(self, state: Params, round_keys: jax.Array, first: int, count: int):
        """Rounds first … first + count − 1 (0-based). Returns (state, list of per-round metrics
        as host numpy dicts). `count` is normally `rounds_per_call` (a shorter last call
        compiles once more)."""
        if not self.jit:
            return self._run_eagerly(state, round_keys, first)
        data_at, state_at = self.placements
        staged = data_at.take(round_keys, first, count)
        ids = staged.ids
        if ids is None and state_at.needs_participants:
            ids = self._participants(round_keys, first, count)
        carry, fixed = state_at.enter(state, ids, count, round_keys, first)
        (carry, metrics), found = self._round_function(count, staged.per_round)(
            carry, fixed, staged.data, round_keys, np.int32(first), self._frozen)
        # While these rounds run: the next call's data, and its rows from the store.
        data_at.prefetch(round_keys, first + count, count)
        if state_at.needs_participants:
            state_at.prefetch(state, round_keys, first + count, count)
        per_round = _per_round(transfer.to_host(metrics), count)
        self._read(found, f"rounds {first + 1}-{first + count}")
        if ids is not None:
            self._check_sampled(per_round, ids, first)
        return state_at.leave(state, carry, fixed), per_round

    def _run_eagerly(self, state, round_keys, first: int):
        """One round of the loop or debug backend, from Python (its client calls jitted one by
        one, or not at all)."""
        try:
            state, m = self.algo.round_fn(state, self.data, round_key(round_keys, first))
        except ClientError as e:                      # the debug backend: add the round
            raise ClientError(e.stage, client=e.client, row=e.row, cause=e.cause,
                              round=first + 1) from e.cause
        return self.placements.state.store(state), [jax.device_get(m)]

    def _round_function(self, count: int, per_round: bool) -> Callable:
        if count == self.rounds_per_call and self._round_compiled is not None:
            return self._round_compiled
        state_at = self.placements.state

        def one(carry, fixed, data, round_keys, r):
            state = state_at.wrap(carry, fixed)
            state, metrics = self.algo.round_fn(state, data, round_key(round_keys, r))
            return state_at.unwrap(state_at.store(state), fixed), metrics

        def rounds(carry, fixed, data, round_keys, first):
            if count == 1:
                return one(carry, fixed, data, round_keys, first)

            def body(carry, xs):
                i, round_data = xs if per_round else (xs, data)
                (carry, m), found = checks.checked(one)(carry, fixed, round_data, round_keys,
                                                        first + i)
                return carry, (m, found)

            steps = jnp.arange(count, dtype=jnp.int32)
            carry, (m, found) = jax.lax.scan(body, carry, (steps, data) if per_round else steps)
            checks.note_each(found)
            return carry, m

        kwargs = {}
        if self.mesh is not None:
            kwargs["out_shardings"] = (state_at.carry_shardings(count), state_at.replicated())
        return self._jitted(f"rounds{count}{'_staged' * per_round}", rounds, donate_argnums=0,
                            **kwargs)

    def _check_sampled(self, per_round: list[dict], ids: np.ndarray, first: int) -> None:
        """Every client a round reports as sampled was among the participants moved to the
        devices before it ran."""
        for i, row in enumerate(per_round):
            sampled = np.asarray(row["sampled"]).ravel()
            if not np.isin(sampled, ids[i]).all():
                raise RuntimeError(
                    f"round {first + i + 1} trained clients {np.setdiff1d(sampled, ids[i])[:8]} "
                    f"that were not among the participants moved to the devices: "
                    f"{self.algo.name}'s sampling depends on more than its key and the clients' "
                    "counts; run it with --data-placement device --state-placement device")

    # -- evaluation -----------------------------------------------------------------------------

    def evaluate(self, state: Params, ids: np.ndarray | None = None) -> dict:
        """The algorithm's evaluation (every client, or the clients `ids`), on the host."""
        return self._evaluate_with("evaluate", self.algo.evaluate, state, ids)

    def evaluate_part(self, part: str, state: Params, ids: np.ndarray | None = None) -> dict:
        """One part ("rows" or "rest") of an algorithm's `evaluate_parts`, as `evaluate`."""
        return self._evaluate_with(f"evaluate_{part}", getattr(self.algo.evaluate_parts, part),
                                   state, ids)

    def _evaluate_with(self, name: str, fn: Callable, state: Params, ids) -> dict:
        if not self.jit:
            out = fn(state, self.data) if ids is None else fn(state, self.data,
                                                             jnp.asarray(ids, jnp.int32))
            return transfer.to_host(out)
        data_at, state_at = self.placements
        grouped = state_at.grouped or data_at.needs_participants

        def run(data, padded):
            if padded is None:
                carry, fixed = state_at.enter_evaluation(state, None)
                out, found = self._eval_function(name, fn, whole=True)(carry, fixed, data,
                                                                       self._frozen)
            else:
                carry, fixed = state_at.enter_evaluation(state, padded)
                out, found = self._eval_function(name, fn, ids=len(padded))(carry, fixed, data,
                                                                           padded, self._frozen)
            self._read(found, "evaluation")
            return transfer.to_host(out)

        return data_at.evaluate(run, ids, grouped)

    def _eval_function(self, name: str, fn: Callable, whole: bool = False,
                       ids: int | None = None) -> Callable:
        """The evaluation `name` of every client (`whole`) or of `ids` clients: the program
        `compile` made for these shapes, else the jitted function (compiled at its first call:
        e.g. a final evaluation of another client count)."""
        ahead = self._eval_compiled.get((name, whole, None if whole else ids))
        if ahead is not None:
            return ahead
        state_at = self.placements.state
        if whole:
            def every_client(c, f, d):
                return fn(state_at.wrap(c, f), d)

            return self._jitted(name, _named(every_client, name))

        def some_clients(c, f, d, i):
            return fn(state_at.wrap(c, f), d, i)

        return self._jitted(f"{name}_ids", _named(some_clients, f"{name}_ids"))

    def evaluations(self) -> list[tuple[str, Callable, bool, int | None]]:
        """(name, function, whole, ids length) of the evaluations the runner calls every
        --eval-every rounds: the algorithm's `evaluate`, or the two parts of its
        `evaluate_parts` as `core.CachedEvaluation` calls them (the rows of a group of changed
        clients, the rest of every client); never the full evaluation beside its parts."""
        grouped = self.placements.state.grouped or self.placements.data.needs_participants
        group = None if not grouped else self.eval_group
        parts = self.algo.evaluate_parts
        if parts is None:
            return [("evaluate", self.algo.evaluate, not grouped, group)]
        rows_group = group if grouped else min(default_eval_group(self.algo, self.data),
                                               self.num_clients)
        return [("evaluate_rows", parts.rows, False, rows_group),
                ("evaluate_rest", parts.rest, not grouped, group)]

    # -- compiled ahead -------------------------------------------------------------------------

    def compile(self, round_keys: jax.Array, *, init: bool = True) -> float:
        """Compiles, from abstract shapes, the round, the evaluations the runner calls
        (`evaluations`) and (`init`) the initial state's program; returns the seconds it took.
        Nothing of the state is allocated.

        Every program is traced and lowered first (Python), then all are compiled at once in
        threads (XLA's compiler releases the GIL: on 2 cores the evaluation's compile hides
        behind the round's). The initial state's program runs once, so it is compiled at a low
        backend optimisation level (`INIT_COMPILER_OPTIONS`): the same values, in a third of
        the time (`tests/core/test_compiled_programs.py`)."""
        if not self.jit:
            return 0.0
        if not self.traceable_init:
            raise RuntimeError("this algorithm's init needs concrete data: call init(key) first "
                               "(Program.traceable_init is False)")
        t0 = time.perf_counter()
        data_at, state_at = self.placements
        k = self.rounds_per_call
        if data_at.needs_participants:
            data_at.participants(round_keys, 0, 1)             # learns M, hence the buffer size
        lowered: dict[Any, tuple[Any, dict | None]] = {}
        carry, fixed = state_at.abstract_inputs(k)
        per_round = data_at.needs_participants and k > 1
        lowered["round"] = (self._round_function(k, per_round).lower(
            carry, fixed, data_at.abstract(k), round_keys, jax.ShapeDtypeStruct((), jnp.int32),
            self._frozen_spec()), None)
        grouped = state_at.grouped or data_at.needs_participants
        for name, fn, whole, ids in self.evaluations():
            carry, fixed = state_at.abstract_eval_inputs(self.eval_group if grouped else ids)
            args = (carry, fixed, data_at.abstract_evaluation(grouped))
            if not whole:
                args += (jax.ShapeDtypeStruct((ids,), jnp.int32),)
            args += (self._frozen_spec(),)
            lowered[(name, whole, None if whole else ids)] = (
                self._eval_function(name, fn, whole, ids).lower(*args), None)
        # (an init that needs concrete data, FedPC's, ran eagerly once: nothing to compile)
        if init and self._init_compiled is None and state_at.traceable:
            init_fn = self._in_mesh_fn(state_at.init_function(self.algo.init, self.data))
            key = jax.eval_shape(lambda: jax.random.key(0))
            lowered["init"] = (init_fn.lower(key, self.data, self._frozen_spec()),
                               init_compiler_options())
        compiled = compile_all(lowered)
        self._round_compiled = compiled.pop("round")
        self._init_compiled = compiled.pop("init", self._init_compiled)
        self._eval_compiled.update(compiled)
        return time.perf_counter() - t0

    @property
    def is_compiled(self) -> bool:
        """Whether `compile` has run (a reused program is not compiled again)."""
        return self._round_compiled is not None

    @property
    def traceable_init(self) -> bool:
        return self.placements.state.abstract is not None

    @property
    def abstract_state(self):
        return self.placements.state.abstract

    def abstract_sharded_state(self):
        """The state's shapes and dtypes with their shardings (`jax.ShapeDtypeStruct`s): what a
        checkpoint is restored into before any state exists."""
        return self.placements.state.abstract_sharded()

    # -- checkpoints ----------------------------------------------------------------------------

    def checkpoint_parts(self, state) -> tuple[Any, dict[str, np.ndarray]]:
        """(the tree a checkpoint saves with orbax, host arrays saved beside it): the state
        itself, or under host state placement its device leaves and its store's arrays."""
        return self.placements.state.checkpoint_parts(state)

    def checkpoint_like(self, host_arrays: dict[str, np.ndarray], like=None):
        """What to restore a checkpoint's tree into (`StatePlacement.checkpoint_like`)."""
        return self.placements.state.checkpoint_like(host_arrays, like)

    def restored(self, tree, host_arrays: dict[str, np.ndarray]):
        """The state from a checkpoint's parts, in this program's state placement whichever
        placement wrote it (the rows are the same)."""
        return self.placements.state.restored(tree, host_arrays)

    # -- memory ---------------------------------------------------------------------------------

    def memory_plan(self) -> MemoryPlan:
        """Bytes per device (call `compile` first for the working sets)."""
        return memory_plan(self.abstract_state, self.num_clients, self.mesh,
                           compiled=(self._round_compiled, _largest(self._eval_compiled.values())),
                           state_sizes=self.placements.state.sizes(),
                           data_bytes=self.placements.data.bytes_on_device(),
                           data_whole=self.data_whole_bytes, data_placement=self.data_placement,
                           state_placement=self.state_placement,
                           is_compiled=self.is_compiled or not self.jit,
                           frozen_bytes=self.frozen_bytes)


# XLA's backend optimisation level 1 for programs that run once (the initial state): the main
# job's compiles in 0.98 s against 2.64 s at the default level, with the same bits. Level 0
# (0.61 s) rounds the MLP's initial bias differently (7e-9: docs/decisions/startup.md).
INIT_COMPILER_OPTIONS = {"xla_backend_optimization_level": 1}
_XLA_DEFAULT_LEVEL = 2


def init_compiler_options() -> dict | None:
    """`INIT_COMPILER_OPTIONS` where they lower XLA's level (its default, or $XLA_FLAGS'
    --xla_backend_optimization_level), else None: a level already lower (the test suite's 0)
    is kept, so that the initial state is the one `jax.jit` gives under the same flags."""
    import os
    import re

    found = re.findall(r"--xla_backend_optimization_level=(\d+)", os.environ.get("XLA_FLAGS", ""))
    level = int(found[-1]) if found else _XLA_DEFAULT_LEVEL
    wanted = INIT_COMPILER_OPTIONS["xla_backend_optimization_level"]
    return dict(INIT_COMPILER_OPTIONS) if level > wanted else None


def compile_all(lowered: dict) -> dict:
    """{name: (lowered, compiler options or None)} -> {name: compiled}, compiled concurrently
    (one thread each: XLA's compile releases the GIL), in the order given when one is left."""
    import concurrent.futures

    def one(item):
        low, options = item
        return low.compile() if options is None else low.compile(compiler_options=options)

    if len(lowered) <= 1:
        return {name: one(item) for name, item in lowered.items()}
    with concurrent.futures.ThreadPoolExecutor(len(lowered), thread_name_prefix="compile") as pool:
        futures = {name: pool.submit(one, item) for name, item in lowered.items()}
        return {name: f.result() for name, f in futures.items()}


def _with_frozen(fn: Callable) -> Callable:
    """fn(*args) as f(*args, frozen bindings): the model's frozen parameters, the program's last
    argument, bound while it traces (`models.frozen.binding`)."""
    def with_frozen(*args):
        with frozen_lib.binding(args[-1]):
            return fn(*args[:-1])

    return _named(with_frozen, fn.__name__)


def _named(fn: Callable, name: str) -> Callable:
    """`fn` under `name`: the name JAX gives its program ("jit(evaluate_rows_ids)"), which the
    compile log (`fedjax_pfl.compiles`) and the program-count tests read."""
    fn.__name__ = fn.__qualname__ = name
    return fn


def _largest(compiled) -> Any:
    """The compiled program of the largest working set (XLA's memory analysis), or None."""
    best, size = None, -1
    for c in compiled:
        temp = int(c.memory_analysis().temp_size_in_bytes)
        if temp > size:
            best, size = c, temp
    return best


def round_key(round_keys: jax.Array, r) -> jax.Array:
    """Round r's key: `fold_in(round_keys, r)`, for each key of a batch of them (a sweep's runs,
    one key each: `fedjax_pfl.sweep`)."""
    if round_keys.ndim == 0:
        return jax.random.fold_in(round_keys, r)
    return jax.vmap(jax.random.fold_in, (0, None))(round_keys, r)


def _on_host(a) -> np.ndarray:
    """`a` as a host array: NumPy (and memory-mapped) arrays as they are, device arrays fetched."""
    return a if isinstance(a, np.ndarray) else np.asarray(jax.device_get(a))


def _per_round(metrics: dict, count: int) -> list[dict]:
    """One call's host metrics as one dict per round (a K-round call's leaves lead with K)."""
    if count == 1:
        return [metrics]
    return [jax.tree.map(lambda a: a[i], metrics) for i in range(count)]
