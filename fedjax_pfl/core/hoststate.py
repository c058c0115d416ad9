"""Client state off the devices (`--state-placement host`): the N-row client state waits in a
host store, and each call of the round sees only its participants' rows.

With device placement every per-client leaf is an [N, ...] array sharded over the devices. With
host placement the declared per-client fields (`CLIENT_FIELDS`, less the ones a state class keeps
on the devices in `DEVICE_CLIENT_FIELDS`) live in a `ClientStore` on the host, and a call runs
in a COMPACT CLIENT WORLD:

  1. the call's participants P (its rounds' `Algorithm.participants`, sorted, padded with the
     id N to a fixed count; dealt to several devices, one sorted block a device) are known
     before it starts;
  2. their rows are gathered from the store and moved to the devices: [|P|, ...] per leaf, on
     several devices dealt to them (`core.dealt`: each device holds only the rows of the
     clients the mapper deals it);
  3. inside the round each such leaf is a `ClientRows(ids=P, rows)`, which `core.gather` and
     `core.scatter` index BY CLIENT ID (the position of id i in P), so the round's code, written
     for [N, ...] leaves and global ids, runs unchanged and computes the same bits;
  4. after the call the participants' rows go back into the store.

A `ClientRows` is not an array: indexing it directly, or any arithmetic on it, fails at trace
time, and a gather or scatter of an id outside P is counted and stops the run with an error. So
an algorithm either runs exactly as with device placement or refuses loudly. An algorithm opts
in with `Algorithm.host_state` (its round and evaluation touch client rows only through
`core.gather` / `core.scatter`, and every client starts from the same rows).

The store is copy-on-write: one initial row per leaf (every client's, checked at init) plus the
rows of the clients some round has written, so a run's host memory grows with the clients that
took part, not with N: a personalised model per client at N = 342,477 costs what its sampled
clients' models cost.

In a run of several processes each process's store holds only its own range of clients' rows
(`row_owners`): a call's world rows are gathered by every process from its own store, and the
devices take each client's row from a device of the process that holds it (`Program._put_rows`);
after the call each process writes back only its own clients' rows, and a checkpoint holds one
part per process (`store_prefix`), merged again on restore whatever the new process count.
"""

from __future__ import annotations

from typing import Any, ContextManager

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_pfl.core import dealt
from fedjax_pfl.core.notes import Notes

Params = Any
STATE_PLACEMENTS = ("device", "host", "auto")

# What the row reads and writes of one trace found: a list of scalar int32 tracers, bit MISS (an
# id gathered or scattered that is not among the rows present) and bit CROSSED (a dealt world's
# device read or wrote rows held by another, `core.dealt`). The program sets it around the round
# and returns their bitwise "or".
_MISSES = Notes("fedjax_pfl_row_misses")
MISS, CROSSED = 1, 2


class ClientRows:
    """The rows of one per-client leaf for the clients `ids` only ([C] int32, sorted ascending;
    entries equal to N pad the world to a fixed size and are never asked for). With a `mesh`
    the world is dealt to its devices (`core.dealt`): `ids` and `rows` are sharded over the
    clients axis in blocks, each block sorted, and each device reads and writes its own rows.

    Stands where an [N, ...] leaf stands in a round's state; `core.gather` / `core.scatter` call
    `take` / `put`. It is deliberately not an array (no indexing, no arithmetic)."""

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
    """Positions of the dealt `ClientRows` among `leaves`, grouped by world (one `core.dealt`
    call reads or writes all the leaves of a world together)."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i, x in enumerate(leaves):
        if _is_dealt(x):
            groups.setdefault((id(x.ids), id(x.mesh)), []).append(i)
    return list(groups.values())


def take_leaves(leaves: list, idx: jax.Array) -> list:
    """`core.gather` of a flattened tree: rows `idx` of each leaf ([N, ...] arrays by index,
    `ClientRows` by client id; a dealt world's leaves in one `core.dealt.take`)."""
    out = [None if _is_dealt(x) else x.take(idx) if isinstance(x, ClientRows) else x[idx]
           for x in leaves]
    for members in _dealt_groups(leaves):
        first = leaves[members[0]]
        rows, miss, crossed = dealt.take(first.mesh, first.ids, [leaves[i].rows for i in members],
                                         idx)
        _note(miss, crossed)
        for i, r in zip(members, rows):
            out[i] = r
    return out


def put_leaves(leaves: list, idx: jax.Array, values: list) -> list:
    """`core.scatter` of a flattened tree: each leaf with rows `idx` set to its `values`, cast
    to the leaf's dtype (a dealt world's leaves in one `core.dealt.put`)."""
    out = [None if _is_dealt(x) else x.put(idx, v) if isinstance(x, ClientRows)
           else x.at[idx].set(v.astype(x.dtype)) for x, v in zip(leaves, values, strict=True)]
    for members in _dealt_groups(leaves):
        first = leaves[members[0]]
        rows, miss, crossed = dealt.put(first.mesh, first.ids, [leaves[i].rows for i in members],
                                        idx, [values[i].astype(leaves[i].dtype) for i in members])
        _note(miss, crossed)
        for i, r in zip(members, rows):
            out[i] = ClientRows(first.ids, r, first.mesh)
    return out


def _note(miss: jax.Array, crossed: jax.Array | None = None) -> None:
    found = _MISSES.current()
    if found is not None:
        code = jnp.where(miss, MISS, 0)
        found.append(code if crossed is None else code | jnp.where(crossed, CROSSED, 0))


def counting_misses() -> ContextManager[list]:
    """Within one trace: collects each `ClientRows` gather's / scatter's flags (`MISS`: an id
    not among the rows present; `CROSSED`: rows read or written across a dealt world's devices);
    `row_flags(found)` is their "or", a traced int32 to return."""
    return _MISSES.collect()


def row_flags(found: list) -> jax.Array:
    """The bitwise "or" of the flags `counting_misses` collected (int32; 0 where none)."""
    return (jax.lax.reduce_or(jnp.stack(found), (0,)) if found
            else jnp.zeros((), jnp.int32))


class ClientStore:
    """Copy-on-write host rows of the per-client leaves (NumPy).

    Every client reads `initial[j]` for leaf j until a round writes its rows; a written client
    has a slot, and leaf j's rows of slot s are row s % P of page s // P (`pages[j]`). All leaves
    share the slots (a round writes a client's rows of every leaf together). Pages of P rows
    (about `page_bytes` of rows, at most N) are added as clients are first written, so the store
    never copies what it holds to grow, and holds at most one partly filled page beyond the
    written rows.
    """

    def __init__(self, initial: list[np.ndarray], num_clients: int, page_bytes: int = 64 << 20):
        self.initial = [np.asarray(a) for a in initial]
        self.num_clients = int(num_clients)
        row = max(1, sum(a.nbytes for a in self.initial))
        self.page_rows = int(max(1, min(self.num_clients, page_bytes // row)))
        self.slot = np.full(self.num_clients + 1, -1, np.int64)   # + 1: the padding id N
        self.ids = np.zeros(0, np.int64)                           # the client of each slot
        self.pages: list[list[np.ndarray]] = [[] for _ in self.initial]

    @property
    def touched(self) -> int:
        """Clients with rows of their own (written by some round)."""
        return int(self.ids.size)

    def row_bytes(self) -> int:
        return int(sum(a.nbytes for a in self.initial))

    def nbytes(self) -> int:
        """Host bytes held: the pages (written rows, and the rest of the last page), the slot
        table and the initial rows."""
        return (int(sum(p.nbytes for pages in self.pages for p in pages)) + self.slot.nbytes
                + self.row_bytes())

    def _by_page(self, slots: np.ndarray):
        """(page, rows of `slots` in it as a mask, offsets) for each page the slots touch."""
        page, offset = np.divmod(slots, self.page_rows)
        for p in np.unique(page):
            where = page == p
            yield int(p), where, offset[where]

    def gather(self, ids: np.ndarray, leaves: list[int] | None = None) -> list[np.ndarray]:
        """Each leaf's rows of clients `ids` ([C]; the id N reads the initial row); only the
        leaves `leaves` (positions) when given."""
        ids = np.asarray(ids, np.int64)
        slots = self.slot[ids]
        own = np.flatnonzero(slots >= 0)
        out = []
        which = range(len(self.initial)) if leaves is None else leaves
        for init, pages in ((self.initial[j], self.pages[j]) for j in which):
            rows = np.empty((ids.size,) + init.shape, init.dtype)
            rows[...] = init
            for p, where, offset in self._by_page(slots[own]):
                rows[own[where]] = pages[p][offset]
            out.append(rows)
        return out

    def put(self, ids: np.ndarray, rows: list[np.ndarray]) -> None:
        """Writes each leaf's rows of the clients `ids` (real ids, distinct)."""
        ids = np.asarray(ids, np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_clients):
            raise ValueError(f"client ids outside 0 … {self.num_clients - 1}: {ids[:8]}")
        new = ids[self.slot[ids] < 0]
        if new.size:
            start, need = self.ids.size, self.ids.size + new.size
            for init, pages in zip(self.initial, self.pages):
                while len(pages) * self.page_rows < need:
                    pages.append(np.empty((self.page_rows,) + init.shape, init.dtype))
            self.slot[new] = np.arange(start, need)
            self.ids = np.concatenate([self.ids, new])
        slots = self.slot[ids]
        for init, pages, r in zip(self.initial, self.pages, rows, strict=True):
            r = np.asarray(r)
            for p, where, offset in self._by_page(slots):
                pages[p][offset] = r[where].astype(init.dtype, copy=False)

    # -- checkpoints ---------------------------------------------------------------------------

    def to_arrays(self, prefix: str = "store") -> dict[str, np.ndarray]:
        """The store as named host arrays (the written clients' rows only, in slot order), named
        `prefix`/… (each process of a multi-process run its own prefix: `store_prefix`)."""
        out = {f"{prefix}/ids": self.ids.copy()}
        written = self.gather(self.ids)
        for j, (init, rows) in enumerate(zip(self.initial, written)):
            out[f"{prefix}/{j}/initial"] = _savable(init)
            out[f"{prefix}/{j}/values"] = _savable(rows)
        return out

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], like: "ClientStore",
                    keep: np.ndarray | None = None) -> "ClientStore":
        """The store saved by `to_arrays` — by every process that saved a part of it (all the
        prefixes `saved_prefixes` finds) — with `like`'s dtypes and row shapes (checked), holding
        only the clients that `keep` ([N] bool; None: all) marks. The initial rows are the first
        part's; of a part that holds none of the kept clients only the ids are read
        (`checkpoint.HostArrays` reads lazily)."""
        store = cls(like.initial, like.num_clients)
        for k, prefix in enumerate(saved_prefixes(arrays)):
            if k == 0:         # the initial rows: the first part's, whoever reads the checkpoint
                for j, init in enumerate(like.initial):
                    saved = _restored(arrays[f"{prefix}/{j}/initial"], init.dtype)
                    if saved.shape != init.shape:
                        raise ValueError(f"checkpoint: client-state leaf {j} has rows "
                                         f"{saved.shape}, this run {init.shape}")
                    store.initial[j] = saved
            ids = np.asarray(arrays[f"{prefix}/ids"], np.int64)
            mine = np.ones(ids.size, bool) if keep is None else keep[ids]
            if not mine.any():
                continue            # (a lazily read checkpoint's rows of other clients stay unread)
            values = [_restored(arrays[f"{prefix}/{j}/values"], init.dtype)
                      for j, init in enumerate(like.initial)]
            for j, (v, init) in enumerate(zip(values, like.initial)):
                if v.shape != (ids.size,) + init.shape:
                    raise ValueError(f"checkpoint: client-state leaf {j} holds rows {v.shape}, not "
                                     f"{(ids.size,) + init.shape} for its {ids.size} clients")
            store.put(ids[mine], [v[mine] for v in values])
        return store


def store_prefix(process: int, processes: int) -> str:
    """The names a process's store part is saved under: "store" in a single process (the format
    of earlier checkpoints), "store.pK" for process K of several."""
    return "store" if processes == 1 else f"store.p{process}"


def saved_prefixes(arrays: dict[str, np.ndarray]) -> list[str]:
    """The store parts in a checkpoint's host arrays (one, or one per process that wrote it)."""
    return sorted(k[:-len("/ids")] for k in arrays
                  if k.endswith("/ids") and (k == "store/ids" or k.startswith("store.p")))


def row_owners(num_clients: int, processes: int) -> np.ndarray:
    """[N] the process whose host store holds each client's rows (multi-process host state
    placement): client i to process ⌊i·P/N⌋, contiguous ranges of about N/P clients."""
    return (np.arange(num_clients, dtype=np.int64) * processes // max(1, num_clients)).astype(np.int32)


def _savable(a: np.ndarray) -> np.ndarray:
    """NumPy's .npz has no bfloat16: such rows are saved as their uint16 bits."""
    return a.view(np.uint16) if a.dtype == jnp.bfloat16 else a


def _restored(a: np.ndarray, dtype) -> np.ndarray:
    a = np.asarray(a)
    return a.view(dtype) if np.dtype(dtype) == jnp.bfloat16 else a.astype(dtype, copy=False)


def host_mask(tree: Params, client_mask: Params) -> Params:
    """True on the per-client leaves that wait on the host: those of `client_mask` less the
    fields a state class keeps on the devices (`DEVICE_CLIENT_FIELDS`: small per-client arrays a
    round reads for every client, such as PGFed's α row sums)."""
    def mark(node, mask):
        if isinstance(node, tuple) and hasattr(type(node), "_fields"):
            keep = set(getattr(type(node), "DEVICE_CLIENT_FIELDS", ()))
            return type(node)(*(jax.tree.map(lambda _: False, m) if name in keep else mark(v, m)
                                for name, v, m in zip(node._fields, node, mask)))
        if isinstance(node, (list, tuple)):
            return type(node)(mark(v, m) for v, m in zip(node, mask))
        if isinstance(node, dict):
            return type(node)((k, mark(v, mask[k])) for k, v in node.items())
        return mask

    return mark(tree, client_mask)


def world(ids_per_round: np.ndarray, size: int, num_clients: int) -> np.ndarray:
    """A call's compact client world: the distinct participants of its rounds, sorted, padded
    with the id N to `size` entries (a fixed size: the round compiles once)."""
    ids = np.unique(np.asarray(ids_per_round, np.int64).ravel())
    if ids.size > size:
        raise RuntimeError(f"{ids.size} participants in a call whose client world holds {size}")
    return np.concatenate([ids, np.full(size - ids.size, num_clients, np.int64)]).astype(np.int32)


class HostState:
    """A run's state under host placement: the leaves that live on the devices (`device`, in
    the state's flattened order, the host leaves left out) and the host rows (`store`).

    It is what `Program.init` / `run_rounds` hand the runner in place of the state pytree;
    `Program.checkpoint_parts` turns it into a checkpointable tree and host arrays."""

    def __init__(self, device: list, store: ClientStore):
        self.device, self.store = device, store

    def __repr__(self) -> str:
        return (f"HostState({len(self.device)} device leaves, {len(self.store.initial)} host "
                f"leaves, {self.store.touched} clients written)")


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
        self.on_host = [bool(b) for b in jax.tree.leaves(host_mask(abstract, client_mask))]
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
        dealt to its devices, `core.dealt`)."""
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
