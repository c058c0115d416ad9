"""`Program`'s calls under host client-state placement (`--state-placement host`,
`core.hoststate`): the per-client rows wait in a copy-on-write host store, and each call moves
its participants' rows (its "world") to the devices and back. On several devices the world is
dealt to them (`core.dealt`): each device receives the rows of the clients it trains.

`HostStateCalls` is a mixin of `core.program.Program`: the program's state, shardings, stream
and jitted-function cache are `Program`'s; these methods are the host-state half of its round,
evaluation, compilation and checkpoint paths. In a run of several processes each process's store
holds only its own range of clients' rows (`hoststate.row_owners`): a call's world rows are
gathered by every process from its own store and assembled on the devices (`_put_rows`), each
process writes back its own, and a checkpoint holds one store part per process.
"""

from __future__ import annotations

import concurrent.futures
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_pfl.core import blocks, dealt, hoststate
from fedjax_pfl.core.hoststate import HostClients, HostState
from fedjax_pfl.core.placement import (client_mask, owned_rows, put_replicated, put_rows_from,
                                      rows_held, to_host)
from fedjax_pfl.core.streaming import key_bytes, in_groups


class HostStateCalls:
    """The host-state methods of `core.program.Program` (see the module docstring)."""

    def _call_participants(self, round_keys: jax.Array, first: int, count: int) -> np.ndarray:
        """[count, M] participants of rounds first … first + count − 1 (the probe)."""
        if self.stream is not None:
            ids = self.stream.participants(round_keys, first, count)
        else:
            ids = self._probe_ids(round_keys, first, count)
        self._clients_per_round = int(ids.shape[-1])
        return ids

    def _probe_ids(self, round_keys: jax.Array, first: int, count: int) -> np.ndarray:
        return np.asarray(jax.device_get(self._probe(
            self.data.clients, round_keys, jnp.asarray(first, jnp.int32), count)), np.int64)

    @property
    def _dealt_mesh(self):
        """The mesh a client world is dealt to (`core.dealt`: each device holds the rows of the
        clients it trains), or None: one device, whose world is whole."""
        return self.mesh if self.mesh is not None and self.mesh.size > 1 else None

    def _world_size(self, count: int) -> int:
        if self._dealt_mesh is not None:      # count rounds' blocks of ⌈M/D⌉ on each device
            d = self.mesh.size
            return d * min(count * -(-self._clients_per_round // d), self.num_clients)
        return min(count * self._clients_per_round, self.num_clients)

    def _world(self, ids: np.ndarray, size: int, distinct: bool = True) -> np.ndarray:
        """The client world of a call's participants ([rounds, M]) or of an evaluation group
        ([G]; `distinct=False`: nothing is written, a client may sit on several devices)."""
        if self._dealt_mesh is None:
            return hoststate.world(ids, size, self.num_clients)
        d = self.mesh.size
        return dealt.world(ids, d, size // d, self.num_clients, distinct=distinct)

    def _world_sharding(self):
        if self._dealt_mesh is None:
            return self._replicated()
        return jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec("clients"))

    def _eval_world_size(self) -> int:
        """An evaluation group's world: G entries, or ⌈G/D⌉ on each of D devices."""
        if self._dealt_mesh is None:
            return self.eval_group
        d = self.mesh.size
        return d * -(-self.eval_group // d)

    def _put_rows(self, rows: list[np.ndarray], world: np.ndarray) -> list:
        """A world's host rows on the devices: each device its block where the world is dealt
        (`core.dealt`), else whole on the one device. With several processes each process's
        store holds only its clients' rows (the others read as the initial row there): every
        device receives its process's rows, and one jitted gather takes each client's row from
        a device of the process that holds it (`_assemble_rows`), so the rows are copied, never
        combined arithmetically."""
        if self._rows_here is None:
            if self._dealt_mesh is None:
                return put_replicated(rows, self.mesh)
            return jax.device_put(rows, self._world_sharding())
        source = self._row_device[np.asarray(world)]
        sharding = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec("clients"))
        parts = [jax.make_array_from_callback((self.mesh.size,) + r.shape, sharding,
                                              lambda index, r=r: r[None])
                 for r in rows]
        return self._assemble_rows(parts, put_replicated(source, self.mesh))

    def _row_ownership(self) -> tuple[np.ndarray, np.ndarray]:
        """Several processes: ([N] whether this process's store holds each client's rows,
        [N + 1] int32 the mesh position of a device of the process that holds them; the padding
        id N reads device 0, whose process holds its initial row like every other)."""
        owners = hoststate.row_owners(self.num_clients, jax.process_count())
        first: dict[int, int] = {}
        for d, device in enumerate(self.mesh.devices.flat):
            first.setdefault(device.process_index, d)
        device = np.asarray([first[p] for p in range(jax.process_count())], np.int32)[owners]
        return owners == jax.process_index(), np.append(device, np.int32(0))

    @functools.cached_property
    def _assemble_rows(self) -> Callable:
        def assemble(parts, source):
            return [p[source, jnp.arange(source.shape[0])] for p in parts]

        return jax.jit(assemble, out_shardings=self._world_sharding())

    def _host_init(self, key: jax.Array) -> HostState:
        """The device leaves of the initial state, and a store whose initial rows are every
        client's (checked on the first, second and last real client: they must be equal)."""
        real = self.data.num_real_clients
        probe = jnp.asarray(sorted({0, min(1, real - 1), real - 1}), jnp.int32)

        def fn(k, d):
            dev, host = self.host.split(jax.tree.leaves(self._store(self.algo.init(k, d))))
            return dev, [h[probe] for h in host]

        kwargs = {}
        if self.mesh is not None:
            kwargs["out_shardings"] = (self._device_shardings(), self._replicated())
        dev, samples = self._jitted("host_init", fn, **kwargs)(key, self.data)
        initial = []
        for path, rows in zip(self.host.host_paths, to_host(samples)):
            rows = np.asarray(rows)
            if not all(_same_bits(rows[0], r) for r in rows[1:]):
                raise ValueError(
                    f"{self.algo.name}'s init gives clients different initial rows of {path}: "
                    "--state-placement host keeps one initial row shared by every client "
                    "(use --state-placement device)")
            initial.append(rows[0])
        return HostState(list(dev), hoststate.ClientStore(initial, self.num_clients))

    def _device_shardings(self):
        if self.shardings is None:
            return None
        return self.host.split(jax.tree.leaves(self.shardings))[0]

    def _host_call(self, one: Callable, count: int, streamed: bool) -> Callable:
        """(dev, rows, ids, data, round_keys, first) -> (dev, rows, metrics, row flags):
        `count` rounds of `one` over a client world (a lax.scan when count > 1; the flags of
        its rounds or-ed, `hoststate.row_flags`)."""
        def call(dev, rows, ids, data, round_keys, first):
            if count == 1:
                return one(dev, rows, ids, data, round_keys, first)

            def body(carry, xs):
                i, round_data = xs if streamed else (xs, data)
                (dev, rows, m, miss), misdealt = blocks.checked(one)(*carry, ids, round_data,
                                                                     round_keys, first + i)
                return (dev, rows), (m, miss, misdealt)

            steps = jnp.arange(count, dtype=jnp.int32)
            (dev, rows), (m, miss, misdealt) = jax.lax.scan(body, (dev, rows),
                                                            (steps, data) if streamed else steps)
            blocks.note_each(misdealt)
            return dev, rows, m, jax.lax.reduce_or(miss, (0,))

        return call

    def _host_round_function(self, count: int) -> Callable:
        if count == self.rounds_per_call and getattr(self, "_round_compiled", None) is not None:
            return self._round_compiled
        host, name = self.host, f"{self.algo.name}'s round_fn"

        def one(dev, rows, ids, data, round_keys, r):
            with hoststate.counting_misses() as found:
                state = host.wrap(dev, rows, ids, self._dealt_mesh)
                state, metrics = self.algo.round_fn(state, data, jax.random.fold_in(round_keys, r))
                dev, rows = host.unwrap(state, ids, name)
            return self._store_device(dev), rows, metrics, hoststate.row_flags(found)

        kwargs = {}
        if self.mesh is not None:
            rep = self._replicated()
            kwargs["out_shardings"] = (self._device_shardings(), self._world_sharding(), rep, rep)
        return self._jitted(f"host_rounds{count}",
                            self._host_call(one, count, self.stream is not None and count > 1),
                            donate_argnums=(0, 1), **kwargs)

    def _store_device(self, dev: list) -> list:
        """Resident per-client float leaves in the storage dtype (`_store` of the device part)."""
        if self.storage is None:
            return dev
        client = self.host.split(self.host.is_client)[0]
        return [x.astype(self.storage) if c and jnp.issubdtype(x.dtype, jnp.floating) else x
                for x, c in zip(dev, client)]

    def _run_host(self, state: HostState, round_keys: jax.Array, first: int, count: int):
        staged = self.stream.take(round_keys, first, count) if self.stream is not None else None
        ids = staged.ids if staged is not None else self._call_participants(round_keys, first, count)
        self._clients_per_round = int(ids.shape[-1])
        world = self._world(ids, self._world_size(count))
        rows = self._put_rows(self._take_rows(state.store, round_keys, first, count, world), world)
        fn = self._host_round_function(count)
        data = staged.data if staged is not None else self.data
        dev, rows, m, miss = fn(state.device, rows, jnp.asarray(world), data, round_keys,
                                jnp.asarray(first, jnp.int32))
        # While these rounds run: the next call's data, and its rows from the store (the rows
        # this call writes are patched in when they are taken: `_take_rows`).
        if self.stream is not None:
            self.stream.prefetch(round_keys, first + count, count)
        self._prefetch_rows(state.store, round_keys, first + count, count)
        per_round = _per_round(to_host(m), count)
        self._check_dealt(f"rounds {first + 1}-{first + count}")
        self._check_rows(miss, f"rounds {first + 1}-{first + count}")
        self._check_sampled(per_round, ids, first)
        real = world < self.num_clients
        if self._rows_here is not None:           # this process keeps its own clients' rows
            real &= self._rows_here[np.minimum(world, self.num_clients - 1)]
        new_rows = [np.asarray(r)[real] for r in to_host(rows)]
        if self._rows_pending is not None:         # the store is read there: wait before writing
            concurrent.futures.wait([self._rows_pending])
        state.store.put(world[real], new_rows)
        self._rows_written = world[real]
        return HostState(list(dev), state.store), per_round

    def _gather_rows(self, store, round_keys: jax.Array, first: int, count: int):
        """(tag, store, world, rows) of a call, gathered from the store (the prefetch's work)."""
        world = self._world(self._probe_ids(round_keys, first, count), self._world_size(count))
        return (key_bytes(round_keys), first, count), store, world, store.gather(world)

    def _prefetch_rows(self, store, round_keys: jax.Array, first: int, count: int) -> None:
        if not self.prefetch_rows:
            return
        if self._rows_pool is None:
            self._rows_pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="fedjax_pfl_rows")
        self._rows_pending = self._rows_pool.submit(self._gather_rows, store, round_keys, first,
                                                    count)

    def _take_rows(self, store, round_keys: jax.Array, first: int, count: int,
                   world: np.ndarray) -> list[np.ndarray]:
        """The world's rows: the prefetched ones when they were gathered for exactly this call
        (keys, rounds, world and store), with the rows the previous call wrote since read again;
        otherwise gathered now."""
        pending, self._rows_pending = self._rows_pending, None
        if pending is not None:
            tag, from_store, got, rows = pending.result()
            if (tag == (key_bytes(round_keys), first, count) and from_store is store
                    and np.array_equal(got, world)):
                stale = np.isin(world, self._rows_written)
                if stale.any():
                    for r, fresh in zip(rows, store.gather(world[stale]), strict=True):
                        r[stale] = fresh
                self.rows_hits += 1
                return rows
        self.rows_misses += 1
        return store.gather(world)

    def _check_rows(self, flags, where: str) -> None:
        """Stops on a row read or written outside the world; counts the calls whose rows
        crossed a dealt world's devices (`world_crossings`; exact, by `core.dealt`'s ring: a
        client trained by another device in a later round of the call, or an algorithm reading
        rows in its own order)."""
        flags = int(to_host(flags))
        self.world_crossings += bool(flags & hoststate.CROSSED)
        if flags & hoststate.MISS:
            raise RuntimeError(
                f"{where}: {self.algo.name} read or wrote the client-state rows of a client that "
                "was not among the participants moved to the devices; run it with "
                "--state-placement device")

    def _host_eval_function(self, name: str, fn: Callable) -> Callable:
        if name == "evaluate" and getattr(self, "_eval_compiled_group", None) is not None:
            return self._eval_compiled_group
        host = self.host

        def run(dev, rows, world, data, ids):
            with hoststate.counting_misses() as found:
                out = fn(host.wrap(dev, rows, world, self._dealt_mesh), data, ids)
            return out, hoststate.row_flags(found)

        return self._jitted(f"host_{name}", run)

    def _evaluate_host(self, name: str, fn: Callable, state: HostState,
                       ids: np.ndarray | None) -> dict:
        run = self._host_eval_function(name, fn)

        def group(data, padded: jax.Array):
            world = self._world(np.asarray(padded), self._eval_world_size(), distinct=False)
            rows = self._put_rows(state.store.gather(world), world)
            out, miss = run(state.device, rows, jnp.asarray(world), data, padded)
            self._check_rows(miss, "evaluation")
            return to_host(out)

        if self.stream is not None:
            out = self.stream.evaluate(group, ids)
            self._check_dealt("evaluation")
            return out
        return in_groups(lambda padded: group(self.data, jnp.asarray(padded, jnp.int32)), ids,
                         self.num_clients, self.eval_group)

    def checkpoint_parts(self, state) -> tuple[Any, dict[str, np.ndarray]]:
        """(the tree a checkpoint saves with orbax, host arrays saved beside it): the state
        itself, or under host state placement its device leaves and its store's arrays."""
        if self.host is None:
            return state, {}
        return state.device, state.store.to_arrays(
            hoststate.store_prefix(jax.process_index(), jax.process_count()))

    def _splitter(self) -> HostClients:
        return self.host or HostClients(self.abstract_state, client_mask(self.abstract_state))

    def checkpoint_like(self, host_arrays: dict[str, np.ndarray], like=None):
        """What to restore a checkpoint's tree into: the device leaves of a checkpoint written
        under host state placement (it holds a store), else the whole state (`like`, or the
        abstract sharded state)."""
        full = self.abstract_sharded_state() if like is None or isinstance(like, HostState) else like
        if hoststate.saved_prefixes(host_arrays):
            return self._splitter().split(jax.tree.leaves(full))[0]
        return full

    def restored(self, tree, host_arrays: dict[str, np.ndarray]):
        """The state from a checkpoint's parts (`checkpoint_parts`), in this program's state
        placement whichever placement wrote it (the rows are the same)."""
        saved_host = bool(hoststate.saved_prefixes(host_arrays))
        if self.host is None and not saved_host:
            return tree
        splitter = self._splitter()
        if saved_host:
            like = hoststate.ClientStore(self._host_rows_abstract(1, zeros=True, splitter=splitter),
                                         self.num_clients)
            if self.host is not None:      # (each process reads the parts that hold its rows)
                return HostState(list(tree), hoststate.ClientStore.from_arrays(
                    host_arrays, like, keep=self._rows_here))
            return self._device_state_from_store(list(tree), host_arrays, like, splitter)
        # Written with the rows on the devices, resumed with them on the host: each process keeps
        # the rows its store holds (`hoststate.row_owners`), copied from its own devices' shards
        # where they are there (`placement.owned_rows`).
        dev, host = splitter.split(jax.tree.leaves(tree))
        n = self.num_clients
        owners, me = hoststate.row_owners(n, jax.process_count()), jax.process_index()
        rows = [owned_rows(a, owners, me) if isinstance(a, jax.Array)
                else np.asarray(a)[owners == me] for a in host]
        mine = np.flatnonzero(owners == me)
        store = hoststate.ClientStore([r[0] for r in rows], n)
        store.put(mine, rows)
        return HostState(list(dev), store)

    def _device_state_from_store(self, dev: list, host_arrays, like: hoststate.ClientStore,
                                 splitter: HostClients):
        """A checkpoint written with the client rows on the host, resumed with them on the
        devices: each process reads from the checkpoint, and places, only the rows its own
        devices hold (`placement.put_rows_from`); with no mesh, every row on the one device."""
        abstract = splitter.split(jax.tree.leaves(self.abstract_sharded_state()))[1]
        if self.shardings is None:
            store = hoststate.ClientStore.from_arrays(host_arrays, like)
            host = jax.device_put(store.gather(np.arange(self.num_clients)))
            return splitter.treedef.unflatten(splitter.join(dev, host))
        held = np.zeros(self.num_clients, bool)
        for a in abstract:
            held |= rows_held(a.shape, a.sharding)
        store = hoststate.ClientStore.from_arrays(host_arrays, like, keep=held)
        # (one leaf at a time: a host copy of one leaf's rows beside the store, not of all)
        host = [put_rows_from(a.shape, a.dtype, a.sharding,
                              lambda ids, j=j: store.gather(ids, leaves=[j])[0])
                for j, a in enumerate(abstract)]
        return splitter.treedef.unflatten(splitter.join(dev, host))

    def _host_rows_abstract(self, size: int, zeros: bool = False,
                            splitter: HostClients | None = None) -> list:
        out = []
        splitter = splitter or self.host
        for a in splitter.split(splitter.abstract)[1]:
            if zeros:
                out.append(np.zeros(a.shape[1:], a.dtype))
            else:
                out.append(jax.ShapeDtypeStruct((size,) + tuple(a.shape[1:]), a.dtype,
                                                sharding=self._world_sharding()))
        return out

    def _compile_host(self, round_keys: jax.Array, abstract_dev: list) -> None:
        k = self.rounds_per_call
        self._call_participants(round_keys, 0, 1)                   # learns M
        size = self._world_size(k)
        world = jax.ShapeDtypeStruct((size,), jnp.int32, sharding=self._replicated())
        data = self.stream.abstract(k) if self.stream is not None else self.data
        fn = self._host_round_function(k)
        self._round_compiled = fn.lower(abstract_dev, self._host_rows_abstract(size), world, data,
                                        round_keys, jax.ShapeDtypeStruct((), jnp.int32)).compile()
        g, size = self.eval_group, self._eval_world_size()
        ev = self._host_eval_function("evaluate", self.algo.evaluate)
        data = self.stream.abstract_evaluation() if self.stream is not None else self.data
        self._eval_compiled_group = ev.lower(
            abstract_dev, self._host_rows_abstract(size),
            jax.ShapeDtypeStruct((size,), jnp.int32, sharding=self._replicated()), data,
            jax.ShapeDtypeStruct((g,), jnp.int32)).compile()


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.shape == b.shape and a.tobytes() == b.tobytes()


def _per_round(metrics: dict, count: int) -> list[dict]:
    """One call's host metrics as one dict per round (a K-round call's leaves lead with K)."""
    if count == 1:
        return [metrics]
    return [jax.tree.map(lambda a: a[i], metrics) for i in range(count)]
