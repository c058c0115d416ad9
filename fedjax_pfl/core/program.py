"""An algorithm compiled for one dataset: where its state lives, its jitted rounds, its memory plan.

`Program` is what the runner (and the sweep tool) executes:

  * client state is SHARDED along the client axis over the device mesh ("clients"): every leaf
    of a field the algorithm's state declares per-client (`CLIENT_FIELDS`, `core.placement`) is
    split across devices, the rest (global models, scalars) is replicated. So memory per device is about N × (state per client) / devices + the working set.
    N is padded to a multiple of the device count with empty clients (`FederatedData.pad_clients`).
    With device placement the dataset is replicated (every device can train any client); with
    host placement (`core.streaming`) it stays in host memory and each round's participants'
    samples are moved to the devices, the next round's in the background.
  * with host state placement (`core.hoststate`) the per-client rows wait in a copy-on-write
    host store instead; the state the runner holds is then a `HostState` (device leaves and the
    store), each call's participants' rows are moved to the devices and back, and checkpoints
    take the store as host arrays (`checkpoint_parts`, `restored`); those calls are
    `core.program_host.HostStateCalls`, a mixin of `Program`.
  * the algorithm's `round_fn` is jitted with the state donated and its shardings kept; with
    `rounds_per_call` = K, K rounds run in one `lax.scan` (sampling and metrics on device), which
    removes the per-round dispatch that dominates small models.
  * per-client float state can be stored in bfloat16 (`state_dtype`), halving its memory;
    `core.gather` hands rows back as float32, so all arithmetic stays float32.
  * `memory_plan()` adds up the bytes per device before anything is allocated (from abstract
    shapes and XLA's memory analysis of the compiled round) and says where the run stops fitting.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from fedjax_pfl.core.clients import num_sampled_clients
from fedjax_pfl.core.execution import ClientError
from fedjax_pfl.core import blocks
from fedjax_pfl.core.placement import (cast_client_leaves, client_mask, client_shardings, to_host,
                                       client_state_bytes, put_agreed, replicate)
from fedjax_pfl.core.hoststate import STATE_PLACEMENTS, HostClients
from fedjax_pfl.core.program_host import HostStateCalls, _per_round
from fedjax_pfl.core.sharded import ShardedStream
from fedjax_pfl.core.streaming import DATA_PLACEMENTS, Stream

Params = Any
STATE_DTYPES = ("float32", "bfloat16")


class MemoryPlanError(ValueError):
    """The run would not fit in memory; the message names the flags that help."""


@dataclasses.dataclass
class MemoryPlan:
    """Bytes per device of a run (CPU devices share the host's memory, so they add up)."""

    devices: int
    platform: str
    num_clients: int
    state_per_client: int          # bytes of one client's state rows (storage dtype)
    client_state_per_device: int   # N / devices × state_per_client
    replicated_state: int          # global models, server state, … (on every device)
    data: int                      # the dataset on each device (replicated), or the streamed buffers
    working_set: int               # XLA temporaries of one compiled round (per device)
    eval_working_set: int          # XLA temporaries of one evaluation (per device)
    available: int                 # bytes the run may use (this host's devices together on CPU)
    local_devices: int = 0         # devices of this process (0: all of `devices`)
    data_placement: str = "device"
    data_whole: int = 0            # the whole dataset's bytes (on each device, or on the host)
    compiled: bool = True          # False: the working sets are not known yet (0 here)
    state_placement: str = "device"
    host_row_bytes: int = 0        # host placement: one client's rows in the host store
    world_rows: int = 0            # host placement: client rows on each device (a call's world)
    staging_rows: int = 0          # host placement, several processes: rows each device receives
                                   # from its process before the world is assembled (transient)

    @property
    def per_device(self) -> int:
        return (self.client_state_per_device + self.replicated_state + self.data
                + max(self.working_set, self.eval_working_set, self.staging))

    @property
    def staging(self) -> int:
        """Bytes of the rows a device holds while a world is assembled (several processes,
        `Program._put_rows`): freed before the round runs, so counted as a working set."""
        return self.staging_rows * self.host_row_bytes

    @property
    def _sharing(self) -> int:
        """Devices that draw on the memory `available` measures: this process's CPU devices
        share its host's memory (another process's devices are another host's); an accelerator
        has its own."""
        if self.platform != "cpu":
            return 1
        return self.local_devices or self.devices

    @property
    def total(self) -> int:
        """What the run needs from the memory `available` measures."""
        return self.per_device * self._sharing

    def fits(self) -> bool:
        return self.available <= 0 or self.total <= self.available

    def max_clients(self) -> int | None:
        """The N at which the run would stop fitting (same data, other things equal)."""
        if self.available <= 0 or self.state_per_client == 0:
            return None
        fixed = self.per_device - self.client_state_per_device
        per_device_budget = self.available / self._sharing - fixed
        return max(0, int(per_device_budget * self.devices / self.state_per_client))

    def describe(self) -> str:
        mb = lambda b: f"{b / 2**20:,.1f} MB"
        lines = [
            f"memory plan ({self.devices} {self.platform} device{'s' if self.devices > 1 else ''}, "
            f"{self.num_clients} clients): per device {mb(self.per_device)} = client state "
            f"{mb(self.client_state_per_device)} ({mb(self.state_per_client)} per client, sharded) "
            f"+ replicated state {mb(self.replicated_state)} + data {mb(self.data)} + working set "
            f"{mb(max(self.working_set, self.eval_working_set))}",
        ]
        if not self.compiled:
            lines.append("  working set not known yet: Program.compile first (a round's "
                         "temporaries can be as large as the client state)")
        if self.state_placement == "host":
            lines.append(
                f"  client state on the host: {mb(self.host_row_bytes)} per client that a round "
                f"has written (copy-on-write: the others share one initial row); each call moves "
                f"its participants' rows to the devices, each device the rows of the clients it "
                f"trains first ({self.world_rows} clients a device, "
                f"{mb(self.world_rows * self.host_row_bytes)}, counted in the client state above)")
            if self.staging_rows:
                lines.append(
                    f"  several processes: each device first receives its process's rows of the "
                    f"whole world ({self.staging_rows} clients, {mb(self.staging)}), then one "
                    f"gather assembles its own; counted as a working set")
        if self.data_placement == "host":
            lines.append(f"  data on the host ({mb(self.data_whole)}); on each device only the "
                         f"streamed buffers ({mb(self.data)}: this round's and the next round's "
                         "participants, or one evaluation group)")
        elif self.data_placement == "sharded":
            lines.append(f"  data sharded over the devices ({mb(self.data_whole)} in all); on "
                         f"each device {mb(self.data)}: its clients' samples, the round's block "
                         "of participants and the exchange's buffers")
        elif self.data_whole:
            lines.append(f"  data on every device ({mb(self.data_whole)}); --data-placement "
                         "sharded would keep 1/D of it on each device, host would keep it on the "
                         "host, each moving only a round's participants' samples to the devices")
        if self.available > 0:
            limit = self.max_clients()
            lines.append(f"  needs {mb(self.total)} of {mb(self.available)} available"
                         + (f"; stops fitting at about {limit:,} clients" if limit else ""))
        return "\n".join(lines)


def available_memory(platform: str) -> int:
    """Bytes available: the host's MemAvailable on CPU, otherwise the limit of this process's
    first device (`jax.devices()[0]` may be another process's, with no statistics here)."""
    if platform == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return 0
        return 0
    stats = jax.local_devices()[0].memory_stats() or {}
    return int(stats.get("bytes_limit", 0))


def _itemsize(dtype) -> int:
    """Bytes per element (PRNG key arrays included: their dtype knows its own size)."""
    return int(dtype.itemsize)


def _nbytes(tree) -> int:
    return int(sum(np.prod(x.shape) * _itemsize(x.dtype) for x in jax.tree.leaves(tree)))


class Program(HostStateCalls):
    """`algo` compiled for `data`: init, rounds (one or K per call) and evaluation.

    Args:
      algo: an `algorithms.Algorithm`.
      data: the federated dataset; the program places it (`data_placement`) and keeps the
        placed copy as `self.data`.
      mesh: the device mesh, or None (one device; then nothing is sharded).
      jit: False for the loop backend (its per-client calls are jitted one by one).
      state_dtype: "float32" or "bfloat16" storage of per-client float state.
      rounds_per_call: K rounds per compiled call (lax.scan).
      data_placement: where the clients' samples wait between rounds. "device": replicated on
        every device (`prepare_data`), so any device can train any client. "host": in host
        memory (`data.x` / `data.y` may be NumPy or memory-mapped arrays), each round's
        participants' samples moved to the devices, the next call's gathered and transferred
        in the background (`core.streaming`); bit for bit the rounds of "device". "sharded":
        each device holds only its own range of clients' samples (each process reads only its
        devices' ranges) and each round's participants' samples move between the devices, on
        them, to the devices that train them (`core.sharded`); bit for bit the rounds of
        "device"; "device" with one device. "auto": device when the dataset and the client state
        fit in 80 % of the available memory, else sharded when a 1/D share does (several
        devices), else host.
      state_placement: where the per-client state rows wait. "device": sharded over the devices.
        "host": a host store (`core.hoststate`), for algorithms that declare
        `Algorithm.host_state`; bit for bit the rounds of "device". "auto": host when allowed
        and the client state would take more than 80 % of the available memory.
    """

    def __init__(self, algo, data, *, mesh: Mesh | None, jit: bool = True,
                 state_dtype: str = "float32", rounds_per_call: int = 1,
                 data_placement: str = "device", state_placement: str = "device"):
        if state_dtype not in STATE_DTYPES:
            raise ValueError(f"--state-dtype must be one of {list(STATE_DTYPES)}, got {state_dtype!r}")
        if rounds_per_call < 1:
            raise ValueError(f"--rounds-per-call must be >= 1, got {rounds_per_call}")
        if not jit and rounds_per_call > 1:
            raise ValueError("--rounds-per-call needs a vectorised --backend (not loop)")
        if data_placement not in DATA_PLACEMENTS:
            raise ValueError(f"--data-placement must be one of {list(DATA_PLACEMENTS)}, "
                             f"got {data_placement!r}")
        if data_placement in ("host", "sharded") and not jit:
            raise ValueError(f"--data-placement {data_placement} needs a vectorised --backend "
                             "(not loop)")
        if state_placement not in STATE_PLACEMENTS:
            raise ValueError(f"--state-placement must be one of {list(STATE_PLACEMENTS)}, "
                             f"got {state_placement!r}")
        self.data_whole_bytes = _nbytes((data.x, data.y))
        poisson = (algo.hparams or {}).get("sampling") == "poisson"
        if poisson and (data_placement in ("host", "sharded") or state_placement == "host"):
            raise ValueError("--sampling poisson runs with device placement only (its rounds "
                             "hold empty slots that host and sharded placement's per-round "
                             "staging does not expect): use --data-placement device "
                             "--state-placement device")
        several = mesh is not None and mesh.size > 1
        data_blocks = getattr(algo, "data_blocks", True)
        if data_placement == "sharded" and several and not data_blocks:
            raise ValueError(f"--data-placement sharded: {algo.name} reads client samples in "
                             "another order than it trains its clients (Algorithm.data_blocks is "
                             "False), so each device needs every sample: use --data-placement "
                             "device or host")
        if data_placement == "sharded" and not several:
            data_placement = "device"        # one device holds every client's samples anyway
        # Poisson-sampled rounds fill their unused slots with an empty padding client.
        data = data.pad_clients(mesh.size if mesh is not None else 1, minimum=int(poisson))
        key_spec = jax.eval_shape(lambda: jax.random.key(0))
        try:                      # (the state's shapes do not depend on where the data waits)
            abstract = jax.eval_shape(algo.init, key_spec, data)
        except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError,
                jax.errors.TracerBoolConversionError, jax.errors.TracerIntegerConversionError):
            # An init that needs concrete data (FedPC builds its kNN graph on the host, so its
            # state's shapes depend on the data): it runs eagerly, once, in `init`.
            abstract = None
        state_placement = _choose_state_placement(state_placement, algo, abstract, data, mesh,
                                                  jit)
        if data_placement == "auto":
            state_bytes = 0 if abstract is None or state_placement == "host" else _nbytes(abstract)
            if _device_data_fits(data, state_bytes, mesh) or not jit:
                data_placement = "device"
            elif (several and data_blocks
                  and _device_data_fits(data, state_bytes, mesh, share=mesh.size)):
                data_placement = "sharded"
            else:
                data_placement = "host"
        self.state_placement = state_placement
        self.data_placement = data_placement
        self.stream: Stream | None = None
        if data_placement in ("host", "sharded"):
            data = dataclasses.replace(data, x=_on_host(data.x), y=_on_host(data.y),
                                       clients=replicate(data.clients, mesh))
        else:
            data = prepare_data(data, mesh)      # idempotent: callers may have placed it already
            if mesh is None and isinstance(data.x, np.ndarray):
                data = jax.device_put(data)
        self.algo, self.data, self.mesh, self.jit = algo, data, mesh, jit
        self.rounds_per_call = int(rounds_per_call)
        self.storage = jnp.bfloat16 if state_dtype == "bfloat16" else None
        self.num_clients = data.num_clients
        self.traceable_init = abstract is not None
        if abstract is not None:
            client_mask(abstract, self.num_clients)   # the declaration must match the shapes
        self.abstract_state = self._store(abstract) if abstract is not None else None
        self.shardings = None
        self._compiled: dict = {}
        self._misdealt: list = []        # (`_Checked`: read by `_check_dealt`)
        self._update_shardings()
        self.eval_group = min(default_eval_group(algo, data), self.num_clients)
        self.host: HostClients | None = None
        streamed = data_placement in ("host", "sharded")
        self._probe = self._jitted_probe() if streamed or state_placement == "host" else None
        if data_placement == "host":
            # The next call's samples staged in the background while a call runs: on
            # accelerators. On CPU the thread competes with the round for the same cores (FEMNIST
            # shape, 2 devices, quiet: host ÷ device 1.23 with it and 1.16 without at M = 10,
            # 1.07 and 1.06 at M = 50; benchmarks/RESULTS.md §19), as for the rows below.
            self.stream = Stream(data, self._probe, mesh, eval_group=self.eval_group,
                                 prefetch=jax.local_devices()[0].platform != "cpu",
                                 blocks=data_blocks)
        elif data_placement == "sharded":
            self.stream = ShardedStream(data, self._probe, mesh, eval_group=self.eval_group)
        # Host state over several processes: each process's store holds only its range of
        # clients' rows (`_row_ownership`); a call's world rows are assembled on the devices
        # from every process's (`_put_rows`).
        self._rows_here: np.ndarray | None = None
        if state_placement == "host":
            self.host = HostClients(self.abstract_state, client_mask(self.abstract_state))
            if jax.process_count() > 1:
                self._rows_here, self._row_device = self._row_ownership()
        self._clients_per_round: int | None = None
        # Host state: the next call's rows gathered in the background while a call runs. On CPU
        # the gather competes with the round for the same cores (host ÷ device 1.19 with it,
        # 1.13 without at M = 10; benchmarks/RESULTS.md §19), so it is on for accelerators only.
        self.prefetch_rows = jax.local_devices()[0].platform != "cpu"
        self._rows_pool = None
        self._rows_pending = None
        self._rows_written = np.zeros(0, np.int64)
        self.rows_hits = self.rows_misses = 0
        self.world_crossings = 0

    def _jitted_probe(self) -> Callable:
        """(clients, round_keys, first, count) -> [count, M] the rounds' participants
        (`Algorithm.participants`, declared by the algorithm), from the keys and the clients'
        counts alone: the data is a one-row stand-in."""
        if self.algo.participants is None:
            raise ValueError(f"{self.algo.name} does not declare the clients whose data a round "
                             "reads (Algorithm.participants), so its data cannot be staged from "
                             "the host: use --data-placement device")
        stub = dataclasses.replace(self.data, x=np.zeros((1,) + self.data.x.shape[1:], self.data.x.dtype),
                                   y=np.zeros((1,) + self.data.y.shape[1:], self.data.y.dtype))

        def probe(clients, round_keys, first, count):
            data = dataclasses.replace(stub, clients=clients)
            return jnp.stack([self.algo.participants(data, jax.random.fold_in(round_keys, first + i))
                              for i in range(count)])

        return jax.jit(probe, static_argnums=3)

    def _update_shardings(self):
        if self.mesh is not None and self.abstract_state is not None:
            self.shardings = client_shardings(self.abstract_state, self.mesh, self.num_clients)

    def _eager_init(self, key):
        """Runs an untraceable init once (on the host) and learns the state's shapes from it."""
        state = self.algo.init(key, self.data)
        client_mask(state, self.num_clients)          # the declaration must match the shapes
        state = self._store(state)
        self.abstract_state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
        self._update_shardings()
        if self.shardings is not None:
            # (every process ran the same init on the same data: each places its own shards)
            state = put_agreed(state, self.shardings, f"{self.algo.name}'s initial state")
        return state

    # -- pieces ---------------------------------------------------------------------------------

    def _store(self, state):
        if self.storage is None:
            return state
        return cast_client_leaves(state, self.storage, self.num_clients)

    def _round(self, state, data, round_keys, r):
        state, metrics = self.algo.round_fn(state, data, jax.random.fold_in(round_keys, r))
        return self._store(state), metrics

    def _check_dealt(self, where: str) -> None:
        """Raises if a call's rounds (or an evaluation) ran a client on a device that does not
        hold its samples (data in per-device blocks: `core.blocks`): reads the misdealt counts
        of the calls made since the last time (`_Checked`), which waits for them to finish."""
        counts = list(self._misdealt)
        self._misdealt.clear()
        # (added up on the devices and read once: in a run of several processes each read of a
        # count sharded over the devices is an all-gather)
        if counts and np.any(to_host(blocks.total(counts))):
            raise RuntimeError(
                f"{where}: {self.algo.name} ran a client on a device "
                "that does not hold its samples (its round reads them in another client order "
                "than its training); declare it with data_blocks=False or run it with "
                "--data-placement device")

    def _rounds(self, state, data, round_keys, first, count: int):
        if self.stream is not None:       # each round its own staged data (leading axis K)
            def body(state, xs):
                i, round_data = xs
                (state, m), misdealt = blocks.checked(self._round)(state, round_data, round_keys,
                                                                   first + i)
                return state, (m, misdealt)

            state, (m, misdealt) = jax.lax.scan(body, state,
                                                (jnp.arange(count, dtype=jnp.int32), data))
            blocks.note_each(misdealt)
            return state, m

        def body(state, i):
            return self._round(state, data, round_keys, first + i)

        return jax.lax.scan(body, state, jnp.arange(count, dtype=jnp.int32))

    def _jitted(self, name: str, fn: Callable, **kwargs) -> Callable:
        if name not in self._compiled:
            if not self.jit:
                self._compiled[name] = fn
            elif self.stream is not None and self.stream.blocks:
                # The mapper calls' misdealt counts (`core.blocks`) as one more output.
                self._compiled[name] = _Checked(blocks.jit_checked(fn, **kwargs), self._misdealt)
            else:
                self._compiled[name] = jax.jit(fn, **kwargs)
        return self._compiled[name]

    def _state_out(self):
        if self.mesh is None:
            return None
        return self.shardings

    def _replicated(self):
        return None if self.mesh is None else jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())

    # -- what the runner calls -------------------------------------------------------------------

    def init(self, key: jax.Array) -> Params:
        """The algorithm's initial state, created directly in its sharded layout."""
        if not self.jit:
            return self._store(self.algo.init(key, self.data))
        if self.host is not None:
            return self._host_init(key)
        if not self.traceable_init:
            return self._eager_init(key)
        fn = self._jitted("init", lambda k, d: self._store(self.algo.init(k, d)),
                          out_shardings=self._state_out())
        return fn(key, self.data)

    def run_rounds(self, state: Params, round_keys: jax.Array, first: int, count: int):
        """Rounds first … first + count − 1 (0-based). Returns (state, list of per-round metrics
        as host numpy dicts). `count` is normally `rounds_per_call` (a shorter last call
        compiles once more)."""
        if not self.jit:
            try:
                state, m = self._round(state, self.data, round_keys, first)
            except ClientError as e:                      # the debug backend: add the round
                e.round = first + 1
                raise ClientError(e.stage, client=e.client, row=e.row, cause=e.cause,
                                  round=e.round) from e.cause
            return state, [jax.device_get(m)]
        if self.host is not None:
            return self._run_host(state, round_keys, first, count)
        fn = self._round_function(count)
        if self.stream is not None:
            return self._run_streamed(fn, state, round_keys, first, count)
        state, m = fn(state, self.data, round_keys, jnp.asarray(first, jnp.int32))
        return state, _per_round(jax.device_get(m), count)

    def _run_streamed(self, fn, state, round_keys, first: int, count: int):
        staged = self.stream.take(round_keys, first, count)
        state, m = fn(state, staged.data, round_keys, jnp.asarray(first, jnp.int32))
        # Stage the next call's rounds while these train (the last call's prefetch goes unused).
        self.stream.prefetch(round_keys, first + count, count)
        per_round = _per_round(to_host(m), count)
        self._check_dealt(f"rounds {first + 1}-{first + count}")
        self._check_sampled(per_round, staged.ids, first)
        return state, per_round

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

    def _round_function(self, count: int) -> Callable:
        if count == self.rounds_per_call and getattr(self, "_round_compiled", None) is not None:
            return self._round_compiled
        if count == 1:
            body = self._round
        else:
            body = lambda s, d, k, r: self._rounds(s, d, k, r, count)
        return self._jitted(f"rounds{count}", body, donate_argnums=0,
                            out_shardings=(self._state_out(), self._replicated()))

    def evaluate(self, state: Params, ids: np.ndarray | None = None) -> dict:
        """The algorithm's evaluation (every client, or the clients `ids`), on the host."""
        if (ids is None and self.stream is None and self.host is None
                and getattr(self, "_eval_compiled", None) is not None):
            return to_host(self._eval_compiled(state, self.data))
        return self._evaluate_with("evaluate", self.algo.evaluate, state, ids)

    def evaluate_part(self, part: str, state: Params, ids: np.ndarray | None = None) -> dict:
        """One part ("rows" or "rest") of an algorithm's `evaluate_parts`, as `evaluate`."""
        return self._evaluate_with(f"evaluate_{part}", getattr(self.algo.evaluate_parts, part),
                                   state, ids)

    def _evaluate_with(self, name: str, fn: Callable, state: Params, ids: np.ndarray | None) -> dict:
        if self.host is not None:
            return self._evaluate_host(name, fn, state, ids)
        if self.stream is not None:       # groups of clients, their samples moved group by group
            run = self._jitted(f"{name}_ids", lambda s, d, i: fn(s, d, i))
            if name == "evaluate" and getattr(self, "_eval_compiled_group", None) is not None:
                run = self._eval_compiled_group
            out = self.stream.evaluate(lambda d, i: run(state, d, i), ids)
            self._check_dealt("evaluation")
            return out
        if ids is None:
            return to_host(self._jitted(name, lambda s, d: fn(s, d))(state, self.data))
        run = self._jitted(f"{name}_ids", lambda s, d, i: fn(s, d, i))
        return to_host(run(state, self.data, jnp.asarray(ids, jnp.int32)))

    def compile(self, round_keys: jax.Array) -> float:
        """Compiles the round (and evaluation) ahead of time from abstract shapes; returns the
        number of seconds it took. Nothing of the state is allocated."""
        import time

        if not self.jit:
            return 0.0
        t0 = time.perf_counter()
        if self.abstract_state is None:
            raise RuntimeError("this algorithm's init needs concrete data: call init(key) first "
                               "(Program.traceable_init is False)")
        abstract = self.abstract_sharded_state()
        if self.host is not None:
            self._compile_host(round_keys, self.host.split(jax.tree.leaves(abstract))[0])
            return time.perf_counter() - t0
        fn = self._round_function(self.rounds_per_call)
        if self.stream is not None:
            self.stream.participants(round_keys, 0, 1)           # learns M, hence the buffer size
            group = jax.ShapeDtypeStruct((self.stream.eval_group,), jnp.int32)
            self._round_compiled = fn.lower(abstract, self.stream.abstract(self.rounds_per_call),
                                            round_keys, jax.ShapeDtypeStruct((), jnp.int32)).compile()
            ev = self._jitted("evaluate_ids", lambda s, d, i: self.algo.evaluate(s, d, i))
            self._eval_compiled_group = ev.lower(abstract, self.stream.abstract_evaluation(),
                                                 group).compile()
            return time.perf_counter() - t0
        self._round_compiled = fn.lower(abstract, self.data, round_keys,
                                        jax.ShapeDtypeStruct((), jnp.int32)).compile()
        ev = self._jitted("evaluate", lambda s, d: self.algo.evaluate(s, d))
        self._eval_compiled = ev.lower(abstract, self.data).compile()
        return time.perf_counter() - t0

    @property
    def is_compiled(self) -> bool:
        """Whether `compile` has run (a reused program is not compiled again)."""
        return getattr(self, "_round_compiled", None) is not None

    def abstract_sharded_state(self):
        """The state's shapes and dtypes with their shardings (`jax.ShapeDtypeStruct`s): what a
        checkpoint is restored into before any state exists."""
        if self.shardings is None:
            return self.abstract_state
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            self.abstract_state, self.shardings)

    def memory_plan(self) -> MemoryPlan:
        """Bytes per device (call `compile` first for the working sets)."""
        devices = 1 if self.mesh is None else self.mesh.size
        per_client, replicated = client_state_bytes(self.abstract_state, _itemsize)
        working = evaluating = 0
        for attr in ("_round_compiled", "_eval_compiled", "_eval_compiled_group"):
            compiled = getattr(self, attr, None)
            analysis = compiled.memory_analysis() if compiled is not None else None
            if analysis is not None:
                if attr == "_round_compiled":
                    working = int(analysis.temp_size_in_bytes)
                else:
                    evaluating = max(evaluating, int(analysis.temp_size_in_bytes))
        platform = jax.local_devices()[0].platform
        client_per_device = int(per_client) * self.num_clients // devices
        host_row = world = staging = 0
        if self.host is not None:        # on the devices: resident rows (sharded) and the world
            host_row = sum(int(np.prod(a.shape[1:])) * _itemsize(a.dtype)
                           for a in self.host.split(self.host.abstract)[1])
            per_client = int(per_client) - host_row
            world = max(self._world_size(self.rounds_per_call) if self._clients_per_round else 0,
                        self._eval_world_size())
            if self._rows_here is not None:      # `_put_rows`: the whole world to each device first
                staging = world
            if self._dealt_mesh is not None:     # each device holds its own block of the world
                world //= devices
            client_per_device = int(per_client) * self.num_clients // devices + world * host_row
        local = devices if self.mesh is None else sum(
            d.process_index == jax.process_index() for d in self.mesh.devices.flat)
        return MemoryPlan(
            devices=devices, platform=platform, num_clients=self.num_clients,
            state_per_client=int(per_client),
            client_state_per_device=client_per_device,
            replicated_state=int(replicated),
            data=self.stream.bytes_on_device() if self.stream is not None else _nbytes(self.data),
            working_set=working, eval_working_set=evaluating, available=available_memory(platform),
            local_devices=int(local), data_placement=self.data_placement,
            data_whole=self.data_whole_bytes, compiled=self.is_compiled or not self.jit,
            state_placement=self.state_placement, host_row_bytes=host_row, world_rows=world,
            staging_rows=staging)


class CachedEvaluation:
    """`Program.evaluate` that evaluates a client's personalised model again only when a round
    has changed it.

    For an algorithm with `evaluate_parts` (PGFed, Ditto, pFedSOP, Local: a personalised model
    per client that only the rounds sampling the client change), the "rows" entries of a client
    not sampled since its last evaluation are the values kept from then, which a new evaluation
    of the same model on the same test data would repeat; the "rest" entries (the global model)
    are evaluated every time. With 6 of 25 clients sampled a round, PGFed's personal evaluation
    costs 8/25 of a full one. Rows are always evaluated in groups of `group` clients (default:
    the power of two at or above the clients sampled a round; a repeated id pads the last group)
    by one program, so a client's numbers do not depend on when or beside whom it was evaluated:
    a run resumed from a checkpoint, whose cache starts empty, reports the same bits as a run
    that never stopped. Without `evaluate_parts` it is `Program.evaluate`.

        evaluation = CachedEvaluation(program)
        state, per_round = program.run_rounds(state, keys, r, 1)
        evaluation.changed(per_round[0]["sampled"])
        evals = evaluation(state)              # or evaluation(state, ids)
    """

    def __init__(self, program: Program, group: int | None = None):
        self.program = program
        self.parts = program.algo.evaluate_parts
        n = program.num_clients
        if group is None:
            group = default_eval_group(program.algo, program.data)
        if group < 1:
            raise ValueError(f"group must be >= 1, got {group}")
        self.group = min(group, n)
        self.cache: dict | None = None                      # row entries, host arrays [N, ...]
        self.current = np.zeros(n, bool)                    # cache holds client i's value now

    def changed(self, clients) -> None:
        """Clients whose state rows a round changed: the round's metrics' "sampled"."""
        self.current[np.asarray(clients, np.int64).ravel()] = False

    def __call__(self, state: Params, ids: np.ndarray | None = None) -> dict:
        if self.parts is None:
            return self.program.evaluate(state, ids)
        n = self.program.num_clients
        want = np.arange(n) if ids is None else np.asarray(ids, np.int64)
        todo = np.unique(want[~self.current[want]])
        for start in range(0, todo.size, self.group):
            rows = todo[start:start + self.group]
            padded = np.concatenate([rows, np.full(self.group - rows.size, rows[0])])
            fresh = self.program.evaluate_part("rows", state, padded)
            if self.cache is None:
                self.cache = jax.tree.map(lambda a: np.zeros((n,) + a.shape[1:], a.dtype), fresh)
            for cached, new in zip(jax.tree.leaves(self.cache), jax.tree.leaves(fresh), strict=True):
                cached[rows] = new[: rows.size]
        self.current[todo] = True
        kept = {name: jax.tree.map(lambda a: a[want], entry) for name, entry in self.cache.items()}
        return {**kept, **self.program.evaluate_part("rest", state, ids)}



def default_eval_group(algo, data) -> int:
    """Clients evaluated together by one compiled program: the power of two at or above the M
    clients a round samples."""
    m = num_sampled_clients(data.num_real_clients, algo.hparams.get("participation", 1.0))
    return 1 << (m - 1).bit_length()


def _device_data_fits(data, state_bytes: int, mesh: Mesh | None, share: int = 1) -> bool:
    """"auto" placement: the dataset (1/`share` of it: sharded placement) on every device of this
    host plus the client state (`state_bytes`; 0 for an untraceable init, judged by the data
    alone) within 80 % of the available memory, before anything is compiled."""
    devices = 1 if mesh is None else mesh.size
    platform = jax.local_devices()[0].platform
    available = available_memory(platform)
    if available <= 0:
        return True
    sharing = min(devices, jax.local_device_count()) if platform == "cpu" else 1
    return (_nbytes((data.x, data.y)) * sharing / share + state_bytes) <= 0.8 * available


def _choose_state_placement(placement: str, algo, abstract, data, mesh, jit: bool) -> str:
    """"host" or "device" for --state-placement `placement`. "host" needs a vectorised backend,
    a traceable init and an algorithm that declares `host_state` (ValueError naming the reason
    otherwise); "auto" picks "host" only where all of that holds and the client state alone
    would take more than 80 % of the available memory. With several processes each process's
    store holds its own range of clients' rows (`hoststate.row_owners`)."""
    if placement == "device":
        return "device"
    reasons = []
    if not jit:
        reasons.append("a vectorised --backend (not loop)")
    if abstract is None:
        reasons.append("an init that can be traced (this algorithm's init needs concrete data)")
    if not getattr(algo, "host_state", False):
        reasons.append(f"an algorithm whose rounds touch client state only through core.gather / "
                       f"core.scatter at the round's participants ({algo.name} does not declare "
                       "Algorithm.host_state: it reads other clients' rows, updates every client "
                       "each round, or starts clients from different rows)")
    if placement == "host":
        if reasons:
            raise ValueError("--state-placement host needs " + "; and ".join(reasons))
        return "host"
    if reasons:
        return "device"
    platform = jax.local_devices()[0].platform
    available = available_memory(platform)
    return "host" if available > 0 and _nbytes(abstract) > 0.8 * available else "device"


def _on_host(a) -> np.ndarray:
    """`a` as a host array: NumPy (and memory-mapped) arrays as they are, device arrays fetched."""
    return a if isinstance(a, np.ndarray) else np.asarray(jax.device_get(a))


def _zeros_like(abstract):
    """Zeros of an abstract state's shapes (PRNG keys: key 0), built inside a jitted function."""
    def zeros(a):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            return jnp.broadcast_to(jax.random.key(0), a.shape)
        return jnp.zeros(a.shape, a.dtype)

    return jax.tree.map(zeros, abstract)


def prepare_data(data, mesh: Mesh | None):
    """The dataset padded to a multiple of the device count and placed on every device."""
    if mesh is None:
        return data
    return replicate(data.pad_clients(mesh.size), mesh)


def check_memory(plan: MemoryPlan, *, allow: bool = False) -> None:
    """Raises MemoryPlanError (before any state is allocated) when the plan does not fit."""
    if plan.fits() or allow or os.environ.get("FEDJAX_PFL_SKIP_MEMORY_CHECK"):
        return
    limit = plan.max_clients()
    # The working set can grow with N too (PGFed's α rows): then no smaller N is "about" right.
    fit = (f"it would fit with about {limit:,} clients" if limit else
           f"the working set alone ({max(plan.working_set, plan.eval_working_set) / 2**30:.1f} GiB "
           "per device) leaves no room")
    raise MemoryPlanError(
        f"the run needs about {plan.total / 2**30:.1f} GiB but {plan.available / 2**30:.1f} GiB "
        f"is available ({plan.num_clients} clients, {plan.state_per_client / 2**20:.2f} MB of "
        f"state per client); {fit}. Lower --clients, store "
        "client state in half the memory with --state-dtype bfloat16, use more devices, or lower "
        "--chunk-size / --eval-batch-size for a smaller working set")


class _Checked:
    """A jitted (or lowered, or compiled) program of `blocks.checked` form that returns what the
    program itself returns and keeps its misdealt counts in `counts`, for `_check_dealt`."""

    def __init__(self, fn, counts: list):
        self._fn, self._counts = fn, counts

    def __call__(self, *args):
        out, misdealt = self._fn(*args)
        if misdealt is not None:
            self._counts.append(misdealt)
        return out

    def lower(self, *args, **kwargs) -> "_Checked":
        return _Checked(self._fn.lower(*args, **kwargs), self._counts)

    def compile(self, *args, **kwargs) -> "_Checked":
        return _Checked(self._fn.compile(*args, **kwargs), self._counts)

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._fn, name)     # (memory_analysis, as_text, … of the wrapped stage)
