"""Client data sharded over the devices by owner (`--data-placement sharded`).

With `device` placement every device holds every client's samples (`prepare_data`), so any device
can train any client, and every process of a multi-process run places the whole dataset. With
`sharded` placement the clients are split into D contiguous ranges of about equal samples
(training plus test), one range per device (`owner_layout`). Device d holds only its range's
samples: [S] rows, client after client, each client's training samples then its test samples,
zero-padded to the largest range. In a run of several processes each process reads from the
host dataset only the ranges of its own devices (`jax.make_array_from_callback`), once, when the
program is built.

A round still trains its participants where the client mapper deals them (contiguous blocks of
⌈M/D⌉ in `Engine.sample`'s device-balanced order), so their samples move once per round, on the
devices, from the devices that own them to the devices that train them, before the round runs:

  1. the round's participants come from its key (`Algorithm.participants`, the program's probe,
     as for host placement);
  2. on the host, for each trainer t and each row p of t's block (its clients' samples one after
     another, as `core.data_placement.HostData` lays them out): the device that owns the sample and its row in
     that device's range (`Routes`);
  3. on the devices (`transfer.exchange`, one jitted `shard_map`): every device d gathers, for each trainer
     t, the rows of t's block that d owns (zeros elsewhere); one `all_to_all` over the clients axis
     swaps the D × R rows; trainer t keeps each row from its owner.

The result is the per-device block layout of host placement on several devices (`core.rows.DeviceBlocks`):
x / y `DeviceBlocks` of [D·R] rows with block-relative starts. So the rounds compute bit for bit
what they compute with device (or host) placement, and the client mapper checks every row it
reads against its block. Only the exchange's rows cross between devices; the host reads nothing
after the start.

Evaluation runs where the clients live: its groups take ⌈G/D⌉ clients from each device's range
in turn and deal each client to its owner, so each device gathers its group's samples from its
own range and nothing crosses (`transfer.exchange(local=True)`), except where the ranges hold unequal
numbers of clients, and for the last group's fillers.

There is no background prefetch: the exchange is a collective on the devices that run the
rounds, and in a run of several processes every process must issue its collectives in the same
order, which a second thread would not guarantee. JAX dispatches it asynchronously, just before
the round.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fedjax_pfl.core import transfer
from fedjax_pfl.core.data_placement import HostData


class Layout(NamedTuple):
    """Where each client's samples live: `owner` [N] its device, `train_start` / `test_start` [N]
    its splits' first rows within that device's range, `rows` S the rows of every range."""

    owner: np.ndarray
    train_start: np.ndarray
    test_start: np.ndarray
    rows: int


def owner_layout(train_count: np.ndarray, test_count: np.ndarray, devices: int) -> Layout:
    """Contiguous client ranges of about equal samples: client i goes to device
    ⌊D · (c_i + n_i / 2) / T⌋, c_i the samples of clients before it, n_i its own, T the total
    (the device whose share holds the middle of its samples), so the ranges are contiguous and
    each holds T/D samples up to one client's."""
    train_count = np.asarray(train_count, np.int64)
    test_count = np.asarray(test_count, np.int64)
    sizes = train_count + test_count
    total = int(sizes.sum())
    if total == 0:
        owner = np.arange(sizes.size) * devices // max(1, sizes.size)
    else:
        middle = np.cumsum(sizes) - sizes / 2.0
        owner = np.minimum((devices * middle / total).astype(np.int64), devices - 1)
    train_start = np.zeros(sizes.size, np.int32)
    test_start = np.zeros(sizes.size, np.int32)
    rows = 1
    for d in range(devices):
        at = 0
        for i in np.flatnonzero(owner == d):
            train_start[i] = at
            test_start[i] = at + train_count[i]
            at += int(sizes[i])
        rows = max(rows, at)
    return Layout(owner.astype(np.int32), train_start, test_start, rows)


def clients_held_here(train_count: np.ndarray, test_count: np.ndarray) -> np.ndarray:
    """Bool per client: whether one of this process's devices owns it under `owner_layout` over
    every device (`layout.client_mesh`'s order), i.e. which clients' samples a process of a
    multi-process run with sharded data placement reads (`_place_ranges`). Padding clients
    (no samples, appended by `pad_clients`) do not move the real clients' owners."""
    devices = jax.devices()
    owner = owner_layout(train_count, test_count, len(devices)).owner
    here = np.array([d.process_index == jax.process_index() for d in devices])
    return here[owner]


class Routes(NamedTuple):
    """For each trainer t, call round k and row p of t's block: `source` [D, K, R] the device
    that owns the sample (−1: a padding row), `row` [D, K, R] its row in that device's range."""

    source: np.ndarray
    row: np.ndarray


class ShardedData(HostData):
    """Sharded data placement: `HostData` whose blocks come from the devices' own ranges
    (`transfer.exchange`) instead of the host. See the module docstring."""

    name = "sharded"
    needs_participants = True

    def __init__(self, data, participants, mesh, eval_group: int):
        if mesh is None or mesh.size < 2:
            raise ValueError("--data-placement sharded needs several devices")
        super().__init__(data, participants, mesh, eval_group, prefetch=False, blocks=True)
        self.layout = owner_layout(self.train_count, self.test_count, self.devices)
        self.owned_x, self.owned_y = self._place_ranges()
        self._exchange = jax.jit(
            lambda x, y, s, r, local: transfer.exchange(x, y, s, r, mesh, local),
            static_argnums=4)
        self.moved_rows = 0          # sample rows that crossed between devices so far

    def _place_ranges(self) -> tuple[jax.Array, jax.Array]:
        """Each device's range on it; a process reads only its own devices' clients."""
        rows = self.layout.rows
        built: dict[int, tuple[np.ndarray, np.ndarray]] = {}

        def block(d: int):
            if d not in built:
                # a client's training samples, then its test samples (owner_layout's order)
                segments = [s for i in np.flatnonzero(self.layout.owner == d)
                            for s in ((self.train_start[i], self.train_count[i]),
                                      (self.test_start[i], self.test_count[i]))]
                built[d] = self._gather(segments, rows)
            return built[d]

        sharding = NamedSharding(self.mesh, P("clients"))

        def array(which: int, source):
            return transfer.put_blocks((self.devices * rows,) + source.shape[1:], sharding,
                                       lambda d: block(d)[which], rows)

        return array(0, self.x), array(1, self.y)

    def routes(self, ids: np.ndarray, with_test: bool, rows: int, layouts: list) -> Routes:
        """`Routes` of one call's participants `ids` [K, M] (mapper order), blocks of `rows`,
        where each round's `layouts[k]` (`HostData._block_layout`, the starts the round reads)
        places each client's samples in its block."""
        count = ids.shape[0]
        source = np.full((self.devices, count, rows), -1, np.int32)
        row = np.zeros((self.devices, count, rows), np.int32)
        lay = self.layout
        for k, (train_at, test_at, block) in enumerate(layouts):
            segments = [(i, train_at[i], lay.train_start[i], self.train_count[i]) for i in ids[k]]
            if with_test:
                segments += [(i, test_at[i], lay.test_start[i], self.test_count[i]) for i in ids[k]]
            for i, at, start, n in segments:
                if at + n > rows:
                    raise RuntimeError(f"device {block[i]}'s clients hold more samples than the "
                                       f"{rows} rows of its block (client {i})")
                source[block[i], k, at:at + n] = lay.owner[i]
                row[block[i], k, at:at + n] = start + np.arange(n)
        return Routes(source, row)

    def _block_arrays(self, ids: np.ndarray, with_test: bool, rows: int, layouts: list):
        routes = self.routes(ids, with_test, rows, layouts)
        here = np.arange(self.devices)[:, None, None]
        crossing = int(np.sum((routes.source >= 0) & (routes.source != here)))
        self.moved_rows += crossing
        source, row = transfer.put_whole(routes, self.mesh)
        return self._exchange(self.owned_x, self.owned_y, source, row, crossing == 0)

    # -- evaluation where the clients live -------------------------------------------------------

    def evaluate(self, run, ids, grouped: bool = True):
        """`Stream.evaluate` with groups arranged so that each device evaluates the clients
        whose samples it holds: the clients taken ⌈G/D⌉ at a time from each device's range in
        turn (`_by_owner`), and each group dealt by owner (`eval_order`). Then the samples stay
        where they are (`exchange(local=True)`), except where the ranges hold unequal numbers of
        clients and a filler of the last group; the results come back in the order of `ids`."""
        want = np.arange(self.num_clients) if ids is None else np.asarray(ids, np.int64)
        uniq, back = np.unique(want, return_inverse=True)
        if uniq.size < want.size:                   # (each distinct client once, as Stream does)
            out = self.evaluate(run, uniq)
            return jax.tree.map(lambda a: np.asarray(a)[back], out)
        order = self._by_owner(want)
        out = super().evaluate(run, want[order], grouped)
        inverse = np.argsort(order)
        return jax.tree.map(lambda a: np.asarray(a)[inverse], out)

    def _by_owner(self, want: np.ndarray) -> np.ndarray:
        width = -(-self.eval_group // self.devices)
        queues = [list(np.flatnonzero(self.layout.owner[want] == d)) for d in range(self.devices)]
        order: list[int] = []
        while any(queues):
            for d in range(self.devices):
                order += queues[d][:width]
                queues[d] = queues[d][width:]
        return np.asarray(order, np.int64)

    def eval_order(self, ids: np.ndarray) -> np.ndarray:
        """A group's clients in blocks of ⌈G/D⌉ (the last short), each client in its owner's
        block where it has room, the others in the blocks left with room."""
        n = len(ids)
        width = -(-n // self.devices)
        room = [min(width, max(0, n - d * width)) for d in range(self.devices)]
        slots: list[list[int]] = [[] for _ in range(self.devices)]
        rest: list[int] = []
        for j, o in enumerate(self.layout.owner[np.asarray(ids, np.int64)]):
            (slots[o] if len(slots[o]) < room[o] else rest).append(j)
        for d in range(self.devices):
            while len(slots[d]) < room[d]:
                slots[d].append(rest.pop(0))
        return np.asarray([j for s in slots for j in s], np.int64)

    def bytes_on_device(self) -> int:
        """Per device: its range, plus one round's block (or an evaluation group's) and the
        exchange's send and receive buffers (D blocks each), plus the routes and starts."""
        block = max(self.block_rows or 0, self.eval_block_rows)
        return self.row_bytes() * (self.layout.rows + (2 * self.devices + 1) * block) + \
            8 * self.devices * block + 20 * self.num_clients
