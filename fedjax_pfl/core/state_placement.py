"""Where the clients' state rows wait between rounds: the state placements (`--state-placement`).

Every state placement answers the program's few questions (`StatePlacement`): how the initial
state is made, what a call hands the compiled rounds (`enter`: a carry and a fixed part), how the
algorithm's state is assembled from them inside the trace and taken apart again (`wrap`,
`unwrap`), what the call leaves behind (`leave`), and what a checkpoint holds.

  DeviceState  every per-client leaf an [N, ...] array sharded over the devices' clients axis,
               the rest replicated; the program hands the rounds the state itself
  HostState    the per-client rows in a copy-on-write host store (`core.store`); a call moves
               its participants' rows (its client world, `core.world`) to the devices as
               `core.rows.ClientRows` and writes them back after it

With host placement the state the runner holds is a `StoredState` (the device leaves and the
store). Both placements give the same rounds bit for bit: a `ClientRows` is indexed by client id,
so an algorithm written for [N, ...] leaves and global ids runs unchanged on a world of its
participants (its `Algorithm.host_state` declares it touches rows only through core.gather /
core.scatter, and every client starts from the same rows).

Host state over several processes: each process's store holds only its range of clients' rows
(`store.row_owners`); a call's world rows are gathered by every process from its own store and
assembled on the devices (`transfer.assemble`), each process writes back its own, and a
checkpoint holds one store part per process.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from fedjax_pfl.core import layout, transfer
from fedjax_pfl.core import store as store_lib
from fedjax_pfl.core import world as world_lib
from fedjax_pfl.core.rows import ClientRows
from fedjax_pfl.models import frozen as frozen_lib

Params = Any
STATE_PLACEMENTS = ("device", "host", "auto")


class StatePlacement(Protocol):
    """What a program asks of its state placement."""

    name: str                  # "device" or "host"
    needs_participants: bool   # a call's inputs hold only its participants' rows
    grouped: bool              # evaluation runs in groups of clients (their rows moved each)

    def init(self, init_fn: Callable, key: jax.Array, data, jit: bool = True,
             compiled: Callable | None = None, frozen: dict | None = None) -> Any: ...
    def init_function(self, init_fn: Callable, data) -> Callable: ...
    def enter(self, state: Any, ids: np.ndarray | None, count: int, round_keys: jax.Array,
              first: int) -> tuple[Any, Any]: ...
    def wrap(self, carry: Any, fixed: Any) -> Any: ...
    def unwrap(self, state: Any, fixed: Any) -> Any: ...
    def leave(self, state: Any, carry: Any, fixed: Any) -> Any: ...
    def checkpoint_parts(self, state: Any) -> tuple[Any, dict[str, np.ndarray]]: ...
    def restored(self, tree: Any, host_arrays: dict[str, np.ndarray]) -> Any: ...


class _Placement:
    """What both placements share: the abstract state, its storage dtype and shardings."""

    def __init__(self, abstract: Params | None, num_clients: int, mesh, storage):
        self.num_clients, self.mesh, self.storage = int(num_clients), mesh, storage
        self.abstract: Params | None = None
        self.shardings = None
        # (an init that needs concrete data runs eagerly every time, its shapes learnt once)
        self.traceable = abstract is not None
        if abstract is not None:
            self.set_abstract(abstract)

    def set_abstract(self, abstract: Params) -> None:
        """The state's shapes (storage dtypes): from `jax.eval_shape` of the init, or from an
        init that needed concrete data and ran eagerly."""
        layout.client_mask(abstract, self.num_clients)   # the declaration must match the shapes
        self.abstract = self.store(abstract)
        if self.mesh is not None:
            self.shardings = layout.client_shardings(self.abstract, self.mesh, self.num_clients)

    def store(self, state: Params) -> Params:
        """Declared per-client float leaves in the storage dtype (`--state-dtype`)."""
        if self.storage is None:
            return state
        return layout.cast_client_leaves(state, self.storage, self.num_clients)

    def abstract_sharded(self) -> Params:
        """The state's shapes and dtypes with their shardings: what a checkpoint is restored
        into before any state exists."""
        if self.shardings is None:
            return self.abstract
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            self.abstract, self.shardings)

    def replicated(self):
        return None if self.mesh is None else transfer.replicated_sharding(self.mesh)

    def splitter(self) -> "HostClients":
        return HostClients(self.abstract, layout.client_mask(self.abstract))

    def checkpoint_like(self, host_arrays: dict[str, np.ndarray], like=None):
        """What to restore a checkpoint's tree into: the device leaves of a checkpoint written
        under host state placement (it holds a store), else the whole state (`like`, or the
        abstract sharded state)."""
        full = self.abstract_sharded() if like is None or isinstance(like, StoredState) else like
        if store_lib.saved_prefixes(host_arrays):
            return self.splitter().split(jax.tree.leaves(full))[0]
        return full


class DeviceState(_Placement):
    """Device state placement: the state pytree itself, its per-client leaves sharded over the
    mesh's clients axis (N padded to the device count)."""

    name = "device"
    needs_participants = False
    grouped = False

    def init(self, init_fn: Callable, key: jax.Array, data, jit: bool = True,
             compiled: Callable | None = None, frozen: dict | None = None):
        """The initial state; `compiled`: `init_function`'s program compiled ahead (`Program`);
        `frozen`: the model's frozen parameters, bound while it traces (`models.frozen`)."""
        if not jit:
            return self.store(init_fn(key, data))
        if not self.traceable:
            return self._eager_init(init_fn, key, data)
        return (compiled or self.init_function(init_fn, data))(key, data, frozen or {})

    def init_function(self, init_fn: Callable, data) -> Callable:
        """The jitted (key, data, frozen bindings) -> initial state, placed in its shardings."""
        def init_state(k, d, fz=None):
            with frozen_lib.binding(fz or {}):
                return self.store(init_fn(k, d))

        return jax.jit(init_state, out_shardings=self.shardings)

    def _eager_init(self, init_fn: Callable, key: jax.Array, data):
        """Runs an untraceable init once (on the host: FedPC builds its kNN graph there) and
        learns the state's shapes from it."""
        state = init_fn(key, data)
        if self.abstract is None:
            self.set_abstract(jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state))
        state = self.store(state)
        if self.shardings is not None:
            # (every process ran the same init on the same data: each places its own shards)
            state = transfer.put_agreed(state, self.shardings, "the algorithm's initial state")
        return state

    def enter(self, state, ids, count: int, round_keys=None, first: int = 0):
        return state, ()

    def enter_evaluation(self, state, ids):
        return state, ()

    def wrap(self, carry, fixed):
        return carry

    def unwrap(self, state, fixed):
        return state

    def leave(self, state, carry, fixed):
        return carry

    def carry_shardings(self, count: int = 1):
        return self.shardings

    def abstract_inputs(self, count: int):
        return self.abstract_sharded(), ()

    def abstract_eval_inputs(self, group: int):
        return self.abstract_sharded(), ()

    def checkpoint_parts(self, state):
        return state, {}

    def restored(self, tree, host_arrays: dict[str, np.ndarray]):
        """The state from a checkpoint's parts: as saved, or, written with the client rows on
        the host, with them placed on the devices: each process reads from the checkpoint, and
        places, only the rows its own devices hold (`transfer.put_rows_from`)."""
        if not store_lib.saved_prefixes(host_arrays):
            return tree
        splitter = self.splitter()
        like = store_lib.ClientStore(_zero_rows(splitter), self.num_clients)
        dev = list(tree)
        abstract = splitter.split(jax.tree.leaves(self.abstract_sharded()))[1]
        if self.shardings is None:
            store = store_lib.ClientStore.from_arrays(host_arrays, like)
            host = transfer.put_whole(store.gather(np.arange(self.num_clients)), None)
            return splitter.treedef.unflatten(splitter.join(dev, host))
        held = np.zeros(self.num_clients, bool)
        for a in abstract:
            held |= transfer.rows_held(a.shape, a.sharding)
        store = store_lib.ClientStore.from_arrays(host_arrays, like, keep=held)
        # (one leaf at a time: a host copy of one leaf's rows beside the store, not of all)
        host = [transfer.put_rows_from(a.shape, a.dtype, a.sharding,
                                  lambda ids, j=j: store.gather(ids, leaves=[j])[0])
                for j, a in enumerate(abstract)]
        return splitter.treedef.unflatten(splitter.join(dev, host))

    def sizes(self) -> dict[str, int]:
        return {}


class StoredState:
    """A run's state under host placement: the leaves that live on the devices (`device`, in
    the state's flattened order, the host leaves left out) and the host rows (`store`). It is
    what `Program.init` / `run_rounds` hand the runner in place of the state pytree."""

    def __init__(self, device: list, store: store_lib.ClientStore):
        self.device, self.store = device, store

    def __repr__(self) -> str:
        return (f"StoredState({len(self.device)} device leaves, {len(self.store.initial)} host "
                f"leaves, {self.store.touched} clients written)")


class HostState(_Placement):
    """Host state placement (module docstring). `per_round`: M, the clients a round samples
    (the world's size follows from it); `prefetch`: gather the next call's rows from the store
    in the background while a call runs (on accelerators: on CPU the gather competes with the
    round for the same cores).

    `blocks` B > 1 (`Algorithm.client_blocks`: a sweep's runs, `fedjax_pfl.sweep`): the clients
    are B equal blocks that share nothing. Each block starts from its own initial rows, and a
    call's world is B blocks of rows (`core.world`, one per client block, each its block's
    participants: M/B of each round, in the order of the call's participants), split over the
    devices, each holding whole blocks (B a multiple of the devices)."""

    name = "host"
    needs_participants = True
    grouped = True

    def __init__(self, abstract: Params, num_clients: int, mesh, storage, *, per_round: int,
                 rounds_per_call: int, eval_group: int, participants: Callable,
                 prefetch: bool, where: str = "the algorithm", blocks: int = 1):
        super().__init__(abstract, num_clients, mesh, storage)
        self.blocks = int(blocks)
        if self.blocks > 1 and (self.num_clients % self.blocks or per_round % self.blocks
                                or self.blocks % self.devices):
            raise ValueError(f"{where}: {self.blocks} client blocks need N ({self.num_clients}) "
                             f"and M ({per_round}) multiples of them, and a multiple of the "
                             f"{self.devices} devices")
        self.host = self.splitter()
        self.per_round, self.rounds_per_call = int(per_round), int(rounds_per_call)
        self.eval_group = int(eval_group)
        self.participants = participants
        self.where = where
        self.prefetch_rows = bool(prefetch)
        self._rows_pool = None
        self._rows_pending = None
        self._rows_written = np.zeros(0, np.int64)
        self.rows_hits = self.rows_misses = 0
        # Several processes: each store holds its range of clients' rows (`row_ownership`).
        self._rows_here: np.ndarray | None = None
        if jax.process_count() > 1:
            self._rows_here, self._row_device = self._row_ownership()

    # -- the client world ---------------------------------------------------------------------

    @property
    def devices(self) -> int:
        return 1 if self.mesh is None else self.mesh.size

    @property
    def dealt_mesh(self):
        """The mesh a client world is dealt to (`core.world`: each device holds the rows of the
        clients it trains), or None: one device, whose world is whole."""
        return self.mesh if self.devices > 1 else None

    def world_size(self, count: int) -> int:
        """Entries of a call's world: count rounds' blocks of ⌈M/D⌉ on each device (or count·M
        on one), at most N; with client blocks, count·M/B entries of each block, at most N/B."""
        if self.blocks > 1:
            b = self.blocks
            return b * min(count * self.per_round // b, self.num_clients // b)
        d = self.devices
        if d > 1:
            return d * min(count * -(-self.per_round // d), self.num_clients)
        return min(count * self.per_round, self.num_clients)

    def eval_world_size(self) -> int:
        """An evaluation group's world: G entries, or ⌈G/D⌉ on each of D devices."""
        d = self.devices
        return self.eval_group if d == 1 else d * -(-self.eval_group // d)

    def world(self, ids: np.ndarray, size: int, distinct: bool = True) -> np.ndarray:
        """The client world of a call's participants ([rounds, M]; one block per client block,
        else per device) or of an evaluation group ([G]; `distinct=False`: nothing is written, a
        client may sit on several devices)."""
        d = self.blocks if distinct and self.blocks > 1 else self.devices
        return world_lib.world(ids, d, size // d, self.num_clients, distinct=distinct)

    def world_sharding(self):
        if self.dealt_mesh is None:
            return self.replicated()
        return NamedSharding(self.mesh, PartitionSpec(layout.AXIS))

    def _row_ownership(self) -> tuple[np.ndarray, np.ndarray]:
        """Several processes: ([N] whether this process's store holds each client's rows,
        [N + 1] int32 the mesh position of a device of the process that holds them; the padding
        id N reads device 0, whose process holds its initial row like every other)."""
        owners = store_lib.row_owners(self.num_clients, jax.process_count())
        first: dict[int, int] = {}
        for d, device in enumerate(self.mesh.devices.flat):
            first.setdefault(device.process_index, d)
        device = np.asarray([first[p] for p in range(jax.process_count())], np.int32)[owners]
        return owners == jax.process_index(), np.append(device, np.int32(0))

    def put_rows(self, rows: list[np.ndarray], world: np.ndarray) -> list:
        """A world's host rows on the devices: each device its block where the world is dealt
        (`core.world`), else whole on the one device. With several processes each process's
        store holds only its clients' rows (the others read as the initial row there): every
        device receives its process's rows (`transfer.put_blocks`), and one jitted gather takes
        each client's row from a device of the process that holds it, so the rows are copied,
        never combined arithmetically."""
        if self._rows_here is None:
            if self.dealt_mesh is None:
                return transfer.put_whole(rows, self.mesh)
            return transfer.put_sharded(rows, self.world_sharding())
        source = self._row_device[np.asarray(world)]
        sharding = NamedSharding(self.mesh, PartitionSpec(layout.AXIS))
        parts = [transfer.put_blocks((self.devices,) + r.shape, sharding,
                                     lambda d, r=r: r[None], 1) for r in rows]
        return transfer.assemble(parts, transfer.put_whole(source, self.mesh),
                                 self.world_sharding())

    # -- the program's calls --------------------------------------------------------------------

    def _probed_clients(self, data) -> tuple[int, np.ndarray]:
        """(blocks, the clients whose initial rows `init` compares): each block's first, second
        and last real client (the dataset's padding clients follow the last block's real ones)."""
        b, per_block = self.blocks, self.num_clients // self.blocks
        real = data.num_real_clients - (b - 1) * per_block
        return b, np.asarray([k * per_block + i for k in range(b)
                              for i in sorted({0, min(1, real - 1), real - 1})], np.int32)

    def init_function(self, init_fn: Callable, data) -> Callable:
        """The jitted (key, data, frozen bindings) -> (device leaves, the probed clients' host
        rows)."""
        probe = jnp.asarray(self._probed_clients(data)[1])

        def init_state(k, d, fz=None):
            with frozen_lib.binding(fz or {}):
                dev, host = self.host.split(jax.tree.leaves(self.store(init_fn(k, d))))
            return dev, [h[probe] for h in host]

        kwargs = {}
        if self.mesh is not None:
            kwargs["out_shardings"] = (self.device_shardings(), self.replicated())
        return jax.jit(init_state, **kwargs)

    def init(self, init_fn: Callable, key: jax.Array, data, jit: bool = True,
             compiled: Callable | None = None, frozen: dict | None = None) -> StoredState:
        """The device leaves of the initial state, and a store whose initial rows are every
        client's (checked on the first, second and last real client: they must be equal).
        `compiled`: `init_function`'s program compiled ahead (`Program`)."""
        b = self._probed_clients(data)[0]
        dev, samples = (compiled or self.init_function(init_fn, data))(key, data, frozen or {})
        initial = []
        for path, rows in zip(self.host.host_paths, transfer.to_host(samples)):
            rows = np.asarray(rows).reshape((b, -1) + np.shape(rows)[1:])
            if not all(_same_bits(block[0], r) for block in rows for r in block[1:]):
                raise ValueError(
                    f"{self.where}'s init gives clients different initial rows of {path}: "
                    "--state-placement host keeps one initial row shared by every client "
                    "(use --state-placement device)")
            initial.append(rows[:, 0] if b > 1 else rows[0, 0])
        return StoredState(list(dev), store_lib.ClientStore(initial, self.num_clients, blocks=b))

    def device_shardings(self):
        if self.shardings is None:
            return None
        return self.host.split(jax.tree.leaves(self.shardings))[0]

    def enter(self, state: StoredState, ids: np.ndarray, count: int, round_keys=None,
              first: int = 0):
        """(carry, fixed) of a call whose participants are `ids` [count, M]: carry the device
        leaves and the world's rows on the devices, fixed the world's ids."""
        world = self.world(ids, self.world_size(count))
        rows = self.put_rows(self._take_rows(state.store, round_keys, first, count, world), world)
        return (state.device, rows), jnp.asarray(world)

    def enter_evaluation(self, state: StoredState, ids):
        world = self.world(np.asarray(ids), self.eval_world_size(), distinct=False)
        rows = self.put_rows(state.store.gather(world), world)
        return (state.device, rows), jnp.asarray(world)

    def wrap(self, carry, fixed):
        dev, rows = carry
        return self.host.wrap(dev, rows, fixed, self.dealt_mesh)

    def unwrap(self, state, fixed):
        return self.host.unwrap(state, fixed, f"{self.where}'s round_fn")

    def leave(self, state: StoredState, carry, fixed) -> StoredState:
        """The call's written rows back into the store (each process its own clients')."""
        dev, rows = carry
        world = np.asarray(fixed)
        real = world < self.num_clients
        if self._rows_here is not None:           # this process keeps its own clients' rows
            real &= self._rows_here[np.minimum(world, self.num_clients - 1)]
        new_rows = [np.asarray(r)[real] for r in transfer.to_host(rows)]
        if self._rows_pending is not None:         # the store is read there: wait before writing
            concurrent.futures.wait([self._rows_pending])
        state.store.put(world[real], new_rows)
        self._rows_written = world[real]
        return StoredState(list(dev), state.store)

    def store(self, state: Params) -> Params:
        """Resident per-client float leaves in the storage dtype; the world's rows are stored
        as they were (`ClientRows.put` casts what a round writes)."""
        if self.storage is None:
            return state
        leaves, treedef = jax.tree.flatten(state, is_leaf=lambda x: isinstance(x, ClientRows))
        client = jax.tree.leaves(layout.client_mask(state))
        out = [layout.cast_leaf(x, self.storage) if c and not isinstance(x, ClientRows) else x
               for x, c in zip(leaves, client, strict=True)]
        return treedef.unflatten(out)

    def carry_shardings(self, count: int = 1):
        if self.mesh is None:
            return None
        return (self.device_shardings(), self.world_sharding())

    def abstract_inputs(self, count: int):
        size = self.world_size(count)
        world = jax.ShapeDtypeStruct((size,), jnp.int32, sharding=self.replicated())
        return (self.host.split(jax.tree.leaves(self.abstract_sharded()))[0],
                self._rows_abstract(size)), world

    def abstract_eval_inputs(self, group: int):
        size = self.eval_world_size()
        world = jax.ShapeDtypeStruct((size,), jnp.int32, sharding=self.replicated())
        return (self.host.split(jax.tree.leaves(self.abstract_sharded()))[0],
                self._rows_abstract(size)), world

    def _rows_abstract(self, size: int) -> list:
        return [jax.ShapeDtypeStruct((size,) + tuple(a.shape[1:]), a.dtype,
                                     sharding=self.world_sharding())
                for a in self.host.split(self.host.abstract)[1]]

    # -- the next call's rows in the background --------------------------------------------------

    def prefetch(self, state: StoredState, round_keys: jax.Array, first: int, count: int) -> None:
        if not self.prefetch_rows:
            return
        if self._rows_pool is None:
            self._rows_pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="fedjax_pfl_rows")
        self._rows_pending = self._rows_pool.submit(self._gather_rows, state.store, round_keys,
                                                    first, count)

    def _gather_rows(self, store, round_keys: jax.Array, first: int, count: int):
        """(tag, store, world, rows) of a call, gathered from the store (the prefetch's work)."""
        world = self.world(self.participants(round_keys, first, count), self.world_size(count))
        return (_key_bytes(round_keys), first, count), store, world, store.gather(world)

    def _take_rows(self, store, round_keys, first: int, count: int,
                   world: np.ndarray) -> list[np.ndarray]:
        """The world's rows: the prefetched ones when they were gathered for exactly this call
        (keys, rounds, world and store), with the rows the previous call wrote since read again;
        otherwise gathered now."""
        pending, self._rows_pending = self._rows_pending, None
        if pending is not None:
            tag, from_store, got, rows = pending.result()
            if (round_keys is not None and tag == (_key_bytes(round_keys), first, count)
                    and from_store is store and np.array_equal(got, world)):
                stale = np.isin(world, self._rows_written)
                if stale.any():
                    for r, fresh in zip(rows, store.gather(world[stale]), strict=True):
                        r[stale] = fresh
                self.rows_hits += 1
                return rows
        self.rows_misses += 1
        return store.gather(world)

    # -- checkpoints ----------------------------------------------------------------------------

    def checkpoint_parts(self, state: StoredState):
        """(the tree a checkpoint saves with orbax: the device leaves, the store's arrays, each
        process its own part)."""
        return state.device, state.store.to_arrays(
            store_lib.store_prefix(jax.process_index(), jax.process_count()))

    def restored(self, tree, host_arrays: dict[str, np.ndarray]) -> StoredState:
        """The state from a checkpoint's parts in this placement, whichever wrote it (the rows
        are the same): a store part of each process (each process reads the parts that hold its
        rows), or the whole state written with the rows on the devices, of which each process
        keeps the rows its store holds (`store.row_owners`), copied from its own devices'
        shards where they are there (`transfer.owned_rows`)."""
        if store_lib.saved_prefixes(host_arrays):
            like = store_lib.ClientStore(_zero_rows(self.host, self.blocks), self.num_clients,
                                         blocks=self.blocks)
            return StoredState(list(tree), store_lib.ClientStore.from_arrays(
                host_arrays, like, keep=self._rows_here))
        if self.blocks > 1:
            raise ValueError("a checkpoint of a whole state is restored into host state of one "
                             "client block only")
        dev, host = self.host.split(jax.tree.leaves(tree))
        n = self.num_clients
        owners, me = store_lib.row_owners(n, jax.process_count()), jax.process_index()
        rows = [transfer.owned_rows(a, owners, me) if isinstance(a, jax.Array)
                else np.asarray(a)[owners == me] for a in host]
        mine = np.flatnonzero(owners == me)
        store = store_lib.ClientStore([r[0] for r in rows], n)
        store.put(mine, rows)
        return StoredState(list(dev), store)

    def sizes(self) -> dict[str, int]:
        """One client's host row, the world's rows on each device, and the rows each device
        receives before a multi-process world is assembled (for the memory plan)."""
        host_row = sum(int(np.prod(a.shape[1:])) * int(a.dtype.itemsize)
                       for a in self.host.split(self.host.abstract)[1])
        world = max(self.world_size(self.rounds_per_call), self.eval_world_size())
        staging = world if self._rows_here is not None else 0
        if self.dealt_mesh is not None:     # each device holds its own block of the world
            world //= self.devices
        return {"host_row": host_row, "world": world, "staging": staging}

    def close(self) -> None:
        if self._rows_pool is not None:
            self._rows_pool.shutdown(wait=False)


class HostClients:
    """How a state pytree splits between the devices and the host store, and how a round's
    state is assembled from the two inside a trace (`wrap`) and taken apart again (`unwrap`).

    Args:
      abstract: the state's abstract pytree (storage dtypes).
      client_mask: `placement.client_mask` of it.
    """

    def __init__(self, abstract: Params, client_mask: Params):
        with_paths, self.treedef = jax.tree_util.tree_flatten_with_path(abstract)
        self.paths = [jax.tree_util.keystr(p) for p, _ in with_paths]
        self.abstract = [a for _, a in with_paths]
        self.on_host = [bool(b) for b in jax.tree.leaves(layout.host_mask(abstract, client_mask))]
        self.is_client = [bool(b) for b in jax.tree.leaves(client_mask)]
        if len(self.on_host) != len(self.abstract):
            raise AssertionError("client mask and state disagree")

    @property
    def host_paths(self) -> list[str]:
        return [p for p, h in zip(self.paths, self.on_host) if h]

    def split(self, leaves: list) -> tuple[list, list]:
        dev = [a for a, h in zip(leaves, self.on_host) if not h]
        host = [a for a, h in zip(leaves, self.on_host) if h]
        return dev, host

    def join(self, dev: list, host: list) -> list:
        dev, host = iter(dev), iter(host)
        return [next(host) if h else next(dev) for h in self.on_host]

    def wrap(self, dev: list, rows: list, ids: jax.Array, mesh: Any = None) -> Params:
        """The round's state: host leaves as `ClientRows(ids, rows, mesh)` (a `mesh`: the world
        dealt to its devices, `core.world`)."""
        return self.treedef.unflatten(self.join(dev, [ClientRows(ids, r, mesh) for r in rows]))

    def unwrap(self, state: Params, ids: jax.Array, where: str) -> tuple[list, list]:
        """(device leaves, host rows) of a state returned by the algorithm; its host leaves must
        still be `ClientRows` of the same world (written through `core.scatter` only)."""
        leaves, treedef = jax.tree.flatten(state)
        if treedef != self.treedef:
            raise TypeError(f"{where} returned a state whose structure differs from its input's "
                            "under --state-placement host")
        dev, host = self.split(leaves)
        rows = []
        for path, leaf in zip(self.host_paths, host):
            if not isinstance(leaf, ClientRows) or leaf.ids is not ids:
                raise TypeError(
                    f"{where} replaced the per-client leaf {path} instead of writing its rows "
                    "with core.scatter: with --state-placement host an algorithm reads and writes "
                    "client state only through core.gather / core.scatter (Algorithm.host_state)")
            rows.append(leaf.rows)
        return dev, rows


def _zero_rows(splitter: "HostClients", blocks: int = 1) -> list[np.ndarray]:
    lead = (blocks,) if blocks > 1 else ()
    return [np.zeros(lead + a.shape[1:], a.dtype) for a in splitter.split(splitter.abstract)[1]]


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.shape == b.shape and a.tobytes() == b.tobytes()


def _key_bytes(keys: jax.Array) -> bytes:
    return np.asarray(jax.random.key_data(keys)).tobytes()
