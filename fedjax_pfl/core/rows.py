"""Rows that are not an array: a per-client quantity held in a layout an [N, ...] array cannot
say, which only the engine's reads may index.

  ClientRows    a call's client world of state rows (`--state-placement host`): the rows of
                the clients `ids` only, indexed by client id by `core.gather` / `core.scatter`
                (`take` / `put`); dealt to the devices, each device its own block (`core.world`)
  DeviceBlocks  client samples in per-device blocks (host or sharded data placement on several
                devices): device d holds only the samples of the clients the mapper deals it,
                and only the client mapper reads them, one device's block at a time

Both are `PlacedRows`: indexing, arithmetic or conversion to an array fails at trace time with a
message saying how to read them, and every read notes its check (`core.checks`: an id not among
the rows present, a row run on a device without its samples), so an algorithm either computes
exactly what it computes with device placement or refuses loudly.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from fedjax_pfl.core import checks, world


class PlacedRows:
    """The array-like of rows that are not an array (module docstring): it refuses every array
    operation with `refusal`."""

    __slots__ = ()
    refusal = "these rows are placed where an array cannot say"

    def _refuse(self, *args, **kwargs):
        raise TypeError(self.refusal)

    __getitem__ = __setitem__ = __array__ = __iter__ = __len__ = _refuse
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _refuse
    __truediv__ = __rtruediv__ = __matmul__ = __rmatmul__ = __neg__ = _refuse
    __jax_array__ = _refuse


class ClientRows(PlacedRows):
    """The rows of one per-client leaf for the clients `ids` only ([C] int32, sorted ascending;
    entries equal to N pad the world to a fixed size and are never asked for). With a `mesh`
    the world is dealt to its devices (`core.world`): `ids` and `rows` are sharded over the
    clients axis in blocks, each block sorted, and each device reads and writes its own rows.

    Stands where an [N, ...] leaf stands in a round's state; `core.gather` / `core.scatter` call
    `take` / `put`. It is deliberately not an array (`PlacedRows`)."""

    refusal = ("this client state waits off the devices (--state-placement host): a round sees "
               "only its participants' rows, read and written through core.gather / "
               "core.scatter by client id")

    __slots__ = ("ids", "rows", "mesh")

    def __init__(self, ids: jax.Array, rows: jax.Array, mesh: Any = None):
        self.ids, self.rows, self.mesh = ids, rows, mesh

    @property
    def dtype(self):
        return self.rows.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.rows.shape)

    def _positions(self, idx: jax.Array) -> jax.Array:
        idx = jnp.asarray(idx)
        pos = jnp.clip(jnp.searchsorted(self.ids, idx), 0, self.ids.shape[0] - 1)
        _note(jnp.any(self.ids[pos] != idx))
        return pos

    def take(self, idx: jax.Array) -> jax.Array:
        """rows of the clients `idx` (global ids): [len(idx), ...]."""
        if self.mesh is not None:
            return take_leaves([self], idx)[0]
        return self.rows[self._positions(idx)]

    def put(self, idx: jax.Array, values: jax.Array) -> "ClientRows":
        """These rows with the clients `idx` set to `values` (cast to the stored dtype)."""
        if self.mesh is not None:
            return put_leaves([self], idx, [values])[0]
        return ClientRows(self.ids, self.rows.at[self._positions(idx)].set(values.astype(self.dtype)))

    def astype(self, dtype) -> "ClientRows":
        return ClientRows(self.ids, self.rows.astype(dtype), self.mesh)

    def __repr__(self) -> str:
        dealt_to = "" if self.mesh is None else f", dealt to {self.mesh.size} devices"
        return f"ClientRows(ids={self.ids.shape}, rows={self.rows.shape} {self.rows.dtype}{dealt_to})"


def _is_dealt(x: Any) -> bool:
    return isinstance(x, ClientRows) and x.mesh is not None


def _dealt_groups(leaves: list) -> list[list[int]]:
    """Positions of the dealt `ClientRows` among `leaves`, grouped by world (one `core.world`
    call reads or writes all the leaves of a world together)."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i, x in enumerate(leaves):
        if _is_dealt(x):
            groups.setdefault((id(x.ids), id(x.mesh)), []).append(i)
    return list(groups.values())


def take_leaves(leaves: list, idx: jax.Array) -> list:
    """`core.gather` of a flattened tree: rows `idx` of each leaf ([N, ...] arrays by index,
    `ClientRows` by client id; a dealt world's leaves in one `core.world.take`)."""
    out = [None if _is_dealt(x) else x.take(idx) if isinstance(x, ClientRows) else x[idx]
           for x in leaves]
    for members in _dealt_groups(leaves):
        first = leaves[members[0]]
        rows, miss, crossed = world.take(first.mesh, first.ids, [leaves[i].rows for i in members],
                                         idx)
        _note(miss, crossed)
        for i, r in zip(members, rows):
            out[i] = r
    return out


def put_leaves(leaves: list, idx: jax.Array, values: list) -> list:
    """`core.scatter` of a flattened tree: each leaf with rows `idx` set to its `values`, cast
    to the leaf's dtype (a dealt world's leaves in one `core.world.put`)."""
    out = [None if _is_dealt(x) else x.put(idx, v) if isinstance(x, ClientRows)
           else x.at[idx].set(v.astype(x.dtype)) for x, v in zip(leaves, values, strict=True)]
    for members in _dealt_groups(leaves):
        first = leaves[members[0]]
        rows, miss, crossed = world.put(first.mesh, first.ids, [leaves[i].rows for i in members],
                                        idx, [values[i].astype(leaves[i].dtype) for i in members])
        _note(miss, crossed)
        for i, r in zip(members, rows):
            out[i] = ClientRows(first.ids, r, first.mesh)
    return out


def _note(miss: jax.Array, crossed: jax.Array | None = None) -> None:
    """The row flags of one read or write (`core.checks`: MISSED, CROSSED)."""
    code = jnp.where(miss, checks.MISSED, 0).astype(jnp.int32)
    if crossed is not None:
        code = code | jnp.where(crossed, checks.CROSSED, 0).astype(jnp.int32)
    checks.note("rows", code)


# -- client data in per-device blocks --------------------------------------------------------


@jax.tree_util.register_pytree_node_class
class DeviceBlocks(PlacedRows):
    """[D·R, ...] samples in per-device blocks (`rows`, sharded over the clients axis) and [N]
    int32 `owner`, the block of each client (−1: not staged). See the module docstring."""

    __slots__ = ("rows", "owner")

    def __init__(self, rows: Any, owner: Any):
        self.rows, self.owner = rows, owner

    def tree_flatten(self):
        return (self.rows, self.owner), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(*children)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.rows.shape)

    @property
    def dtype(self):
        return self.rows.dtype

    @property
    def ndim(self) -> int:
        return len(self.rows.shape)

    refusal = ("this client data is split into per-device blocks (--data-placement host on "
               "several devices) and is read only inside the client mapper, one device's block "
               "at a time; read client samples through Engine.train / LocalTrainer / Evaluator / "
               "FullPass (or core.ClientMapper with ids=), or declare the algorithm with "
               "data_blocks=False")

    def __repr__(self) -> str:
        return f"DeviceBlocks(rows={self.shape} {self.dtype}, owner={tuple(self.owner.shape)})"


def _is_blocks(node: Any) -> bool:
    return isinstance(node, DeviceBlocks)


def has_blocks(tree: Any) -> bool:
    return any(_is_blocks(n) for n in jax.tree.leaves(tree, is_leaf=_is_blocks))


def owner_of(tree: Any) -> jax.Array:
    """The `owner` of the first `DeviceBlocks` in `tree` (all of one dataset share it)."""
    return next(n for n in jax.tree.leaves(tree, is_leaf=_is_blocks) if _is_blocks(n)).owner


def in_specs(shared: tuple) -> tuple:
    """shard_map in_specs for a mapper's `shared` arguments: the blocks' rows split over the
    clients axis, everything else whole on every device."""
    def spec(element):
        if not has_blocks(element):
            return P()
        return jax.tree.map(lambda n: DeviceBlocks(P("clients"), P()) if _is_blocks(n) else P(),
                            element, is_leaf=_is_blocks)

    return tuple(spec(s) for s in shared)


def local(shared: tuple) -> tuple:
    """Inside the shard_map: each `DeviceBlocks` replaced by this device's block, a plain array."""
    return jax.tree.map(lambda n: n.rows if _is_blocks(n) else n, shared, is_leaf=_is_blocks)


def local_abstract(shared: tuple, devices: int) -> tuple:
    """`shared` with each `DeviceBlocks` replaced by the shape of one device's block (what the
    automatic chunk size analyses)."""
    def one(n):
        if not _is_blocks(n):
            return n
        return jax.ShapeDtypeStruct((n.rows.shape[0] // devices,) + tuple(n.rows.shape[1:]),
                                    n.rows.dtype)

    return jax.tree.map(one, shared, is_leaf=_is_blocks)


def misdealt(owner: jax.Array, ids: jax.Array, valid: jax.Array, axis: str = "clients") -> jax.Array:
    """Inside the shard_map: [1] int32, how many valid rows of this device belong to clients
    whose samples are in another device's block."""
    here = jax.lax.axis_index(axis)
    return jnp.sum(valid & (owner[ids] != here), dtype=jnp.int32)[None]
