"""A call's client world: the clients whose state rows a call moves to the devices
(`--state-placement host`), one sorted block of ids, or on several devices one block per device,
each holding only the world rows of the clients it trains.

A call's client world (`core.state_placement`) would otherwise sit whole on every device: D copies of
the participants' rows on D devices, and a scatter of the trained rows into every copy (an
all-gather of the M results). Dealt, the world is D blocks of W rows, one per device, sharded
over the mesh's "clients" axis: block d holds the clients the client mapper deals to device d
(contiguous blocks of R = ⌈M/D⌉ rows in the order `Engine.sample` returns them; for an
evaluation group, of its padded ids), each block's ids sorted ascending and padded with the id N.

`take(idx)` and `put(idx, values)` then run per device (shard_map): device d looks up the ids of
its own block of `idx` (positions d·R … d·R + R − 1, `idx` padded like the mapper pads its rows)
in its own world block, so the gathered rows arrive on the device that trains them and the
trained rows are written where they were read, with no communication. Any other order is still
exact, only slower: when some device does not find an id of its block of `idx` at home (all
devices agree, by a psum), the rows travel between the devices one at a time (a ring of
ppermutes: no device ever holds more than its block and one row in flight) and each device reads
/ writes the ones it asked for / holds. That happens in a call of several rounds to a client the
mapper deals to another device than in the call's first round, and to an algorithm reading rows
in its own order; `Program.world_crossings` counts such calls. (Poisson sampling, whose padding
slots would repeat one client over the devices, runs with device placement only.) An id held
by no device (a negative one included) is a miss, reported like the
sorted world's (`core.checks`).

Writes end as a scatter in order (`x.at[idx].set(values)` on XLA:CPU) ends: a repeated id keeps
its last write in `idx`, on either path. A round's client lives on one device only (`world(...,
distinct=True)` deals a client appearing in several rounds of a call to the first device that
trains it). An evaluation group's world is read only: a client asked for on two devices is held
by both.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from fedjax_pfl.core import transfer

_AXIS = "clients"


def world(ids_per_round: np.ndarray, devices: int, per_device: int, num_clients: int,
          distinct: bool = True) -> np.ndarray:
    """[devices · per_device] int32: a world dealt as the mapper deals each row of
    `ids_per_round` ([rounds, M], or [M]): block d holds the distinct ids of every round's
    positions d·R … d·R + R − 1 (R = ⌈M/devices⌉), sorted, padded with the id N. With `distinct`
    (a call that writes rows) a client is held only by the first device dealt it. With one
    device: the call's distinct participants, sorted, padded with N (the compact world)."""
    ids = np.asarray(ids_per_round, np.int64)
    ids = ids.reshape(-1, ids.shape[-1])
    r = -(-ids.shape[1] // devices)
    owner = np.full(num_clients + 1, -1, np.int64)
    parts: list[list[np.ndarray]] = [[] for _ in range(devices)]
    for row in ids:
        for d in range(devices):
            block = np.unique(row[d * r:(d + 1) * r])
            if distinct:
                block = block[(owner[block] < 0) | (owner[block] == d)]
                owner[block] = d
            parts[d].append(block)
    out = np.full((devices, per_device), num_clients, np.int64)
    for d, blocks in enumerate(parts):
        held = np.unique(np.concatenate(blocks)) if blocks else np.zeros(0, np.int64)
        if held.size > per_device:
            raise RuntimeError(f"{held.size} clients dealt to device {d} of a world holding "
                               f"{per_device} per device")
        out[d, :held.size] = held
    return out.reshape(-1).astype(np.int32)


def _padded(idx: jax.Array, devices: int) -> tuple[jax.Array, jax.Array, int]:
    """(`idx` flattened and padded to a multiple of the devices, which of its slots are real,
    how many are)."""
    idx = jnp.ravel(jnp.asarray(idx, jnp.int32))
    m = idx.shape[0]
    pad = -m % devices
    valid = jnp.arange(m + pad) < m
    return (jnp.concatenate([idx, jnp.full(pad, -1, idx.dtype)]) if pad else idx), valid, m


def _lookup(ids: jax.Array, idx: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(positions of `idx` in the sorted block `ids`, found)."""
    pos = jnp.clip(jnp.searchsorted(ids, idx), 0, ids.shape[0] - 1)
    return pos, ids[pos] == idx


def _last(idx: jax.Array) -> jax.Array:
    """bool per slot: no later slot of `idx` holds the same id."""
    order = jnp.argsort(idx, stable=True)
    ranked = idx[order]
    last_sorted = jnp.concatenate([ranked[1:] != ranked[:-1], jnp.ones(1, bool)])
    return jnp.zeros(idx.shape, bool).at[order].set(last_sorted)


def _write(rows: list[jax.Array], at: jax.Array, values: list[jax.Array]) -> list[jax.Array]:
    """Each leaf's rows with rows `at` set to its values; an `at` past the end is dropped."""
    return [x.at[at].set(v, mode="drop") for x, v in zip(rows, values)]


def _one_row(a: jax.Array, k: jax.Array) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(a, k, 1)


def _set_row_if(a: jax.Array, k: jax.Array, row: jax.Array, keep: jax.Array) -> jax.Array:
    """`a` with row k set to `row` where `keep` ([1] bool), in place."""
    return jax.lax.dynamic_update_slice_in_dim(a, jnp.where(keep[0], row, _one_row(a, k)), k, 0)


def _held_nowhere(ids_l: jax.Array, idx_l: jax.Array, valid_l: jax.Array) -> jax.Array:
    """Whether some real slot of `idx` (any device's block) names an id held by no device (only
    the ids travel)."""
    all_ids = jnp.sort(jax.lax.all_gather(ids_l, _AXIS, tiled=True))
    all_idx = jax.lax.all_gather(idx_l, _AXIS, tiled=True)
    all_valid = jax.lax.all_gather(valid_l, _AXIS, tiled=True)
    return jnp.any(~_lookup(all_ids, all_idx)[1] & all_valid)


def _last_occurrence(idx_l: jax.Array) -> jax.Array:
    """[R] bool: this device's slots of `idx` that no later slot (of any device) repeats."""
    last = _last(jax.lax.all_gather(idx_l, _AXIS, tiled=True))
    r = idx_l.shape[0]
    return jax.lax.dynamic_slice(last, (jax.lax.axis_index(_AXIS) * r,), (r,))


def take(mesh: Mesh, ids: jax.Array, rows: list[jax.Array],
         idx: jax.Array) -> tuple[list[jax.Array], jax.Array, jax.Array]:
    """(each leaf's rows of the clients `idx` [len(idx), ...], sharded as the mapper deals them;
    whether an id is held by no device; whether a device read another's rows). All the leaves
    of one world in one call: one lookup, one branch and one ring for all of them."""
    shape, d = jnp.shape(idx), mesh.size
    idx_p, valid, m = _padded(idx, d)

    def per_device(ids_l, rows_l, idx_l, valid_l):
        pos, here = _lookup(ids_l, idx_l)
        away = jax.lax.psum(jnp.sum(~here & valid_l), _AXIS)

        def at_home(out):
            return out, jnp.zeros((), bool)

        def around(out):
            # Device e sends device e + s, slot by slot, its rows of that device's block of
            # `idx` (the ids travel first: they are small).
            all_idx = jax.lax.all_gather(idx_l, _AXIS, tiled=True)
            me, r = jax.lax.axis_index(_AXIS), idx_l.shape[0]

            # (for each shift s: where this device holds the block of device me + s)
            wanted = {s: _lookup(ids_l, jax.lax.dynamic_slice(all_idx, (((me + s) % d) * r,), (r,)))
                      for s in range(1, d)}

            def send(s, k):
                at, held = wanted[s]
                return [_one_row(x, at[k]) for x in rows_l], _one_row(held, k)

            def receive(s, k, sent, out):
                got, held = sent
                return [_set_row_if(o, k, g, held) for o, g in zip(out, got)]

            return transfer.ring(d, r, send, receive, out), _held_nowhere(ids_l, idx_l, valid_l)

        # (the rows held here read first, the others filled in: one output buffer)
        out, miss = jax.lax.cond(away > 0, around, at_home, [x[pos] for x in rows_l])
        return out, miss[None], (away > 0)[None]

    out, miss, crossed = jax.shard_map(per_device, mesh=mesh, in_specs=(P(_AXIS),) * 4,
                                       out_specs=(P(_AXIS),) * 3,
                                       check_vma=False)(ids, rows, idx_p, valid)
    out = [x[:m] for x in out] if idx_p.shape[0] != m else out
    return [x.reshape(shape + x.shape[1:]) for x in out], jnp.any(miss), jnp.any(crossed)


def put(mesh: Mesh, ids: jax.Array, rows: list[jax.Array], idx: jax.Array,
        values: list[jax.Array]) -> tuple[list[jax.Array], jax.Array, jax.Array]:
    """(each leaf's `rows` with the clients `idx` set to its `values` (already in the rows'
    dtype); whether an id is held by no device; whether a device wrote rows another computed)."""
    shape, d = jnp.shape(idx), mesh.size
    idx_p, valid, m = _padded(idx, d)
    pad = idx_p.shape[0] - m
    # (values as a scatter takes them: broadcast to the slots' rows, one row a slot)
    values = [jnp.broadcast_to(v, shape + x.shape[1:]).reshape((m,) + x.shape[1:])
              for v, x in zip(values, rows, strict=True)]
    if pad:        # (the padding slots are not real: never written)
        values = [jnp.concatenate([v, jnp.repeat(v[-1:], pad, axis=0)]) for v in values]

    def per_device(ids_l, rows_l, idx_l, valid_l, values_l):
        pos, found = _lookup(ids_l, idx_l)
        found &= valid_l
        away = jax.lax.psum(jnp.sum(~found & valid_l), _AXIS)

        def at_home():
            # Only a repeated id's last write (every slot is held here, so `idx_l` shows them
            # all); a slot not held here is written out of bounds, i.e. dropped.
            return _write(rows_l, jnp.where(found & _last(idx_l), pos, ids_l.shape[0]),
                          values_l), jnp.zeros((), bool)

        def around():
            # Every device's writes visit every device, slot by slot; where a client is written
            # more than once, only its last write in `idx` order is kept, as a scatter in order
            # ends.
            last = _last_occurrence(idx_l) & valid_l
            own = _write(rows_l, jnp.where(found & last, pos, ids_l.shape[0]), values_l)

            def send(s, k):
                return [_one_row(v, k) for v in values_l], _one_row(idx_l, k), _one_row(last, k)

            def receive(s, k, sent, rows):
                values, i, keep = sent
                at, held = _lookup(ids_l, i)
                return [_set_row_if(x, at[0], v, held & keep) for x, v in zip(rows, values)]

            return (transfer.ring(d, idx_l.shape[0], send, receive, own),
                    _held_nowhere(ids_l, idx_l, valid_l))

        new, miss = jax.lax.cond(away > 0, around, at_home)
        return new, miss[None], (away > 0)[None]

    new, miss, crossed = jax.shard_map(per_device, mesh=mesh, in_specs=(P(_AXIS),) * 5,
                                       out_specs=(P(_AXIS),) * 3,
                                       check_vma=False)(ids, rows, idx_p, valid, values)
    return new, jnp.any(miss), jnp.any(crossed)
