"""Client data in per-device blocks: each device holds only the samples of the clients it trains.

With host data placement on several devices (`core.streaming`), a round's M participants are
dealt to the D devices as the client mapper deals its rows: contiguous blocks of ⌈M/D⌉ in the
order `Engine.sample` returns (`core.balanced_order`). Each device then receives only its block's
samples: a [D·R, ...] array sharded over the mesh's "clients" axis, device d holding rows
d·R … d·R + R − 1, and each staged client's start relative to its own device's block. In a run of
several processes each process reads and provides only its own devices' blocks
(`jax.make_array_from_callback`), so no process reads the whole dataset.

`DeviceBlocks(rows, owner)` stands for such an array in `FederatedData.x` / `.y`; `owner[i]` is
the block (device) holding client i's samples, −1 for a client not staged. Outside the client
mapper it is deliberately not an array: indexing it raises, since a read there would apply
block-relative starts to the whole array. The client mapper (`core.execution`) hands each device
its own block as a plain array and checks that every row it runs on device d belongs to a client
of block d (`owner[ids] == d`). A row dealt to another device than its samples is counted
(`note_miss`; the program collects the flags with `hoststate.counting_misses(MISSES)`) and the
run stops with an error: a misdealt read is never silent.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

# Rows run on a device without their client's samples, counted in this process since it started
# (`note_miss`). A process-wide count, not a per-program one: a jitted inner function (local
# training, a full-data pass) is traced once and its trace reused by every program with the same
# shapes, so a per-program counter captured in one trace would receive another program's counts.
# A program compares the count before and after each call (`misdealt_count`).
_MISDEALT = [0]
_LOCK = threading.Lock()


@jax.tree_util.register_pytree_node_class
class DeviceBlocks:
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

    def __getitem__(self, index):
        raise TypeError(
            "this client data is split into per-device blocks (--data-placement host on several "
            "devices) and is read only inside the client mapper, one device's block at a time; "
            "read client samples through Engine.train / LocalTrainer / Evaluator / FullPass (or "
            "core.ClientMapper with ids=), or declare the algorithm with data_blocks=False")

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


def note_miss(count: jax.Array) -> None:
    """Inside the shard_map: adds this device's `misdealt` count to the process's (a host
    callback, so it works under any jit, scan or shard_map the mapper is called in)."""
    jax.debug.callback(_add, count)


def _add(count) -> None:
    n = int(np.sum(np.asarray(count)))
    if n:
        with _LOCK:
            _MISDEALT[0] += n


def misdealt_count() -> int:
    """Rows run on a device without their client's samples so far in this process (call
    `jax.effects_barrier()` first so that the callbacks of finished calls have all run)."""
    with _LOCK:
        return _MISDEALT[0]
