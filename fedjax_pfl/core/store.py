"""Client state rows on the host: a copy-on-write store, its checkpoint format, and which process
keeps which clients' rows.

With `--state-placement host` the declared per-client fields wait in a `ClientStore` between
calls: one initial row per leaf (every client's until a round writes its own) plus the rows of
the clients some round has written, so a run's host memory grows with the clients that took
part, not with N (a personalised model per client at N = 342,477 costs what its sampled
clients' models cost). In a run of several processes each process's store holds only its own
range of clients' rows (`row_owners`), and a checkpoint holds one part per process
(`store_prefix`), merged again on restore whatever the new process count.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


class ClientStore:
    """Copy-on-write host rows of the per-client leaves (NumPy).

    Every client reads `initial[j]` for leaf j until a round writes its rows; a written client
    has a slot, and leaf j's rows of slot s are row s % P of page s // P (`pages[j]`). All leaves
    share the slots (a round writes a client's rows of every leaf together). Pages of P rows
    (about `page_bytes` of rows, at most N) are added as clients are first written, so the store
    never copies what it holds to grow, and holds at most one partly filled page beyond the
    written rows.

    With `blocks` B > 1 the clients are B equal blocks of N/B that start from different rows (a
    sweep's runs, `fedjax_pfl.sweep`): `initial[j]` holds one row per block, [B, ...], and
    client i reads row ⌊i·B/N⌋ of it (the padding id N the last block's).
    """

    def __init__(self, initial: list[np.ndarray], num_clients: int, page_bytes: int = 64 << 20,
                 blocks: int = 1):
        self.initial = [np.asarray(a) for a in initial]
        self.num_clients, self.blocks = int(num_clients), int(blocks)
        if self.blocks > 1 and (self.num_clients % self.blocks
                                or any(a.shape[:1] != (self.blocks,) for a in self.initial)):
            raise ValueError(f"a store of {self.blocks} blocks needs N a multiple of them and "
                             f"initial rows [{self.blocks}, ...] (N = {self.num_clients}, "
                             f"{[a.shape for a in self.initial]})")
        row = max(1, sum(a.nbytes for a in self.initial) // self.blocks)
        self.page_rows = int(max(1, min(self.num_clients, page_bytes // row)))
        self.slot = np.full(self.num_clients + 1, -1, np.int64)   # + 1: the padding id N
        self.ids = np.zeros(0, np.int64)                           # the client of each slot
        self.pages: list[list[np.ndarray]] = [[] for _ in self.initial]

    @property
    def touched(self) -> int:
        """Clients with rows of their own (written by some round)."""
        return int(self.ids.size)

    def row_bytes(self) -> int:
        """Bytes of one client's rows."""
        return int(sum(a.nbytes for a in self.initial)) // self.blocks

    def _row_shape(self, init: np.ndarray) -> tuple[int, ...]:
        return init.shape[1:] if self.blocks > 1 else init.shape

    def _initial_rows(self, init: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """[C, ...] the initial rows of clients `ids`."""
        if self.blocks == 1:
            return np.broadcast_to(init, (ids.size,) + init.shape)
        block = np.minimum(ids * self.blocks // self.num_clients, self.blocks - 1)
        return init[block]

    def nbytes(self) -> int:
        """Host bytes held: the pages (written rows, and the rest of the last page), the slot
        table and the initial rows."""
        return (int(sum(p.nbytes for pages in self.pages for p in pages)) + self.slot.nbytes
                + int(sum(a.nbytes for a in self.initial)))

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
            rows = np.empty((ids.size,) + self._row_shape(init), init.dtype)
            rows[...] = self._initial_rows(init, ids)
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
                    pages.append(np.empty((self.page_rows,) + self._row_shape(init), init.dtype))
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
        store = cls(like.initial, like.num_clients, blocks=like.blocks)
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
                want = (ids.size,) + like._row_shape(init)
                if v.shape != want:
                    raise ValueError(f"checkpoint: client-state leaf {j} holds rows {v.shape}, not "
                                     f"{want} for its {ids.size} clients")
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
