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
of block d (`owner[ids] == d`). Each mapper call returns, beside its results, each device's count
of rows dealt to another device than their samples (`misdealt`). The counts are collected while
a program traces (`collecting`), carried out of every jitted inner function
(`jit_carrying_checks`) and scan body (`checked`) they arise in, and returned by the program
(`core.Program`), which stops the run with an error where one is not zero: a misdealt read is
never silent. (A host callback would be simpler, but JAX never writes a program holding one to its
persistent compilation cache, so every run would compile its rounds again.)
"""

from __future__ import annotations

import functools
from typing import Any, Callable, ContextManager

import numpy as np

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from fedjax_pfl.core.notes import Notes

# The misdealt counts of the mapper calls traced so far in the innermost `collecting` block.
_FOUND = Notes("fedjax_pfl_misdealt")


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


def collecting() -> ContextManager[list]:
    """Within one trace: collects the misdealt counts of the mapper calls traced (`note`)."""
    return _FOUND.collect()


def total(found: list) -> jax.Array | None:
    """The collected counts added up ([devices] int32), None where no call read blocks."""
    return functools.reduce(jnp.add, found) if found else None


def note(count: jax.Array | None) -> None:
    """Adds a mapper call's (or an inner function's) misdealt counts to the enclosing
    `collecting` block. Outside one, a concrete count is checked at once, and a traced one
    refused: nothing would read it."""
    if count is None:
        return
    found = _FOUND.current()
    if found is not None:
        found.append(count)
    elif isinstance(count, jax.core.Tracer):
        raise RuntimeError("client data in per-device blocks is read only inside the programs "
                           "core.Program builds, which check that every client ran on the "
                           "device holding its samples")
    else:
        if isinstance(count, jax.Array) and not count.is_fully_addressable:
            from jax.experimental import multihost_utils     # (spans other processes' devices)

            count = multihost_utils.process_allgather(count, tiled=True)
        if int(np.sum(np.asarray(count))):
            raise RuntimeError(MISDEALT)


MISDEALT = "a client ran on a device that does not hold its samples"


def checked(fn: Callable) -> Callable:
    """fn(*args) -> (fn's result, the misdealt counts collected while it traced, or None)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with collecting() as found:
            out = fn(*args, **kwargs)
        return out, total(found)

    return run


def note_each(counts: jax.Array | None) -> None:
    """`note` for the counts of a scan's iterations ([iterations, devices], or None)."""
    note(None if counts is None else jnp.sum(counts, axis=0))


def jit_checked(fn: Callable, **jit_kwargs) -> Callable:
    """`jax.jit(checked(fn))`: (fn's result, its misdealt counts); a given `out_shardings` is
    fn's result's, the counts' left to XLA."""
    if "out_shardings" in jit_kwargs:
        jit_kwargs = {**jit_kwargs, "out_shardings": (jit_kwargs["out_shardings"], None)}
    return jax.jit(checked(fn), **jit_kwargs)


def jit_carrying_checks(fn: Callable, **jit_kwargs) -> Callable:
    """`jax.jit(fn)` whose misdealt counts reach the caller's trace: the jitted function returns
    them as one more output (`jit_checked`), and each call notes them again. (A jitted function
    is traced once and its trace reused by every program that calls it, so what it collects must
    leave it as an output, not through Python state.)"""
    jitted = jit_checked(fn, **jit_kwargs)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        out, count = jitted(*args, **kwargs)
        note(count)
        return out

    return call
