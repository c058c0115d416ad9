"""Where client rows live: the device mesh, shardings of client state, and load balance.

Per-client state is what an algorithm's state DECLARES as such: a NamedTuple state class lists
its per-client fields in a class attribute,

    class State(NamedTuple):
        params: Params        # global model                   leaves [...]
        personal: Params      # one model per client           leaves [N, ...]
        CLIENT_FIELDS = ("personal",)

and every leaf under a declared field has leading axis N (all clients). Nothing is inferred
from shapes: a global [10] output bias in a run of N = 10 clients stays a global leaf
(replicated, never cast to the storage dtype). Undeclared states have no per-client leaves.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

Params = Any

# Set by `single_device_clients()`: algorithms built within keep their clients on one device.
_SINGLE_DEVICE = contextvars.ContextVar("fedjax_pfl_single_device_clients", default=False)


def client_mesh() -> Mesh | None:
    """A 1-D mesh ("clients") over all devices (of every process), or None with a single one."""
    devices = jax.devices()
    return Mesh(np.array(devices), ("clients",)) if len(devices) > 1 else None


@contextlib.contextmanager
def single_device_clients():
    """Within this block `execution.client_mapper` keeps each computation's clients on one
    device (no mesh): a sweep that already splits whole runs across devices builds its
    algorithms here. Scoped to the current thread / context (a `contextvars.ContextVar`)."""
    token = _SINGLE_DEVICE.set(True)
    try:
        yield
    finally:
        _SINGLE_DEVICE.reset(token)


def single_device_requested() -> bool:
    return _SINGLE_DEVICE.get()


def replicated_sharding(mesh: Mesh) -> NamedSharding:
    """The sharding of a value held whole on every device of `mesh`."""
    return NamedSharding(mesh, jax.sharding.PartitionSpec())


def replicate(tree: Params, mesh: Mesh | None) -> Params:
    """Places `tree` on every device of `mesh` once (a no-op without a mesh), so jitted rounds do
    not copy the dataset between devices on every call. With several processes, see
    `put_agreed`: `jax.device_put` would check that the processes agree by all-gathering every
    value to every process: for a 1.1 GB dataset over two processes, 9 s and 3.4 GB more memory
    in each."""
    if mesh is None:
        return tree
    sharding = replicated_sharding(mesh)
    return put_agreed(tree, jax.tree.map(lambda _: sharding, tree),
                      "the dataset: the same files and flags on every host?")


def put_agreed(tree: Params, shardings: Params, what: str = "") -> Params:
    """Host values that every process computed alike (NumPy arrays, or JAX arrays this process
    holds whole), placed under `shardings` (a tree of shardings matching `tree`). With several processes each process provides its own devices'
    shards from its own values, after the processes compare a fingerprint of them
    (`fingerprint`, one all-gather of 32 bytes): processes holding other values stop, naming
    them (`what`), instead of computing on different values."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)
    from jax.experimental import multihost_utils

    host = _host_values(tree)
    mine = np.frombuffer(fingerprint(host), np.uint8)
    every = np.asarray(multihost_utils.process_allgather(mine)).reshape(jax.process_count(), -1)
    differ = [k for k in range(len(every)) if not np.array_equal(every[k], every[0])]
    if differ:
        raise ValueError(f"processes {differ} hold other values than process 0 for what every "
                         f"device must hold the same of{' (' + what + ')' if what else ''}")
    return _provide(tree, host, shardings)


def _is_key(a) -> bool:
    return jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)


def _host_values(tree: Params) -> Params:
    """`tree` as NumPy arrays (PRNG keys as their key data)."""
    return jax.tree.map(lambda a: np.asarray(jax.random.key_data(a) if _is_key(a) else a), tree)


def _provide(tree: Params, host: Params, shardings: Params) -> Params:
    """`tree` under `shardings`, this process providing its own devices' shards from `host`
    (`_host_values(tree)`): no value crosses between processes."""
    def put(a, h, sharding):
        placed = jax.make_array_from_callback(h.shape, sharding, lambda index: h[index])
        return jax.random.wrap_key_data(placed, impl=jax.random.key_impl(a)) if _is_key(a) else placed

    return jax.tree.map(put, tree, host, shardings)


FINGERPRINT_ROWS = 4096


def fingerprint(tree: Params) -> bytes:
    """SHA-256 of `tree`'s structure, shapes and dtypes and of up to `FINGERPRINT_ROWS` evenly
    spaced rows of each leaf (the first and last among them): equal trees give equal
    fingerprints; trees that differ anywhere in those rows, in a shape or in a dtype, different
    ones."""
    digest = hashlib.sha256(str(jax.tree.structure(tree)).encode())
    for a in jax.tree.leaves(tree):
        shape = tuple(np.shape(a))
        digest.update(repr((shape, str(a.dtype))).encode())
        if shape and shape[0]:
            rows = np.unique(np.linspace(0, shape[0] - 1, min(shape[0], FINGERPRINT_ROWS))
                             .astype(np.int64))
            digest.update(np.ascontiguousarray(np.asarray(a[rows])).tobytes())
        elif not shape:
            digest.update(np.asarray(a).tobytes())
    return digest.digest()


def put_replicated(tree: Params, mesh: Mesh | None) -> Params:
    """Host arrays placed whole on every device of `mesh` (the default device without one). With
    several processes, each provides its own devices' copies from the same host values."""
    if mesh is None:
        return jax.device_put(tree)
    sharding = replicated_sharding(mesh)
    if jax.process_count() == 1:
        return jax.device_put(tree, sharding)
    return _provide(tree, _host_values(tree), jax.tree.map(lambda _: sharding, tree))


def to_host(tree: Params) -> Params:
    """`tree` as host NumPy arrays in every process. `jax.device_get` reads only arrays whose
    shards this process holds; in a multi-process run an array sharded over the clients (or a
    sweep's runs) spans other processes' devices, so it is all-gathered first."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    def one(a):
        if isinstance(a, jax.Array) and not a.is_fully_addressable and not a.is_fully_replicated:
            return np.asarray(multihost_utils.process_allgather(a, tiled=True))
        return np.asarray(a)

    return jax.tree.map(one, tree)


def rows_held(shape: tuple, sharding: jax.sharding.Sharding, process: int | None = None,
              process_of=None) -> np.ndarray:
    """[shape[0]] bool: the rows of an array of `shape` under `sharding` that the devices of
    `process` (this one by default) hold."""
    me = jax.process_index() if process is None else process
    process_of = process_of or (lambda device: device.process_index)
    held = np.zeros(shape[0], bool)
    rows = np.arange(shape[0])
    for device, index in sharding.devices_indices_map(tuple(shape)).items():
        if process_of(device) == me:
            held[rows[index[0]]] = True
    return held


def put_rows_from(shape: tuple, dtype, sharding: jax.sharding.Sharding,
                  rows: Callable[[np.ndarray], np.ndarray]) -> jax.Array:
    """A [N, ...] array under `sharding` built shard by shard from host rows: `rows(ids)` is
    called only for the rows this process's devices hold (once per distinct shard), so no process
    ever holds all N rows on the host."""
    made: dict[tuple, np.ndarray] = {}
    ids = np.arange(shape[0])

    def shard(index):
        first = index[0]
        key = (first.start, first.stop, first.step)
        if key not in made:
            made[key] = np.asarray(rows(ids[first]), dtype)
        return made[key][(slice(None),) + tuple(index[1:])]

    return jax.make_array_from_callback(tuple(shape), sharding, shard)


def rows_to_exchange(shape: tuple, sharding: jax.sharding.Sharding, owners: np.ndarray,
                     process_of=None) -> np.ndarray:
    """The rows (ids, ascending) that some process owns (`owners`: [N] process of each row) but
    whose devices do not hold under `sharding`: what `owned_rows` gathers by a collective."""
    owners = np.asarray(owners)
    lacking = np.zeros(shape[0], bool)
    for q in np.unique(owners):
        lacking |= (owners == q) & ~rows_held(shape, sharding, int(q), process_of)
    return np.flatnonzero(lacking)


def owned_rows(a: jax.Array, owners: np.ndarray, process: int | None = None,
               process_of=None) -> np.ndarray:
    """a[owners == process] as a host NumPy array, for a [N, ...] array sharded over the
    processes' devices: the rows this process's devices hold are copied from its shards; the
    rows that some process owns but its devices do not hold (`rows_to_exchange`: none where the
    devices' row ranges follow the owners', as with `hoststate.row_owners` and one contiguous
    range of devices per process) are gathered to every process by one collective (every process
    must call this with the same `a` and `owners`). Unlike `to_host`, which all-gathers every
    row, a process then receives only those rows beyond its own. Assumes a's rows are split
    over the devices along axis 0 only (the client state's layout).

    `process_of(device)` is the process a device belongs to (`device.process_index`; tests of one
    process pretend otherwise)."""
    me = jax.process_index() if process is None else process
    process_of = process_of or (lambda device: device.process_index)
    owners = np.asarray(owners)
    n = a.shape[0]
    wanted = np.flatnonzero(owners == me)
    position = np.full(n, -1, np.int64)
    position[wanted] = np.arange(wanted.size)
    out = np.empty((wanted.size,) + a.shape[1:], a.dtype)
    ids = np.arange(n)
    for device, index in a.sharding.devices_indices_map(a.shape).items():
        if process_of(device) != me:
            continue
        rows = ids[index[0]]
        take = position[rows] >= 0
        if take.any():
            data = np.asarray(next(s.data for s in a.addressable_shards if s.device == device))
            out[(position[rows[take]],) + tuple(index[1:])] = data[take]
    missing = rows_to_exchange(a.shape, a.sharding, owners, process_of)
    if missing.size:
        spec = jax.sharding.PartitionSpec()
        replicated = (NamedSharding(a.sharding.mesh, spec) if isinstance(a.sharding, NamedSharding)
                      else jax.sharding.SingleDeviceSharding(next(iter(a.sharding.device_set))))
        got = np.asarray(jax.jit(lambda x: x[missing], out_shardings=replicated)(a))
        mine = position[missing] >= 0
        out[position[missing[mine]]] = got[mine]
    return out


def _is_state_class(node: Any) -> bool:
    return isinstance(node, tuple) and hasattr(type(node), "_fields")


def client_mask(tree: Params, num_clients: int | None = None) -> Params:
    """A pytree of bools shaped like `tree`'s leaves: True for the leaves under a field that a
    NamedTuple node of `tree` declares in its `CLIENT_FIELDS` (at any depth).

    With `num_clients`, every declared leaf must have leading axis `num_clients`; a ValueError
    names the field otherwise (an algorithm's declaration and its state disagree). Works on
    abstract trees (jax.ShapeDtypeStruct leaves).
    """
    def mark(node, field_path: str, declared: bool):
        if declared:
            if num_clients is not None:
                for leaf in jax.tree.leaves(node):
                    shape = getattr(leaf, "shape", ())
                    if len(shape) < 1 or shape[0] != num_clients:
                        raise ValueError(f"state field {field_path} is declared per-client "
                                         f"(CLIENT_FIELDS) but has a leaf of shape {tuple(shape)}, "
                                         f"not [{num_clients}, ...]")
            return jax.tree.map(lambda _: True, node)
        if _is_state_class(node):
            fields = getattr(type(node), "CLIENT_FIELDS", ())
            unknown = set(fields) - set(node._fields)
            if unknown:
                raise ValueError(f"{type(node).__name__}.CLIENT_FIELDS names {sorted(unknown)}, "
                                 f"which are not among its fields {list(node._fields)}")
            return type(node)(*(mark(v, f"{type(node).__name__}.{name}", name in fields)
                                for name, v in zip(node._fields, node)))
        if isinstance(node, (list, tuple)):
            return type(node)(mark(v, f"{field_path}[{i}]", False) for i, v in enumerate(node))
        if isinstance(node, dict):
            return type(node)((k, mark(v, f"{field_path}[{k!r}]", False)) for k, v in node.items())
        return jax.tree.map(lambda _: False, node)

    return mark(tree, "state", False)


def client_shardings(tree: Params, mesh: Mesh, num_clients: int | None = None) -> Params:
    """Shardings for a state pytree: declared per-client leaves (`client_mask`) split along the
    client axis over the mesh, every other leaf replicated. N must be a multiple of the device
    count (`FederatedData.pad_clients`). Works on abstract trees (eval_shape)."""
    rows = NamedSharding(mesh, jax.sharding.PartitionSpec("clients"))
    whole = replicated_sharding(mesh)
    return jax.tree.map(lambda _, is_client: rows if is_client else whole,
                        tree, client_mask(tree, num_clients))


def cast_client_leaves(tree: Params, dtype, num_clients: int | None = None) -> Params:
    """Declared per-client float leaves stored as `dtype` (e.g. bfloat16 for --state-dtype);
    other leaves unchanged. `clients.gather` returns such rows as float32 again."""
    def cast(x, is_client):
        if not (is_client and jnp.issubdtype(x.dtype, jnp.floating)):
            return x
        if isinstance(x, jax.ShapeDtypeStruct):                 # abstract shapes (memory plans)
            return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
        return x.astype(dtype)

    return jax.tree.map(cast, tree, client_mask(tree, num_clients))


def client_state_bytes(tree: Params, itemsize) -> tuple[int, int]:
    """(bytes of one client's rows, bytes of everything else) of an abstract state tree."""
    per_client = replicated = 0
    for x, is_client in zip(jax.tree.leaves(tree), jax.tree.leaves(client_mask(tree))):
        if is_client:
            per_client += int(np.prod(x.shape[1:])) * itemsize(x.dtype)
        else:
            replicated += int(np.prod(x.shape)) * itemsize(x.dtype)
    return per_client, replicated


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
