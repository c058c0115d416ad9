"""The client-sorted, memory-mappable cache of a natural-client dataset, and LEAF-style subsets.

A reader (`data/leaf.py`, `data/tff.py`, `data/fedjax_sqlite.py`) turns its files into a stream of
`ClientBlock`s. `build` writes that stream once, client by client, into a cache directory:

    meta.json          format version, Task, SourceInfo (each source file with its size and
                       mtime_ns), counts, array dtypes and per-sample shapes, conversion time
    client_ids.json    [N] client ids, in the reader's order
    x.bin              every client's training inputs, concatenated in client order (raw C order),
                       then every client's held-out inputs likewise
    y.bin              … their labels, in the same order
    train_offsets.bin  [N + 1] int64 little-endian: client i's training samples are rows
    test_offsets.bin   [N + 1]   offsets[i]:offsets[i + 1] of the train (test) arrays

`open` maps the arrays read-only (`np.memmap`; train_x and test_x are the two parts of x.bin),
and x.bin / y.bin whole are already `FederatedData`'s layout (train blocks, then test blocks),
so `--data-placement host` streams from the mapped file without a copy in memory. So a later
run on hundreds of thousands of
clients starts in seconds and pages in only the clients it touches. `load` is what a run calls:
it keys the cache by dataset, format, reader options and source directory, opens it when it is
current, and otherwise says in one line why it is converting again (never reading a stale or
partial cache silently). `select` takes LEAF's kind of client subset.

    nc = cache.load(reader, cache_root)                    # NaturalClients, arrays memory-mapped
    idx = cache.select(nc, max_clients=100, min_samples=10, seed=0)
    nc = cache.subset(nc, idx)                             # those clients only, in memory
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import io
import json
import os
import shutil
import tempfile
import time
from typing import Callable, Iterable

import numpy as np

from fedjax_pfl.data.natural import ClientBlock, DataFormatError, NaturalClients, NaturalReader, SourceInfo, Task
from fedjax_pfl.errors import OptionError, arg

__all__ = ["FORMAT_VERSION", "CACHE_DIRNAME", "StaleCacheError", "default_cache_root", "cache_key",
           "build", "open", "check", "load", "select", "subset"]

# Bump when the layout or the meaning of a cached array changes: every older cache is rebuilt.
FORMAT_VERSION = 2          # 2: x.bin / y.bin hold both splits (1: four files, one per split)
# The default cache root is this folder inside the data directory.
CACHE_DIRNAME = ".fedjax_pfl_cache"
ARRAYS = ("train_x", "train_y", "test_x", "test_y")
FILES = {"x": ("train_x", "test_x"), "y": ("train_y", "test_y")}   # file -> its parts, in order
OFFSETS = ("train_offsets", "test_offsets")
_OFFSET_DTYPE = np.dtype("<i8")
_TMP_MARK = ".tmp-"


class StaleCacheError(ValueError):
    """A cache directory is missing, partial, of another format version or older than its source
    files. The message is one line saying why."""


def default_cache_root(data_dir: str) -> str:
    """`<data_dir>/.fedjax_pfl_cache`: the cache root when none is given."""
    return os.path.join(os.path.abspath(data_dir), CACHE_DIRNAME)


def _source_dir(files: Iterable[str]) -> str:
    dirs = [os.path.dirname(os.path.abspath(f)) for f in files]
    return os.path.commonpath(dirs) if dirs else ""


def cache_key(source: SourceInfo) -> str:
    """The cache directory's name: `<name>-<format>-<12 hex digits>`.

    The digits hash the reader options (they change the arrays) and the directory the source
    files lie in (so one cache root may serve several copies of a dataset). The list of files is
    deliberately not hashed: a file added or removed must be found stale and rebuilt with a
    message, not silently converted into a second directory.
    """
    payload = json.dumps({"options": sorted([list(map(str, kv)) for kv in source.options]),
                          "dir": _source_dir(source.files)}, sort_keys=True)
    digest = hashlib.sha256(payload.encode()).hexdigest()[:12]
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in f"{source.name}-{source.format}")
    return f"{safe}-{digest}"


# ---------------------------------------------------------------------------------------------
# meta.json <-> Task / SourceInfo


def _file_stats(files: Iterable[str]) -> list[dict]:
    out = []
    for path in files:
        st = os.stat(path)
        out.append({"path": os.path.abspath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    return out


def _task_to_dict(task: Task) -> dict:
    d = dataclasses.asdict(task)
    d["metric_excluded"] = list(task.metric_excluded)
    return d


def _task_from_dict(d: dict) -> Task:
    d = dict(d)
    d["metric_excluded"] = tuple(d.get("metric_excluded", ()))
    return Task(**d)


def _source_to_dict(source: SourceInfo) -> dict:
    return {"name": source.name, "format": source.format, "files": _file_stats(source.files),
            "input_scale": source.input_scale, "input_shift": source.input_shift,
            "vocab": list(source.vocab), "labels": list(source.labels),
            "options": [[str(k), str(v)] for k, v in source.options], "rounded": int(source.rounded)}


def _source_from_dict(d: dict) -> SourceInfo:
    return SourceInfo(name=d["name"], format=d["format"], files=tuple(f["path"] for f in d["files"]),
                      input_scale=float(d["input_scale"]), input_shift=float(d["input_shift"]),
                      vocab=tuple(d["vocab"]), labels=tuple(d["labels"]),
                      options=tuple((k, v) for k, v in d["options"]), rounded=int(d.get("rounded", 0)))


# ---------------------------------------------------------------------------------------------
# build


class _ArraySpec:
    """The dtype and per-sample shape every client's x (or y) must share, fixed by the first
    non-empty block (an empty block, e.g. a client without test data, is accepted as it comes:
    it adds no bytes)."""

    def __init__(self, role: str):
        self.role, self.dtype, self.shape = role, None, None

    def check(self, arr: np.ndarray, name: str, where: str, client: str) -> np.ndarray:
        arr = np.asarray(arr)
        if arr.ndim < 1:
            raise DataFormatError(where, f"{name} is a scalar, expected [n, ...] samples", client)
        if arr.dtype == object or arr.dtype.kind not in "biuf":
            raise DataFormatError(where, f"{name} has dtype {arr.dtype}, expected a numeric array", client)
        if arr.dtype.byteorder == ">":                # HDF5 may hold big-endian: store little-endian
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        if arr.shape[0] == 0:
            return arr
        if self.dtype is None:
            self.dtype, self.shape = arr.dtype, tuple(arr.shape[1:])
        elif arr.dtype != self.dtype or tuple(arr.shape[1:]) != self.shape:
            raise DataFormatError(
                where, f"{name} is {arr.dtype}{list(arr.shape[1:])} per sample but earlier clients' "
                       f"{self.role} are {self.dtype}{list(self.shape)}", client)
        return arr


def _where(source: SourceInfo) -> str:
    """What a DataFormatError about a block names as the file: the one source file, else the
    directory the source files lie in."""
    if len(source.files) == 1:
        return os.path.abspath(source.files[0])
    return _source_dir(source.files) or f"{source.name} ({source.format})"


def _remove_dead_temporaries(cache_dir: str) -> None:
    """Removes the temporary siblings `.<name>.tmp-<pid>-*` that a killed build left behind (their
    process is gone); a live build's temporary is left alone."""
    parent, base = os.path.split(os.path.abspath(cache_dir))
    prefix = f".{base}{_TMP_MARK}"
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for entry in names:
        if not entry.startswith(prefix):
            continue
        try:
            pid = int(entry[len(prefix):].split("-")[0])
            os.kill(pid, 0)
            continue                                  # its builder is alive
        except ProcessLookupError:
            pass
        except (ValueError, PermissionError):
            continue
        shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


def build(reader: NaturalReader, cache_dir: str) -> NaturalClients:
    """Converts a reader's client stream into the cache at `cache_dir` and opens it.

    Each client's block is appended as it arrives (training samples to x.bin / y.bin, held-out
    ones to side files appended to them at the end), so no more than one client's arrays are in
    memory at once. Everything is written into a temporary sibling
    directory that is renamed to `cache_dir` only when complete; any exception (a
    `DataFormatError` from the reader or from the checks below, an interrupt) removes it, so no
    partial cache is ever left at `cache_dir`. An existing cache at `cache_dir` is replaced.

    Checks every block: x and y have as many rows as each other in each split, every x (train and
    test) has the dtype and per-sample shape of the first client's, likewise every y, and no
    client id repeats. A failure is a one-line `DataFormatError` naming the client.

    Source files are stat'ed before the first block is read, so a file changed during the
    conversion makes the cache stale on its next `load`. The rest of the SourceInfo (vocabulary,
    labels) is recorded as `reader.source()` gives it after the last block.
    """
    t0 = time.perf_counter()
    task, source = reader.task(), reader.source()
    files = _file_stats(source.files)
    where = _where(source)
    cache_dir = os.path.abspath(cache_dir)
    parent, base = os.path.split(cache_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{base}{_TMP_MARK}{os.getpid()}-", dir=parent)
    try:
        os.chmod(tmp, 0o755)                          # mkdtemp's 0700 would hide it from other users
        x_spec, y_spec = _ArraySpec("inputs"), _ArraySpec("labels")
        ids: list[str] = []
        seen: set[str] = set()
        offsets = {"train": [0], "test": [0]}
        paths = {"train_x": "x.bin", "train_y": "y.bin", "test_x": "test_x.part",
                 "test_y": "test_y.part"}
        handles = {name: io.open(os.path.join(tmp, paths[name]), "wb") for name in ARRAYS}
        try:
            for block in reader.clients():
                block = ClientBlock(*block)
                cid = str(block.client_id)
                if cid in seen:
                    raise DataFormatError(where, "client id appears twice", cid)
                seen.add(cid)
                for split in ("train", "test"):
                    x = x_spec.check(getattr(block, f"{split}_x"), f"{split}_x", where, cid)
                    y = y_spec.check(getattr(block, f"{split}_y"), f"{split}_y", where, cid)
                    if x.shape[0] != y.shape[0]:
                        raise DataFormatError(where, f"{split}_x has {x.shape[0]} samples but {split}_y "
                                                     f"has {y.shape[0]}", cid)
                    if x.shape[0]:
                        handles[f"{split}_x"].write(np.ascontiguousarray(x).data)
                        handles[f"{split}_y"].write(np.ascontiguousarray(y).data)
                    offsets[split].append(offsets[split][-1] + int(x.shape[0]))
                ids.append(cid)
        finally:
            for f in handles.values():
                f.close()
        for file, (_, test_part) in FILES.items():       # the held-out rows after the training rows
            with io.open(os.path.join(tmp, f"{file}.bin"), "ab") as dst, \
                    io.open(os.path.join(tmp, paths[test_part]), "rb") as src:
                shutil.copyfileobj(src, dst, 16 << 20)
            os.remove(os.path.join(tmp, paths[test_part]))
        for split in ("train", "test"):
            np.asarray(offsets[split], _OFFSET_DTYPE).tofile(os.path.join(tmp, f"{split}_offsets.bin"))
        with io.open(os.path.join(tmp, "client_ids.json"), "w") as f:
            json.dump(ids, f)
        x_dtype = x_spec.dtype if x_spec.dtype is not None else np.dtype(np.float32)
        y_dtype = y_spec.dtype if y_spec.dtype is not None else np.dtype(np.int32)
        arrays = {}
        for split in ("train", "test"):
            n = offsets[split][-1]
            arrays[f"{split}_x"] = {"dtype": x_dtype.str, "shape": list(x_spec.shape or ()), "rows": n}
            arrays[f"{split}_y"] = {"dtype": y_dtype.str, "shape": list(y_spec.shape or ()), "rows": n}
        # The SourceInfo again now the stream is read: a reader may complete its vocabulary while
        # reading (LEAF's sent140 builds it from the training split); the file stats stay the
        # ones taken before the first block.
        source = reader.source()
        meta = {
            "format_version": FORMAT_VERSION,
            "task": _task_to_dict(task),
            "source": {**_source_to_dict(dataclasses.replace(source, files=())), "files": files},
            "num_clients": len(ids),
            "num_train": offsets["train"][-1],
            "num_test": offsets["test"][-1],
            "arrays": arrays,
            "conversion_seconds": round(time.perf_counter() - t0, 3),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        # meta.json last: a directory without it is never taken for a cache.
        with io.open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
        _replace_dir(tmp, cache_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return open(cache_dir)


def _replace_dir(tmp: str, cache_dir: str) -> None:
    """Renames `tmp` to `cache_dir`, moving an existing `cache_dir` aside first (a directory
    cannot be renamed over a non-empty one) and deleting it after."""
    try:
        os.rename(tmp, cache_dir)
        return
    except OSError as e:
        if e.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.EISDIR):
            raise
    parent, base = os.path.split(cache_dir)
    old = tempfile.mkdtemp(prefix=f".{base}{_TMP_MARK}{os.getpid()}-old-", dir=parent)
    os.rename(cache_dir, os.path.join(old, base))
    os.rename(tmp, cache_dir)
    shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# open / check


def _read_meta(cache_dir: str) -> dict:
    path = os.path.join(cache_dir, "meta.json")
    try:
        with io.open(path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise StaleCacheError("meta.json is missing") from None
    except (OSError, ValueError) as e:
        raise StaleCacheError(f"meta.json is unreadable ({e})") from None
    if not isinstance(meta, dict):
        raise StaleCacheError("meta.json is not an object")
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise StaleCacheError(f"it has cache format version {version}, this code writes {FORMAT_VERSION}")
    return meta


def _row_bytes(spec: dict) -> int:
    return np.dtype(spec["dtype"]).itemsize * int(np.prod(spec["shape"], dtype=np.int64))


def _expected_sizes(meta: dict) -> dict[str, int]:
    sizes = {}
    for file, parts in FILES.items():
        sizes[f"{file}.bin"] = sum(int(meta["arrays"][name]["rows"]) * _row_bytes(meta["arrays"][name])
                                   for name in parts)
    for name in OFFSETS:
        sizes[f"{name}.bin"] = (int(meta["num_clients"]) + 1) * _OFFSET_DTYPE.itemsize
    return sizes


def _check_files(cache_dir: str, meta: dict) -> None:
    """Every .bin present with the size meta.json implies (a truncated or missing array is stale)."""
    try:
        sizes = _expected_sizes(meta)
    except (KeyError, TypeError, ValueError) as e:
        raise StaleCacheError(f"meta.json lacks an array description ({e})") from None
    for name, size in sizes.items():
        path = os.path.join(cache_dir, name)
        try:
            actual = os.path.getsize(path)
        except OSError:
            raise StaleCacheError(f"{name} is missing") from None
        if actual != size:
            raise StaleCacheError(f"{name} has {actual} bytes, expected {size}")
    if not os.path.isfile(os.path.join(cache_dir, "client_ids.json")):
        raise StaleCacheError("client_ids.json is missing")


def _mapped(path: str, spec: dict, rows: int | None = None, offset: int = 0) -> np.ndarray:
    """`rows` rows (default: the spec's) of the array described by `spec`, starting `offset`
    bytes into the file at `path`, mapped read-only."""
    rows = int(spec["rows"]) if rows is None else rows
    dtype, shape = np.dtype(spec["dtype"]), (rows, *map(int, spec["shape"]))
    if shape[0] == 0 or dtype.itemsize * int(np.prod(shape)) == 0:
        return np.zeros(shape, dtype)                 # np.memmap cannot map an empty file
    return np.memmap(path, dtype=dtype, mode="r", shape=shape, offset=offset)


def open(cache_dir: str) -> NaturalClients:  # noqa: A001 (cache.open, as the issue names it)
    """Opens a cache written by `build`: the four arrays as read-only `np.memmap`s, offsets and
    client ids in memory. Checks the format version and every file's size (not the source files:
    `load` does that); raises `StaleCacheError` (one line) if the cache is not whole."""
    cache_dir = os.path.abspath(cache_dir)
    meta = _read_meta(cache_dir)
    _check_files(cache_dir, meta)
    try:
        with io.open(os.path.join(cache_dir, "client_ids.json")) as f:
            ids = json.load(f)
    except (OSError, ValueError) as e:
        raise StaleCacheError(f"client_ids.json is unreadable ({e})") from None
    if len(ids) != meta["num_clients"]:
        raise StaleCacheError(f"client_ids.json has {len(ids)} ids, expected {meta['num_clients']}")
    offsets = {name: np.fromfile(os.path.join(cache_dir, f"{name}.bin"), _OFFSET_DTYPE).astype(np.int64)
               for name in OFFSETS}
    for split in ("train", "test"):
        off = offsets[f"{split}_offsets"]
        rows = meta["arrays"][f"{split}_x"]["rows"]
        if off[0] != 0 or off[-1] != rows or np.any(np.diff(off) < 0):
            raise StaleCacheError(f"{split}_offsets.bin does not partition the {rows} {split} samples")
    arrays, whole = {}, {}
    for file, (train, test) in FILES.items():
        path, spec = os.path.join(cache_dir, f"{file}.bin"), meta["arrays"][train]
        n_train, n_test = int(spec["rows"]), int(meta["arrays"][test]["rows"])
        arrays[train] = _mapped(path, spec)
        arrays[test] = _mapped(path, meta["arrays"][test], offset=n_train * _row_bytes(spec))
        whole[f"all_{file}"] = _mapped(path, spec, rows=n_train + n_test)
    return NaturalClients(
        task=_task_from_dict(meta["task"]), source=_source_from_dict(meta["source"]),
        client_ids=np.asarray(ids, dtype=str), train_offsets=offsets["train_offsets"],
        test_offsets=offsets["test_offsets"], **arrays, **whole)


def check(cache_dir: str, task: Task, source: SourceInfo) -> None:
    """Raises `StaleCacheError` with the first reason the cache at `cache_dir` cannot stand for
    this reader's data: it is absent, partial (meta.json or a .bin missing or of the wrong size),
    of another format version, made for another task or other options, or a source file was added,
    removed, or changed size or modification time since it was converted."""
    if not os.path.isdir(cache_dir):
        raise StaleCacheError("there is no cache yet")
    meta = _read_meta(cache_dir)
    _check_files(cache_dir, meta)
    cached = meta.get("source", {})
    try:   # (through Task, so a field added since, at its default, is no change)
        cached_task = _task_to_dict(_task_from_dict(meta.get("task") or {}))
    except (TypeError, ValueError):
        cached_task = meta.get("task")
    if _task_to_dict(task) != cached_task:
        raise StaleCacheError(f"the reader's task changed: cached {meta.get('task')}, now {_task_to_dict(task)}")
    now = _source_to_dict(dataclasses.replace(source, files=()))
    for field in ("name", "format", "options"):
        if cached.get(field) != now[field]:
            raise StaleCacheError(f"the source's {field} changed: cached {cached.get(field)}, now {now[field]}")
    old = {f["path"]: f for f in cached.get("files", [])}
    new_paths = [os.path.abspath(p) for p in source.files]
    for path in new_paths:
        if path not in old:
            raise StaleCacheError(f"source file {path} was added")
    for path in old:
        if path not in new_paths:
            raise StaleCacheError(f"source file {path} was removed")
    for path in new_paths:
        try:
            st = os.stat(path)
        except OSError:
            raise StaleCacheError(f"source file {path} is missing") from None
        if st.st_size != old[path]["size"]:
            raise StaleCacheError(f"source file {path} changed size ({old[path]['size']} -> {st.st_size} bytes)")
        if st.st_mtime_ns != old[path]["mtime_ns"]:
            raise StaleCacheError(f"source file {path} was modified since the conversion")


def load(reader: NaturalReader, cache_root: str | None = None,
         log: Callable[[str], None] | None = print) -> NaturalClients:
    """The natural-client dataset of `reader`, from its cache (converted first where needed).

    The cache lives at `<cache_root>/<cache_key(source)>`; `cache_root` defaults to
    `<source dir>/.fedjax_pfl_cache`, the source dir being the directory the reader's files lie
    in (`default_cache_root(data_dir)` for the usual layouts). A current cache is opened without
    reading any source file. Otherwise `log` gets exactly one line saying why (no cache yet, or
    the `check` reason) before the conversion, and one line with the conversion's time after.
    Concurrent loads of the same dataset (a sweep's parallel runs) are serialised by a lock file
    beside the cache, so the second one opens what the first one built.

    Calls `reader.task()` and `reader.source()` once each (they should be cheap: a reader reads
    its clients only in `clients()`).
    """
    log = log or (lambda _msg: None)
    task, source = reader.task(), reader.source()
    if cache_root is None:
        cache_root = os.path.join(_source_dir(source.files) or os.getcwd(), CACHE_DIRNAME)
    cache_dir = os.path.join(os.path.abspath(cache_root), cache_key(source))
    os.makedirs(cache_root, exist_ok=True)
    # The lock file stays (removing a flock'ed file races with a waiting process); it is empty.
    with _Lock(os.path.join(os.path.dirname(cache_dir), f".{os.path.basename(cache_dir)}.lock")):
        _remove_dead_temporaries(cache_dir)
        try:
            check(cache_dir, task, source)
            return open(cache_dir)
        except StaleCacheError as e:
            reason = str(e)
        if reason == "there is no cache yet":
            log(f"{source.name}: converting the {source.format} files into the cache {cache_dir}")
        else:
            log(f"{source.name}: rebuilding the cache {cache_dir}: {reason}")
        t0 = time.perf_counter()
        nc = build(reader, cache_dir)
        rounded = (f"; {nc.source.rounded:,} values rounded to the nearest level the cache stores"
                   if nc.source.rounded else "")
        log(f"{source.name}: converted {nc.num_clients} clients ({int(nc.train_offsets[-1])} train, "
            f"{int(nc.test_offsets[-1])} test samples) in {time.perf_counter() - t0:.1f} s{rounded}")
        return nc


class _Lock:
    """An exclusive advisory lock (flock) on a file, where the platform has one."""

    def __init__(self, path: str):
        self.path, self.f = path, None

    def __enter__(self):
        try:
            import fcntl
        except ImportError:                           # not POSIX: no lock
            return self
        self.f = io.open(self.path, "a")
        fcntl.flock(self.f, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        if self.f is not None:
            self.f.close()                            # closing releases the flock
        return False


# ---------------------------------------------------------------------------------------------
# subsets


def select(nc: NaturalClients, *, max_clients: int | None = None, min_samples: int = 0,
           seed: int = 0) -> np.ndarray:
    """The clients a LEAF-style subset keeps: indices into `nc`'s clients, ascending.

    First every client with at least `min_samples` TRAINING samples (LEAF's `--k` minimum; held-out
    samples do not count), then, if more than `max_clients` remain, `max_clients` of them drawn
    uniformly at random without replacement (`np.random.default_rng(seed).choice`), returned in
    their original order. `max_clients=None` keeps every client that passes the minimum.

    Raises:
      OptionError: `max_clients` < 1, `min_samples` < 0, or no client has `min_samples` training
        samples (the messages name `max_clients` / `min_samples`, data options of a run).
    """
    if max_clients is not None and int(max_clients) < 1:
        raise OptionError(f"{arg('max_clients', 'data')} must be >= 1, got {max_clients}")
    if int(min_samples) < 0:
        raise OptionError(f"{arg('min_samples', 'data')} must be >= 0, got {min_samples}")
    counts = nc.train_counts()
    keep = np.flatnonzero(counts >= int(min_samples)).astype(np.int64)
    if keep.size == 0:
        raise OptionError(f"{arg('min_samples', 'data')} {min_samples}: no client has that many "
                          f"training samples (the largest has "
                          f"{int(counts.max()) if counts.size else 0})")
    if max_clients is not None and keep.size > int(max_clients):
        rng = np.random.default_rng(seed)
        keep = np.sort(rng.choice(keep, size=int(max_clients), replace=False))
    return keep


def _gather(arr: np.ndarray, offsets: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    counts = offsets[idx + 1] - offsets[idx]
    new_offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    out = np.empty((int(new_offsets[-1]), *arr.shape[1:]), arr.dtype)
    for j, i in enumerate(idx):                       # one slice per client: reads only those pages
        out[new_offsets[j]:new_offsets[j + 1]] = arr[offsets[i]:offsets[i + 1]]
    return out, new_offsets


def subset(nc: NaturalClients, indices: np.ndarray) -> NaturalClients:
    """The clients `indices` (ascending, from `select`) as a NaturalClients of their own.

    Every client kept: `nc` itself (its arrays stay memory-mapped). Otherwise the kept clients'
    samples are copied into memory, in the order of `indices`; a run that wants to keep the full
    memory map can keep `nc` and the indices instead.
    """
    idx = np.asarray(indices, np.int64)
    if idx.ndim != 1 or (idx.size and (idx.min() < 0 or idx.max() >= nc.num_clients)):
        raise ValueError(f"client indices must be a 1-D array in [0, {nc.num_clients})")
    if idx.size == nc.num_clients and np.array_equal(idx, np.arange(nc.num_clients)):
        return nc
    train_x, train_off = _gather(nc.train_x, nc.train_offsets, idx)
    train_y, _ = _gather(nc.train_y, nc.train_offsets, idx)
    test_x, test_off = _gather(nc.test_x, nc.test_offsets, idx)
    test_y, _ = _gather(nc.test_y, nc.test_offsets, idx)
    return dataclasses.replace(nc, client_ids=nc.client_ids[idx], train_x=train_x, train_y=train_y,
                               train_offsets=train_off, test_x=test_x, test_y=test_y, test_offsets=test_off,
                               all_x=None, all_y=None)        # (the whole file is no longer these clients)
