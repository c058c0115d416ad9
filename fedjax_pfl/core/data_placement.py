"""Where the clients' samples wait between rounds: the data placements (`--data-placement`).

Every data placement answers the program's few questions (`DataPlacement`): what a call's data
is on the devices (`take`, and `abstract` for compiling ahead), how an evaluation walks the
clients (`evaluate`), and how many bytes it keeps on each device.

  DeviceData   every sample of every client on every device, placed once: any device trains
               any client, a call's data is the whole dataset
  HostData     the samples in host memory, each call's participants' moved to the devices
  ShardedData  each device holds its own range of clients (`core.sharded`)

With host placement the client-sorted samples stay in host memory (NumPy arrays, or memory-mapped
ones) and a round sees only its participants':

  1. the round's participants come from its key, by the algorithm's own sampling code
     (`Algorithm.participants`: `round_fn` run up to its first `Engine.sample` / `Engine.train`);
  2. their training blocks are copied into one host buffer of a FIXED number of rows — the M
     largest clients' samples together, so every round has the same shapes and compiles once —
     zero-padded at the end, and moved to the devices;
  3. the round runs on a `FederatedData` whose x / y are that buffer and whose participants'
     `train_start` point into it (every client keeps its counts: weights and sampling read them).

The buffer of the next call's rounds is gathered and transferred by a background thread while the
current call trains (`Stream.prefetch`; `core.Program` turns it on for accelerators only: on CPU
the thread competes with the round for the same cores); it is used only if that call has the same round keys and
rounds, otherwise it is rebuilt. A round reads a client's rows start … start + count − 1 (and,
masked out, positions past the end, which hold other clients' or padding samples in either
placement), so the round computes bit for bit what it computes with device placement; after each
call the round's "sampled" metric is checked to lie among the staged participants.

With several devices (`blocks`), each device receives only the samples of the participants it
trains: the round's participants come in the order the client mapper deals them (contiguous
blocks of ⌈M/D⌉), so the buffer is split into one block per device (`core.rows.DeviceBlocks`), each of a
fixed R rows (the ⌈M/D⌉ largest clients' samples), and each process gathers only its own
devices' blocks. The mapper checks every row against the block it reads.

Evaluation runs in groups of G clients (their training and test blocks, as evaluation may
fine-tune first), G the power of two at or above M: one compiled evaluation. With `blocks` a
group is dealt to the devices too (balanced by samples, `eval_order`) and each device receives
only its clients' samples.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any, Callable, NamedTuple, Protocol

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from fedjax_pfl.core import balance, transfer
from fedjax_pfl.core.memory import nbytes
from fedjax_pfl.core.rows import DeviceBlocks

Params = Any
DATA_PLACEMENTS = ("device", "host", "sharded", "auto")


class DataPlacement(Protocol):
    """What a program asks of its data placement."""

    name: str              # "device", "host" or "sharded"
    data: Any              # the program's FederatedData (its x / y on the devices or the host)
    needs_participants: bool  # a call's data holds only its participants' samples
    blocks: bool           # the data is in per-device blocks (`core.rows.DeviceBlocks`)

    def take(self, round_keys: jax.Array, first: int, count: int) -> "Staged": ...
    def prefetch(self, round_keys: jax.Array, first: int, count: int) -> None: ...
    def abstract(self, count: int) -> Any: ...
    def evaluate(self, run: Callable, ids: np.ndarray | None, grouped: bool) -> dict: ...
    def abstract_evaluation(self, grouped: bool) -> Any: ...
    def bytes_on_device(self) -> int: ...
    def close(self) -> None: ...


class DeviceData:
    """Device data placement: the dataset padded to the device count and placed whole on every
    device, once (several processes compare a fingerprint first: the same files and flags on
    every host). A call's data is the whole dataset; nothing moves per round."""

    name = "device"
    needs_participants = False
    blocks = False

    def __init__(self, data, mesh, eval_group: int):
        data = prepare_data(data, mesh)      # idempotent: callers may have placed it already
        if mesh is None and isinstance(data.x, np.ndarray):
            data = transfer.put_whole(data, None)
        self.data, self.mesh = data, mesh
        self.num_clients = data.num_clients
        self.eval_group = max(1, min(int(eval_group), self.num_clients))

    def take(self, round_keys: jax.Array, first: int, count: int) -> "Staged":
        return Staged((), None, self.data, per_round=False)

    def prefetch(self, round_keys: jax.Array, first: int, count: int) -> None:
        pass

    def abstract(self, count: int):
        return self.data

    def evaluate(self, run: Callable, ids: np.ndarray | None, grouped: bool) -> dict:
        """`run(data, ids)`: once for `ids` (None: every client), or, `grouped` (client state
        off the devices), over groups of `eval_group` clients (`in_groups`)."""
        if not grouped:
            return run(self.data, None if ids is None else np.asarray(ids, np.int32))
        return in_groups(lambda padded: run(self.data, np.asarray(padded, np.int32)), ids,
                         self.num_clients, self.eval_group)

    def abstract_evaluation(self, grouped: bool):
        return self.data

    def bytes_on_device(self) -> int:
        return nbytes(self.data)

    def close(self) -> None:
        pass


# One program per group size, instead of the ~50 small programs of its operations run eagerly
# (1 s of a host-placement run's first evaluation).
_balanced_order = jax.jit(balance.balanced_order, static_argnums=1)


def prepare_data(data, mesh):
    """The dataset padded to a multiple of the device count and placed on every device."""
    if mesh is None:
        return data
    return transfer.put_whole(data.pad_clients(mesh.size), mesh,
                              what="the dataset: the same files and flags on every host?")


def top_sum(counts: np.ndarray, m: int) -> int:
    """Σ of the m largest entries of `counts`: the rows any m clients can hold together."""
    m = max(0, min(int(m), counts.size))
    if m == 0:
        return 0
    return int(np.sort(np.asarray(counts, np.int64))[::-1][:m].sum())


def key_bytes(keys: jax.Array) -> bytes:
    return np.asarray(jax.random.key_data(keys)).tobytes()


class Staged(NamedTuple):
    """One call's rounds on the devices: their participants [K, M] (None where the data does
    not depend on them) and their data (leaves with a leading K axis when `per_round`)."""

    tag: tuple
    ids: np.ndarray | None
    data: Any
    per_round: bool = True


class HostData:
    """Host data placement: the dataset in host memory and what moves each call's participants'
    samples to the devices (module docstring).

    Args:
      data: the whole `FederatedData`, x / y host arrays (NumPy or memory-mapped), clients
        padded to the device count.
      participants: (clients, round_keys, first, count) -> [count, M] ids, jitted (the program's
        probe of `Algorithm.participants`).
      mesh: the device mesh (buffers are replicated over it), or None.
      eval_group: clients per evaluation group.
      prefetch: stage the next call's rounds in the background (False: each call stages its own
        before it starts; for measuring what the prefetch hides).
      blocks: each device receives only its participants' samples (`core.rows.DeviceBlocks`); needs a mesh
        of several devices and an algorithm whose round reads samples only through mapper calls
        dealt like its training (`Algorithm.data_blocks`).
    """

    name = "host"
    needs_participants = True

    def __init__(self, data, participants: Callable, mesh, eval_group: int, prefetch: bool = True,
                 blocks: bool = False):
        self.prefetch_enabled = prefetch
        self.blocks = bool(blocks) and mesh is not None and mesh.size > 1
        self.devices = 1 if mesh is None else mesh.size
        self.block_rows: int | None = None      # R, rows of one device's block (blocks only)
        self.bytes_read = 0                     # bytes this process copied from x / y
        self.data = data
        self.mesh = mesh
        self._participants = participants
        c = jax.device_get(data.clients)
        self.train_start = np.asarray(c.train_start, np.int64)
        self.train_count = np.asarray(c.train_count, np.int64)
        self.test_start = np.asarray(c.test_start, np.int64)
        self.test_count = np.asarray(c.test_count, np.int64)
        self.x, self.y = data.x, data.y
        self.num_clients = data.num_clients
        self.eval_group = max(1, min(int(eval_group), self.num_clients))
        self.eval_rows = max(1, top_sum(self.train_count + self.test_count, self.eval_group))
        self.eval_block_rows = max(1, top_sum(self.train_count + self.test_count,
                                              -(-self.eval_group // self.devices)))
        self._by_size = np.argsort(self.train_count + self.test_count, kind="stable")
        self.round_rows: int | None = None      # set by the first probe (M is static)
        self.per_round: int | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                           thread_name_prefix="fedjax_pfl_prefetch")
        self._pending: concurrent.futures.Future | None = None
        self.hits = self.misses = 0
        self._stacked_clients: dict[int, Any] = {}

    # -- participants and buffers --------------------------------------------------------------

    def participants(self, round_keys: jax.Array, first: int, count: int) -> np.ndarray:
        ids = np.asarray(jax.device_get(self._participants(
            self.data.clients, round_keys, np.int32(first), count)), np.int64)
        if self.per_round is None:
            self.per_round = ids.shape[-1]
            self.round_rows = max(1, top_sum(self.train_count, self.per_round))
            self.block_rows = max(1, top_sum(self.train_count, -(-self.per_round // self.devices)))
        return ids

    def _gather(self, blocks: list[tuple[int, int]], rows: int) -> tuple[np.ndarray, np.ndarray]:
        """The samples of `blocks` ((start, count) each) one after another, zero-padded to `rows`."""
        x = np.zeros((rows,) + self.x.shape[1:], self.x.dtype)
        y = np.zeros((rows,) + self.y.shape[1:], self.y.dtype)
        at = 0
        for start, n in blocks:
            x[at:at + n] = self.x[start:start + n]
            y[at:at + n] = self.y[start:start + n]
            at += n
        self.bytes_read += at * (x[:1].nbytes + y[:1].nbytes)
        return x, y

    def _local(self, ids: np.ndarray, with_test: bool, rows: int):
        """(x, y, train_start, test_start) of a buffer holding clients `ids`' training blocks
        (and, `with_test`, their test blocks after them); other clients' starts are 0."""
        ids = np.asarray(ids, np.int64)
        unique = np.unique(ids)
        train_start = np.zeros(self.num_clients, np.int32)
        test_start = np.zeros(self.num_clients, np.int32)
        blocks, at = [], 0
        for i in unique:
            blocks.append((self.train_start[i], self.train_count[i]))
            train_start[i] = at
            at += int(self.train_count[i])
        if with_test:
            for i in unique:
                blocks.append((self.test_start[i], self.test_count[i]))
                test_start[i] = at
                at += int(self.test_count[i])
        if at > rows:
            raise RuntimeError(f"clients {unique.tolist()[:8]}… hold {at} samples, more than the "
                               f"{rows} rows of the streaming buffer")
        x, y = self._gather(blocks, rows)
        return x, y, train_start, test_start

    def _sharding(self):
        return None if self.mesh is None else transfer.replicated_sharding(self.mesh)

    def _put(self, tree):
        # Several processes: each builds the same host buffer and provides its devices' copies.
        return transfer.put_whole(tree, self.mesh)

    def _as_data(self, x, y, train_start, test_start, clients=None):
        """The dataset with buffer x / y and these starts (counts from `clients`, default the
        dataset's own)."""
        clients = dataclasses.replace(self.data.clients if clients is None else clients,
                                      train_start=train_start, test_start=test_start)
        return dataclasses.replace(self.data, x=x, y=y, clients=clients)

    def _clients_for(self, count: int):
        """The clients' splits with a leading axis of `count` rounds (count > 1: every leaf of
        a scanned call's data carries the round axis), put on the devices once per count."""
        if count == 1:
            return self.data.clients
        if count not in self._stacked_clients:
            stacked = jax.tree.map(lambda a: np.broadcast_to(a, (count,) + a.shape),
                                   jax.device_get(self.data.clients))
            self._stacked_clients[count] = self._put(stacked)
        return self._stacked_clients[count]

    def stage(self, round_keys: jax.Array, first: int, count: int) -> Staged:
        """The participants of rounds first … first + count − 1 and their data on the devices."""
        ids = self.participants(round_keys, first, count)
        if self.blocks:
            return Staged((key_bytes(round_keys), first, count), ids, self._stage_blocks(ids),
                          count > 1)
        parts = [self._local(ids[k], False, self.round_rows) for k in range(count)]
        host = tuple(np.stack(p) if count > 1 else p[0] for p in zip(*parts))
        data = self._as_data(*self._put(host), clients=self._clients_for(count))
        return Staged((key_bytes(round_keys), first, count), ids, data, count > 1)

    def _dealt(self, ids: np.ndarray) -> list[np.ndarray]:
        """Round participants (in the mapper's order) per device: contiguous blocks of ⌈M/D⌉."""
        width = -(-ids.shape[-1] // self.devices)
        return [ids[d * width:(d + 1) * width] for d in range(self.devices)]

    def _block_layout(self, ids: np.ndarray, with_test: bool):
        """([N] block-relative train starts, test starts, [N] owner block) of one call's
        participants `ids` in the mapper's order: each block its clients' training samples, then
        (`with_test`) their test samples."""
        train_start = np.zeros(self.num_clients, np.int32)
        test_start = np.zeros(self.num_clients, np.int32)
        owner = np.full(self.num_clients, -1, np.int32)
        for d, part in enumerate(self._dealt(ids)):
            at = 0
            for i in part:
                if owner[i] >= 0:
                    raise RuntimeError(f"client {i} is staged twice in one call")
                owner[i], train_start[i] = d, at
                at += int(self.train_count[i])
            for i in part if with_test else ():
                test_start[i] = at
                at += int(self.test_count[i])
        return train_start, test_start, owner

    def _block_sharding(self, count: int):
        lead = (None,) if count > 1 else ()
        return NamedSharding(self.mesh, PartitionSpec(*lead, "clients"))

    def _stage_blocks(self, ids: np.ndarray, with_test: bool = False, rows: int | None = None,
                      clients=None):
        """Data of [K, M] participants in per-device blocks: x / y `DeviceBlocks` of
        [(K,) D·R, ...] (`_block_arrays`), starts relative to each client's block."""
        count = ids.shape[0]
        rows = self.block_rows if rows is None else rows
        layouts = [self._block_layout(ids[k], with_test) for k in range(count)]
        x, y = self._block_arrays(ids, with_test, rows, layouts)
        train_start, test_start, owner = self._put(
            tuple(np.stack(a) if count > 1 else a[0] for a in zip(*layouts)))
        return self._as_data(DeviceBlocks(x, owner), DeviceBlocks(y, owner), train_start,
                             test_start, clients=clients if clients is not None else
                             self._clients_for(count))

    def _block_arrays(self, ids: np.ndarray, with_test: bool, rows: int, layouts: list):
        """x / y [(K,) D·R, ...] of [K, M] participants' blocks (`layouts`: each round's
        `_block_layout`), sharded over the clients axis, each process gathering from the host
        only its own devices' blocks (`make_array_from_callback`)."""
        count = ids.shape[0]
        lead = (count,) if count > 1 else ()
        dealt = [self._dealt(ids[k]) for k in range(count)]
        built: dict[int, tuple[np.ndarray, np.ndarray]] = {}

        def segments(part):
            out = [(self.train_start[i], self.train_count[i]) for i in part]
            return out + ([(self.test_start[i], self.test_count[i]) for i in part]
                          if with_test else [])

        def block(d: int) -> tuple[np.ndarray, np.ndarray]:
            if d not in built:      # x and y of device d's block, for every round of the call
                parts = [self._gather(segments(dealt[k][d]), rows) for k in range(count)]
                built[d] = tuple(np.stack(p) if count > 1 else p[0] for p in zip(*parts))
            return built[d]

        def array(which: int, source):
            shape = lead + (self.devices * rows,) + source.shape[1:]
            return transfer.put_blocks(shape, self._block_sharding(count),
                                       lambda d: block(d)[which], rows, axis=len(lead))

        return array(0, self.x), array(1, self.y)

    def _abstract(self, rows: int, count: int = 1):
        """Shapes of staged data of `rows` buffer rows (a leading axis of `count` rounds when
        count > 1), for ahead-of-time compilation."""
        lead = (count,) if count > 1 else ()
        spec = lambda shape, dtype: jax.ShapeDtypeStruct(lead + tuple(shape), dtype,
                                                         sharding=self._sharding())
        n = self.num_clients
        clients = jax.tree.map(lambda a: spec(a.shape, a.dtype), self.data.clients)
        return dataclasses.replace(
            self.data, x=spec((rows,) + self.x.shape[1:], self.x.dtype),
            y=spec((rows,) + self.y.shape[1:], self.y.dtype),
            clients=dataclasses.replace(clients, train_start=spec((n,), np.int32),
                                        test_start=spec((n,), np.int32)))

    def abstract(self, count: int):
        """Shapes of a staged call's data (after the first probe has fixed the buffer size)."""
        if self.round_rows is None:
            raise RuntimeError("probe the participants first (Stream.participants)")
        if not self.blocks:
            return self._abstract(self.round_rows, count)
        return self._abstract_blocks(self.block_rows, count)

    def _abstract_blocks(self, rows: int, count: int = 1):
        data = self._abstract(self.devices * rows, count)
        lead = (count,) if count > 1 else ()
        owner = jax.ShapeDtypeStruct(lead + (self.num_clients,), np.int32,
                                     sharding=self._sharding())
        split = lambda a: DeviceBlocks(jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                            sharding=self._block_sharding(count)),
                                       owner)
        return dataclasses.replace(data, x=split(data.x), y=split(data.y))

    # -- prefetch ------------------------------------------------------------------------------

    def prefetch(self, round_keys: jax.Array, first: int, count: int) -> None:
        """Starts staging rounds first … first + count − 1 in the background."""
        self.cancel()
        if not self.prefetch_enabled:
            return
        self._pending = self._pool.submit(self.stage, round_keys, first, count)

    def take(self, round_keys: jax.Array, first: int, count: int) -> Staged:
        """The staged call for these rounds: the prefetched one when it is for exactly these
        round keys and rounds, otherwise staged now."""
        tag = (key_bytes(round_keys), first, count)
        pending, self._pending = self._pending, None
        if pending is not None:
            staged = pending.result()
            if staged.tag == tag:
                self.hits += 1
                return staged
        self.misses += 1
        return self.stage(round_keys, first, count)

    def cancel(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
            try:
                self._pending.result()
            except (concurrent.futures.CancelledError, Exception):
                pass
            self._pending = None

    # -- evaluation ----------------------------------------------------------------------------

    def evaluation_data(self, ids: np.ndarray):
        """One evaluation group's clients (training and test blocks) on the devices: in
        per-device blocks for `ids` in the mapper's order (`eval_order`), else whole."""
        if self.blocks:
            return self._stage_blocks(np.asarray(ids, np.int64)[None], True, self.eval_block_rows,
                                      clients=self.data.clients)
        return self._as_data(*self._put(self._local(ids, True, self.eval_rows)))

    def abstract_evaluation(self, grouped: bool = True):
        if self.blocks:
            return self._abstract_blocks(self.eval_block_rows)
        return self._abstract(self.eval_rows)

    def eval_order(self, ids: np.ndarray) -> np.ndarray:
        """The order in which a group's clients are dealt to the devices (contiguous blocks):
        balanced by training plus test samples (evaluation may fine-tune first); the identity
        without blocks (the evaluator then balances on the devices)."""
        if not self.blocks:
            return np.arange(len(ids))
        cost = (self.train_count + self.test_count)[np.asarray(ids, np.int64)]
        return np.asarray(jax.device_get(_balanced_order(np.asarray(cost, np.int32),
                                                        self.devices)), np.int64)

    def _fill_blocks(self, part: np.ndarray, group: int) -> np.ndarray:
        """`part` padded to `group` clients for per-device blocks, where a client sits in one
        block only: with the smallest other clients (padding clients first), not with a repeat
        (`in_groups`' default); their results are dropped."""
        others = self._by_size[~np.isin(self._by_size, part)]
        return np.concatenate([part, others[:group - part.size]])

    def evaluate(self, run: Callable, ids: np.ndarray | None, grouped: bool = True) -> dict:
        """`run(data, ids)` over groups of `eval_group` clients (`in_groups`), each group's
        samples moved to the devices first (per-device blocks in `eval_order`), the results
        brought to the host in the group's order (always grouped)."""
        if self.blocks and ids is not None:
            # A client sits in one block only: evaluate each distinct client once (callers may
            # pad ids by repeating one, e.g. CachedEvaluation) and copy the rows back.
            uniq, back = np.unique(np.asarray(ids, np.int64), return_inverse=True)
            if uniq.size < np.size(ids):
                out = self.evaluate(run, uniq, grouped)
                return jax.tree.map(lambda a: np.asarray(a)[back], out)

        def group(padded: np.ndarray):
            order = self.eval_order(padded)
            dealt = padded[order]
            out = transfer.to_host(run(self.evaluation_data(dealt), np.asarray(dealt, np.int32)))
            back = np.argsort(order)
            return jax.tree.map(lambda a: np.asarray(a)[back], out)

        return in_groups(group, ids, self.num_clients, self.eval_group,
                         fill=self._fill_blocks if self.blocks else None)

    def row_bytes(self) -> int:
        """Bytes of one sample (its x and y rows)."""
        return int(np.prod(self.x.shape[1:])) * self.x.dtype.itemsize + \
            int(np.prod(self.y.shape[1:])) * self.y.dtype.itemsize

    def bytes_on_device(self) -> int:
        """The streamed buffers' bytes per device: the round being trained and the next one, or
        an evaluation group, whichever is more."""
        row = self.row_bytes()
        if self.blocks:
            return row * max(2 * (self.block_rows or 0), self.eval_block_rows) + \
                20 * self.num_clients
        return row * max(2 * (self.round_rows or 0), self.eval_rows) + 16 * self.num_clients

    def close(self) -> None:
        self.cancel()
        self._pool.shutdown(wait=False)


def in_groups(run: Callable, ids: np.ndarray | None, num_clients: int, group: int,
              fill: Callable | None = None) -> dict:
    """`run(padded)` (host results with leading axis `group`) over groups of `group` clients of
    `ids` (default: all), the last group padded by `fill(part, group)` (default: its first id
    repeated); the per-client results concatenated in the order of `ids`."""
    want = np.arange(num_clients) if ids is None else np.asarray(ids, np.int64)
    fill = fill or (lambda part, g: np.concatenate([part, np.full(g - part.size, part[0])]))
    parts = []
    for at in range(0, want.size, group):
        part = want[at:at + group]
        padded = fill(part, group)
        out = run(padded)
        parts.append(jax.tree.map(lambda a, k=part.size: np.asarray(a)[:k], out))
    return jax.tree.map(lambda *a: np.concatenate(a), *parts)
