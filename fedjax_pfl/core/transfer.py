"""Where arrays move: the one module that puts host values on the devices, brings device values
to the host, and moves rows between devices or processes. Everything else asks here.

  host → devices      put_whole (every device the same; several processes compare a fingerprint
                      first, `put_agreed`), put_rows_from (rows split over the devices, each
                      process building only its devices' rows), put_blocks (per-device blocks,
                      each process providing only its devices' blocks)
  devices → host      to_host (all-gathered where an array spans other processes' devices),
                      owned_rows (a process's own rows of a row-sharded array)
  between devices     exchange (an all_to_all of routed sample rows, sharded data placement),
                      ring (rows passed around the devices one at a time, the dealt world)
                      assemble (each device's rows taken from the device that holds them)

With several processes nothing here all-gathers more than it must: `jax.device_put` of a
replicated value would compare every value across processes (for a 1.1 GB dataset over two
processes, 9 s and 3.4 GB more memory in each), so each process provides its own devices'
shards (`jax.make_array_from_callback`) after a 32-byte fingerprint agrees.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

Params = Any
_AXIS = "clients"


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
    holds whole), placed under `shardings` (a tree of shardings matching `tree`). With several
    processes each process provides its own devices'
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


def put_sharded(tree: Params, sharding: jax.sharding.Sharding) -> Params:
    """Host arrays placed with `sharding` by this process, which holds all of them (a call's
    client world, already split into the devices' blocks; a restored key)."""
    return jax.device_put(tree, sharding)


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
    devices' row ranges follow the owners', as with `store.row_owners` and one contiguous
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


def put_whole(tree: Params, mesh: Mesh | None, what: str = "") -> Params:
    """Host values placed whole on every device of `mesh` (the default device without one): the
    dataset, a staged buffer, a round's routes. `what` (several processes): names the values
    when the processes must compare them first (`put_agreed`); without it each process provides
    its own devices' copies of what it computed (`put_replicated`)."""
    if what:
        if mesh is None:
            return jax.device_put(tree)
        sharding = replicated_sharding(mesh)
        return put_agreed(tree, jax.tree.map(lambda _: sharding, tree), what)
    return put_replicated(tree, mesh)


def put_blocks(shape: tuple, sharding: jax.sharding.Sharding, block: Callable[[int], np.ndarray],
               rows: int, axis: int = 0) -> jax.Array:
    """A [..., D·rows, ...] array split over `axis` in D blocks of `rows`, device d's block
    `block(d)` (a host array of the block's shape, cached by the caller if it is costly): each
    process calls `block` only for its own devices, so no process builds another's blocks."""
    def provide(index):
        d = (index[axis].start or 0) // rows
        return block(d)[index[:axis] + (slice(None),) + index[axis + 1:]]

    return jax.make_array_from_callback(tuple(shape), sharding, provide)


def assemble(parts: list[jax.Array], source: np.ndarray, sharding) -> list[jax.Array]:
    """From `parts` (each [D, C, ...], device d holding its process's rows of all C entries) the
    [C, ...] arrays under `sharding` whose row c is device `source[c]`'s (a device of the process
    that holds that row): one jitted gather; rows are copied, never combined arithmetically."""
    return _assembler(sharding)(parts, source)


@functools.lru_cache(maxsize=None)
def _assembler(sharding) -> Callable:
    return jax.jit(lambda parts, source: [p[source, jnp.arange(source.shape[0])] for p in parts],
                   out_shardings=sharding)


def exchange(x: jax.Array, y: jax.Array, source: jax.Array, row: jax.Array, mesh,
             local: bool = False) -> tuple:
    """Inside a jit: the blocks of [D·S] owned rows `x` / `y` (sharded over the clients axis)
    that `Routes` (replicated [D, K, R]) describe, as [K, D·R] arrays sharded over axis 1 (each
    device its own block; [D·R] when K = 1). One `all_to_all` of D·K·R rows per device; every row is copied, never
    summed, so the samples arrive bit for bit (zeros in padding rows). `local`: every row's
    owner is the device that needs it (an evaluation group dealt by owner): each device gathers
    from its own range and nothing crosses between devices."""
    devices, k, r = source.shape

    def per_device(x, y, source, row):
        here = jax.lax.axis_index("clients")
        mine = source[here]                                         # [K, R]: who owns my rows
        take = jnp.clip(mine, 0, devices - 1)

        def move(a):
            expand = lambda m: m.reshape(m.shape + (1,) * (a.ndim - 1))
            if local:                                               # from this device's range
                out = a[jnp.clip(row[here], 0, a.shape[0] - 1)]
            else:
                rows = a[jnp.clip(row, 0, a.shape[0] - 1)]          # [D, K, R, ...]
                send = jnp.where(expand(source == here), rows, jnp.zeros((), a.dtype))
                got = jax.lax.all_to_all(send, "clients", 0, 0)    # [D sources, K, R, ...]
                out = got[take, jnp.arange(k)[:, None], jnp.arange(r)[None, :]]
            out = jnp.where(expand(mine >= 0), out, jnp.zeros((), a.dtype))
            return out[0] if k == 1 else out

        return move(x), move(y)

    block = P("clients") if k == 1 else P(None, "clients")
    return jax.shard_map(per_device, mesh=mesh, in_specs=(P("clients"), P("clients"), P(), P()),
                         out_specs=(block, block), check_vma=False)(x, y, source, row)


def ring(devices: int, slots: int, send, receive, acc, axis: str = _AXIS):
    """For each shift s = 1 … D − 1 and slot k < `slots`: every device e sends `send(s, k)` (a
    tuple of one-row arrays) to device e + s, which folds it in: acc = receive(s, k, sent, acc).
    One row is in flight at a time: XLA reserves a conditional branch's buffers even when the
    other branch runs, so a whole block in flight would cost its memory every round."""
    for s in range(1, devices):
        shift = [(d, (d + s) % devices) for d in range(devices)]

        def step(k, acc, s=s, shift=shift):
            return receive(s, k, jax.lax.ppermute(send(s, k), axis, shift), acc)

        acc = jax.lax.fori_loop(0, slots, step, acc)
    return acc
