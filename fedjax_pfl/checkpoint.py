"""Checkpoints of a run's state: orbax writes the arrays, a rename commits the directory.

    from fedjax_pfl import checkpoint
    checkpoint.save("ckpt/round_10", state)                  # any pytree of arrays
    state = checkpoint.restore("ckpt/round_10", like=state)  # same structure, shapes, dtypes

Layout of a checkpoint directory `path`:

    arrays/      orbax (OCDBT) with one entry per pytree leaf, named by its flat index
    meta.json    format version, number of leaves, each leaf's path/shape/dtype, `metadata`
    host.npz     optional host-side numpy arrays (`host=`), e.g. a run's per-round logs
    host-K.npz   multi-process runs: process K's own host arrays (`host_local=`, e.g. the client
                 rows its host store holds); `read_host` merges them with host.npz, reading a
                 part's arrays only when they are asked for
    manifest.json  every other file of the checkpoint with its size in bytes and its SHA-256,
                 written last (see "Verification")

Atomicity: everything is written into a hidden sibling `.NAME.tmp-PID-…`, flushed, and the
directory is then renamed to `path` in one `os.rename`. A write that is interrupted (Ctrl-C,
kill, full disk) leaves only the hidden temporary, which `restore` never reads and the next
`save` into the same parent removes; a directory named `path` is always complete.

`restore(path, like=...)` takes the structure, shapes and dtypes from `like` (arrays or
`jax.ShapeDtypeStruct`s) and puts every array directly in `like`'s sharding, so a client state
sharded over devices is read shard by shard; PRNG key arrays are stored as their key data and
rebuilt; bfloat16 leaves stay bfloat16. The saved arrays hold no trace of the devices that wrote
them that `restore` uses: a checkpoint written on D devices or P processes restores on any other
count, into the shardings `like` names (a leaf without one, in a single process: its first
device). `check_like(path, like)` is restore's check of the leaves'
shapes and dtypes alone, from meta.json.

Cost: neither `save` nor `restore` compiles an XLA program (orbax's replica-parallel writing,
which took a `jit(slice)` of every replicated leaf on each device, is off: `_writer`), and orbax
is imported by the first of them, not with this module (tests/runner/test_checkpoint_cost.py).

Verification: `verify(path)` checks the manifest before any array is read: every listed file must
exist, have the listed size (sizes first: a truncated file is found without reading anything)
and the listed SHA-256 (FIPS 180-4; one sequential read of the checkpoint, shared out between
the processes of a multi-process resume). It raises
`CheckpointError` with one line naming the damaged or missing file; `is_intact(path)` is the
same check as a bool. `restore`, `load_numpy`, `read_metadata` and `read_host` verify first, so a
truncated array file or host.npz is reported as such instead of as an orbax/TensorStore or zip
error after compiling. Files in the directory that the manifest does not list are ignored; a
manifest that names a file outside the checkpoint (an absolute path, `..`, or a symbolic link that
leads out of it) is refused as damaged before any file is read.
A checkpoint written before manifests existed (no manifest.json, and meta.json not saying it has
one) is accepted as before: it is only checked for meta.json and arrays/ (`is_complete`).
"""

from __future__ import annotations

import collections.abc
import hashlib
import json
import os
import re
import shutil
import uuid
import zipfile
from typing import Any

import jax
import numpy as np

from fedjax_pfl.core import transfer

FORMAT = 1
_META = "meta.json"
_HOST = "host.npz"
_HOST_PART = "host-{:05d}.npz"          # one per process of a multi-process run (`host_local`)
_HOST_PART_RE = r"host-\d{5}\.npz"
_ARRAYS = "arrays"
_MANIFEST = "manifest.json"
_HASH_CHUNK = 1 << 20          # bytes read at a time when hashing a file


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, or does not match the state it is restored into."""


def save(path: str, state: Any, *, metadata: dict | None = None,
         host: dict[str, np.ndarray] | None = None,
         host_local: dict[str, np.ndarray] | None = None) -> str:
    """Writes `state` (a pytree of arrays) to the directory `path`, atomically.

    Args:
      path: the checkpoint directory; replaced if it exists.
      state: any pytree whose leaves are jax arrays (sharded or not, PRNG keys included), numpy
        arrays or Python scalars.
      metadata: JSON-serialisable dict stored in meta.json (read back by `read_metadata`).
      host: numpy arrays stored in host.npz (read back by `read_host`); in a multi-process
        run, process 0's.
      host_local: this process's own numpy arrays (e.g. the client rows it holds): in a
        multi-process run every process writes its own to host-K.npz (K its process index), and
        `read_host` returns them merged with `host` (keys must differ across processes); in a
        single process they join host.npz.
    Returns:
      The absolute path written.
    """
    import orbax.checkpoint as ocp

    path = os.path.abspath(path)
    parent, name = os.path.split(path)
    # A multi-process run: every process writes its own shards of the arrays into ONE temporary
    # directory (so its name cannot come from a pid), and process 0 alone writes the rest and
    # commits, after a barrier; the path must be on a file system all processes share.
    multi, primary = jax.process_count() > 1, jax.process_index() == 0
    if primary:
        os.makedirs(parent, exist_ok=True)
        _remove_stale_temporaries(parent, name)
    tmp = os.path.join(parent, f".{name}.tmp-" + ("multi" if multi else
                                                  f"{os.getpid()}-{uuid.uuid4().hex[:8]}"))
    try:
        leaves_with_paths, _ = jax.tree_util.tree_flatten_with_path(state)
        arrays, described = {}, []
        for i, (key_path, leaf) in enumerate(leaves_with_paths):
            is_key = _is_prng_key(leaf)
            value = jax.random.key_data(leaf) if is_key else leaf
            if not isinstance(value, (jax.Array, np.ndarray)):
                value = np.asarray(value)
            arrays[f"{i:06d}"] = value
            described.append({"path": jax.tree_util.keystr(key_path), "shape": list(np.shape(leaf)),
                              "dtype": str(leaf.dtype) if hasattr(leaf, "dtype") else
                              str(np.asarray(leaf).dtype), "prng_key": is_key,
                              "stored_shape": list(np.shape(value)),
                              "stored_dtype": str(value.dtype)})
        if primary:
            os.makedirs(tmp)
        _barrier(multi, f"checkpoint {name}: directory")
        checkpointer = ocp.Checkpointer(_writer(ocp))
        checkpointer.save(os.path.join(tmp, _ARRAYS), args=ocp.args.PyTreeSave(arrays))
        if multi and host_local:      # before the barrier: process 0's manifest lists them all
            with open(os.path.join(tmp, _HOST_PART.format(jax.process_index())), "wb") as f:
                np.savez(f, **host_local)
                _flush(f)
        _barrier(multi, f"checkpoint {name}: arrays")
        if not primary:
            _barrier(multi, f"checkpoint {name}: committed")
            return path
        host = {**(host or {}), **({} if multi else host_local or {})}
        if host:
            with open(os.path.join(tmp, _HOST), "wb") as f:
                np.savez(f, **host)
                _flush(f)
        with open(os.path.join(tmp, _META), "w") as f:
            json.dump({"format": FORMAT, "num_leaves": len(described), "leaves": described,
                       "manifest": _MANIFEST, "metadata": metadata or {}}, f, indent=1,
                      default=_json_default)
            _flush(f)
        _write_manifest(tmp)                          # last: it describes every file above
        if os.path.lexists(path):                     # replace: move the old one aside first
            old = os.path.join(parent, f".{name}.old-{uuid.uuid4().hex[:8]}")
            os.rename(path, old)
            os.rename(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, path)                       # the commit
        _fsync_dir(parent)
        _barrier(multi, f"checkpoint {name}: committed")
    except BaseException:
        if primary:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _writer(ocp) -> Any:
    """The orbax handler `save` writes the arrays with: orbax's own (the one
    `StandardCheckpointHandler` wraps, so the files are those it writes and any orbax reader
    restores them), but with replica-parallel writing off.

    Why: by default orbax splits every replicated array's shard between its R replicas, each
    writing 1/R of it, and takes each slice on its device with `lax.slice_in_dim`: one `jit(slice)`
    program per replicated leaf per device, compiled at the first checkpoint (10 programs for
    FedAvg's server state on 2 CPU devices, 16 for PGFedMo's; orbax 0.12
    `serialization/replica_slices.py`). Off, the one replica whose `replica_id` is 0 writes each
    shard whole from its own buffer, with no program: a replicated leaf by the process holding
    replica 0, a leaf sharded over the clients by every process for its own shards (as before).
    The values written are the same and a read does not depend on who wrote them (`restore` and
    checkpoints written before read alike); only a replicated leaf's zarr chunk is its whole
    shard instead of a 1/R slice. orbax itself turns it off where $JAX_PLATFORMS names a GPU
    (`jax_array_handlers._get_default_use_replica_parallel`), not on a GPU found by default; it
    pays where several hosts share the writing of one large replicated array, which a
    simulation's server state is not. Only `jax.Array` and numpy leaves reach orbax (`save`
    turns scalars into numpy), so the registry names those two."""
    default = ocp.type_handlers.get_type_handler(jax.Array)
    arrays = ocp.type_handlers.ArrayHandler(
        use_replica_parallel=False,
        # (the store of per-array metadata the default handler writes, array_metadatas/)
        array_metadata_store=getattr(default, "_array_metadata_store", None))
    registry = ocp.type_handlers.create_type_handler_registry(
        (np.ndarray, ocp.type_handlers.get_type_handler(np.ndarray)), (jax.Array, arrays))
    return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)


def _barrier(multi: bool, name: str) -> None:
    """Waits for every process of a multi-process run (no-op in a single process)."""
    if multi:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def is_complete(path: str) -> bool:
    """True when `path` is a committed checkpoint (the rename happened)."""
    return os.path.isfile(os.path.join(path, _META)) and os.path.isdir(os.path.join(path, _ARRAYS))


def verify(path: str, *, shared: bool = False) -> None:
    """Checks the checkpoint at `path` against its manifest before anything is loaded.

    Every file the manifest lists must exist with the listed size (all sizes are compared first:
    cheap, and a truncated or deleted file is found without reading any data) and the listed
    SHA-256. A checkpoint without a manifest, written before manifests existed, passes when it
    is complete (`is_complete`); one whose meta.json says it has a manifest does not.

    `shared=True` in a run of several processes (every process must call it, for the same
    checkpoint): each process hashes only its share of the files (`verify_shares`: whole files,
    of about equal bytes where no one file dominates) and the processes exchange their findings,
    so that between them they read the checkpoint once and all reach the same verdict: each
    process joins the exchange whatever it found, and all raise for the earliest finding (the
    manifest, then the files in its order), whichever process made it.

    Raises:
      CheckpointError: one line naming the checkpoint and the missing or damaged file.
    """
    processes = jax.process_count() if shared else 1
    if processes == 1:
        signature = _check(path, None)
        if signature is not None:
            _VERIFIED[os.path.abspath(path)] = signature
        return
    # Several processes: whatever each finds, even before hashing (a file that one host's view of
    # a shared file system lacks), every process joins the one exchange, and all raise for the
    # earliest finding: the manifest itself first, then the files in the manifest's order.
    from jax.experimental import multihost_utils

    error, signature, where = None, None, _NOTHING
    try:
        signature = _check(path, (jax.process_index(), processes))
    except (CheckpointError, OSError, ValueError) as e:     # (none may skip the exchange)
        error = e if isinstance(e, CheckpointError) else _finding(
            f"checkpoint {path}: {type(e).__name__}: {' '.join(str(e).split())}")
        where = getattr(error, "position", -1)
    kind = getattr(error, "kind", "")
    found = np.asarray(multihost_utils.process_allgather(
        np.asarray([where, _KINDS.index(kind)], np.int32))).reshape(processes, 2)
    by = int(np.argmin(found[:, 0]))
    first, kind = int(found[by, 0]), _KINDS[int(found[by, 1])]
    if first == _NOTHING:
        if signature is not None:
            _VERIFIED[os.path.abspath(path)] = signature
        return
    if where == first:
        raise error
    names = [name for name, _, _, _ in signature or ()][1:]        # (less the manifest)
    what = (f"file {names[first]}" if 0 <= first < len(names)
            else "its manifest" if first < 0 else f"file {first + 1} of its manifest")
    raise CheckpointError(f"checkpoint {path}: {what} {kind or 'is damaged'} (found by process {by})")


# (no finding, in `verify`'s exchange: int32, as JAX holds it without x64)
_NOTHING = np.iinfo(np.int32).max


# What `verify`'s exchange tells the other processes about a file (its position in the manifest
# goes with it).
_KINDS = ("", "is missing", "has the wrong size (truncated or damaged)", "cannot be read",
          "does not match its SHA-256 in the manifest (damaged)")


def _finding(message: str, position: int = -1, kind: str = "") -> CheckpointError:
    """A CheckpointError that knows where in the checkpoint it was found (-1: the manifest or
    meta.json; i: the manifest's i-th file) and what was wrong (one of `_KINDS`)."""
    error = CheckpointError(message)
    error.position, error.kind = position, kind
    return error


def _check(path: str, share: tuple[int, int] | None) -> tuple | None:
    """`verify`'s checks, hashing every file (`share` None; a checkpoint hashed already and
    unchanged since is not hashed again) or only process k's share of P (`share` = (k, P)).
    Returns the checkpoint's `_signature` taken before hashing (None: a checkpoint from before
    manifests, which has none)."""
    manifest_file = os.path.join(path, _MANIFEST)
    if not os.path.isfile(manifest_file):
        try:
            meta = _read_meta(path, check=False)      # names a missing or unreadable meta.json
        except CheckpointError as e:
            raise _finding(str(e)) from None
        if meta.get("manifest"):
            raise _finding(f"checkpoint {path}: {_MANIFEST} is missing (meta.json says it "
                           "was written): the checkpoint is damaged")
        return None                               # written before manifests: accepted as is
    try:
        with open(manifest_file, "rb") as f:
            manifest = json.loads(f.read().decode("utf-8"))
        files = manifest["files"]
        listed = [(str(name), int(entry["size"]), str(entry["sha256"]))
                  for name, entry in files.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise _finding(f"checkpoint {path}: {_MANIFEST} is unreadable ({type(e).__name__}: "
                       f"{' '.join(str(e).split())}): the checkpoint is damaged") from None
    _check_inside(path, [name for name, _, _ in listed])
    for i, (name, size, _) in enumerate(listed):  # sizes first: no file is read yet
        file = os.path.join(path, *name.split("/"))
        if not os.path.isfile(file):
            raise _finding(f"checkpoint {path}: file {name} is missing", i, _KINDS[1])
        actual = os.path.getsize(file)
        if actual != size:
            raise _finding(f"checkpoint {path}: file {name} has {actual} bytes, the "
                           f"manifest says {size} (truncated or damaged)", i, _KINDS[2])
    try:
        signature = _signature(path, [_MANIFEST] + [name for name, _, _ in listed])
    except OSError as e:                          # (a file gone since the sizes were compared)
        raise _finding(f"checkpoint {path}: a file cannot be read ({e.strerror})") from None
    if share is None:
        if _VERIFIED.get(os.path.abspath(path)) == signature:
            return signature                      # hashed already, and no file changed since
        mine = range(len(listed))
    else:
        k, processes = share
        mine = verify_shares([size for _, size, _ in listed], processes)[k]
    for i in mine:
        name, _, digest = listed[i]
        try:
            actual = _sha256(os.path.join(path, *name.split("/")))
        except OSError as e:
            raise _finding(f"checkpoint {path}: file {name} cannot be read ({e.strerror})",
                           i, _KINDS[3]) from None
        if actual != digest:
            raise _finding(f"checkpoint {path}: file {name} does not match its SHA-256 in the "
                           "manifest (damaged)", i, _KINDS[4])
    return signature


def _check_inside(path: str, names: list[str]) -> None:
    """Every file the manifest names lies inside the checkpoint: a relative path without `..`
    or empty parts, and no symbolic link on the way leads out of it (checked before any size
    is compared or byte hashed, so a manifest cannot make `verify` read files elsewhere)."""
    root = os.path.realpath(path)
    for name in names:
        parts = name.split("/")
        if os.path.isabs(name) or ".." in parts or "" in parts:
            raise _finding(f"checkpoint {path}: {_MANIFEST} lists {name!r}, which is not a "
                           "file inside the checkpoint: the manifest is damaged")
        # (realpath resolves every link on the way; one that stays inside is harmless)
        real = os.path.realpath(os.path.join(path, *parts))
        if os.path.commonpath([root, real]) != root:
            raise _finding(f"checkpoint {path}: {_MANIFEST} lists {name!r}, which a symbolic "
                           f"link leads to {real}, outside the checkpoint: the manifest is damaged")


def verify_shares(sizes: list[int], processes: int) -> list[list[int]]:
    """The files (positions in `sizes`) each of `processes` processes hashes in
    `verify(shared=True)`: largest first, each to the process with the fewest bytes so far (ties:
    the lowest index); each share in ascending order."""
    shares: list[list[int]] = [[] for _ in range(processes)]
    load = [0] * processes
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        k = min(range(processes), key=lambda k: (load[k], k))
        shares[k].append(i)
        load[k] += sizes[i]
    return [sorted(share) for share in shares]


def is_intact(path: str) -> bool:
    """True when `verify(path)` passes: a complete checkpoint whose files match its manifest."""
    try:
        verify(path)
    except CheckpointError:
        return False
    return True


def read_metadata(path: str, check: bool = True) -> dict:
    """The `metadata` dict saved with the checkpoint (verified first: `verify`, unless `check`
    is False: a look at what it says before the resume verifies it)."""
    return _read_meta(path, check)["metadata"]


def read_host(path: str) -> "HostArrays":
    """The `host` and `host_local` arrays saved with the checkpoint, every process's merged
    (empty if none; verified first: `verify`). host.npz's arrays are read at once; those of the
    processes' parts (host-K.npz) only when asked for (`HostArrays`), so that a process resuming a
    multi-process run reads only the client rows it holds."""
    verify(path)
    out = HostArrays(path)
    try:                                  # the parts the manifest lists (others are ignored)
        with open(os.path.join(path, _MANIFEST), "rb") as f:
            names = list(json.loads(f.read().decode("utf-8"))["files"])
    except FileNotFoundError:             # written before manifests
        names = os.listdir(path)
    parts = sorted(n for n in names if re.fullmatch(_HOST_PART_RE, n))
    for name in ([_HOST] if os.path.exists(os.path.join(path, _HOST)) else []) + parts:
        with _open_npz(path, name) as z:                    # plain arrays only
            arrays = ({k: _read_npz(path, name, z, k) for k in z.files} if name == _HOST
                      else dict.fromkeys(z.files, name))
        clash = sorted(set(out) & set(arrays))
        if clash:
            raise CheckpointError(f"checkpoint {path}: {name} holds arrays that another host file "
                                  f"holds too ({clash[:3]}): the checkpoint is damaged")
        for key, value in arrays.items():
            if name == _HOST:
                out._values[key] = value
            else:
                out._files[key] = value
    return out


class HostArrays(collections.abc.Mapping):
    """A checkpoint's host arrays by name (`read_host`): those of host.npz in memory, those of
    the processes' parts (host-K.npz) read from their file when first asked for and then kept.
    `read_from_parts` names the part arrays read so far."""

    def __init__(self, path: str):
        self.path = path
        self._values: dict[str, np.ndarray] = {}
        self._files: dict[str, str] = {}             # a part's array -> its file, until read

    def __getitem__(self, key: str) -> np.ndarray:
        if key not in self._values:
            name = self._files[key]                   # KeyError for a name no file holds
            with _open_npz(self.path, name) as z:
                self._values[key] = _read_npz(self.path, name, z, key)
        return self._values[key]

    def __contains__(self, key) -> bool:          # (without reading the array)
        return key in self._values or key in self._files

    def __iter__(self):
        return iter(sorted(set(self._values) | set(self._files)))

    def __len__(self) -> int:
        return len(set(self._values) | set(self._files))

    @property
    def read_from_parts(self) -> list[str]:
        return sorted(k for k in self._files if k in self._values)


def _open_npz(path: str, name: str):
    try:
        return np.load(os.path.join(path, name), allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise _unreadable(path, name, e) from None


def _read_npz(path: str, name: str, z, key: str) -> np.ndarray:
    try:
        return z[key]
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise _unreadable(path, name, e) from None


def _unreadable(path: str, name: str, e: BaseException) -> CheckpointError:
    return CheckpointError(f"checkpoint {path}: file {name} is unreadable "
                           f"({type(e).__name__}: {' '.join(str(e).split())})")


def load_numpy(path: str) -> dict[str, np.ndarray]:
    """Every saved leaf as a host numpy array, keyed by its pytree path (PRNG keys as their key
    data): to inspect or compare checkpoints without the state they came from."""
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    meta = _read_meta(path)
    targets = {f"{i:06d}": np.zeros(leaf["stored_shape"], jnp.dtype(leaf["stored_dtype"]))
               for i, leaf in enumerate(meta["leaves"])}
    checkpointer = ocp.Checkpointer(ocp.StandardCheckpointHandler())
    restored = checkpointer.restore(os.path.join(os.path.abspath(path), _ARRAYS),
                                    args=ocp.args.StandardRestore(targets))
    return {leaf["path"] or str(i): np.asarray(restored[f"{i:06d}"])
            for i, leaf in enumerate(meta["leaves"])}


def check_like(path: str, like: Any) -> None:
    """Raises CheckpointError unless the checkpoint at `path` holds `like`'s leaves: as many,
    each of the same shape and dtype (read from meta.json alone: no array is read, so a resume
    can ask before it compiles). Where the leaves are placed does not matter: `restore` puts
    them in `like`'s shardings, whatever devices or processes wrote them.

    Raises:
      CheckpointError: one line naming the first leaf that differs (or the leaf counts).
    """
    meta = _read_meta(path)
    leaves_with_paths = jax.tree_util.tree_flatten_with_path(like)[0]
    if meta["num_leaves"] != len(leaves_with_paths):
        raise CheckpointError(f"checkpoint {path} holds {meta['num_leaves']} arrays but the state "
                              f"has {len(leaves_with_paths)}: it was saved from another "
                              "algorithm or configuration")
    for i, ((key_path, leaf), saved) in enumerate(zip(leaves_with_paths, meta["leaves"])):
        name = jax.tree_util.keystr(key_path)
        shape = tuple(np.shape(leaf))
        dtype = str(leaf.dtype) if hasattr(leaf, "dtype") else str(np.asarray(leaf).dtype)
        if tuple(saved["shape"]) != shape or saved["dtype"] != dtype:
            raise CheckpointError(
                f"checkpoint {path}: state leaf {name or i} is {saved['dtype']}{saved['shape']} "
                f"there but {dtype}{list(shape)} here")


def restore(path: str, like: Any) -> Any:
    """The state saved at `path`, shaped like `like` and placed in `like`'s shardings.

    Args:
      path: a directory written by `save`.
      like: a pytree with the same structure as the saved state: arrays (their sharding is
        used), `jax.ShapeDtypeStruct`s (with or without `sharding`) or numpy arrays (restored as
        numpy).
    Raises:
      CheckpointError: `path` is not a complete checkpoint, or its leaves differ from `like`'s in
        number, shape or dtype (the message names the first leaf that differs).
    """
    import orbax.checkpoint as ocp

    leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(like)
    check_like(path, like)
    targets, kinds = {}, []
    for i, (_, leaf) in enumerate(leaves_with_paths):
        is_key = _is_prng_key(leaf)
        shape = tuple(np.shape(leaf))
        dtype = str(leaf.dtype) if hasattr(leaf, "dtype") else str(np.asarray(leaf).dtype)
        # Every array target names its sharding in this run's devices: orbax otherwise restores
        # into the saved one, whose devices a run on another device or process count lacks.
        sharding = _target_sharding(getattr(leaf, "sharding", None))
        if is_key:
            data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(shape, leaf.dtype))
            # (a key's data has one trailing dimension more, which no sharding splits)
            targets[f"{i:06d}"] = jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)
            kinds.append(("key", leaf.dtype, sharding))
        elif isinstance(leaf, np.ndarray) or np.isscalar(leaf):
            targets[f"{i:06d}"] = np.zeros(shape, dtype)
            kinds.append(("numpy", type(leaf), None))
        else:
            targets[f"{i:06d}"] = jax.ShapeDtypeStruct(shape, leaf.dtype, sharding=sharding)
            kinds.append(("array", None, None))
    checkpointer = ocp.Checkpointer(ocp.StandardCheckpointHandler())
    restored = checkpointer.restore(os.path.join(os.path.abspath(path), _ARRAYS),
                                    args=ocp.args.StandardRestore(targets))
    leaves = []
    for i, (kind, extra, sharding) in enumerate(kinds):
        value = restored[f"{i:06d}"]
        if kind == "key":
            value = jax.random.wrap_key_data(value, impl=_key_impl(extra))
            if sharding is not None:
                value = transfer.put_sharded(value, sharding)
        elif kind == "numpy":
            value = np.asarray(value)
            if extra is not np.ndarray and np.ndim(value) == 0:
                value = extra(value.item()) if extra in (int, float, bool) else value
        leaves.append(value)
    return jax.tree_util.tree_unflatten(treedef, leaves)


# ----------------------------------------------------------------------------------------------


def _target_sharding(sharding):
    """The sharding an array leaf is restored into: `like`'s, or, where it names none in a
    single process, this process's first device (where a new array goes), so that a sharding
    of this run's devices is always named (`restore`). Over several processes a leaf without
    one keeps the saved placement, which needs the writer's devices (the runner's state always
    names its shardings)."""
    if sharding is not None or jax.process_count() > 1:
        return sharding
    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])


def _is_prng_key(leaf) -> bool:
    dtype = getattr(leaf, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _key_impl(dtype):
    """The PRNG implementation of a key dtype (None: JAX's default)."""
    return getattr(dtype, "_impl", None)


def _read_meta(path: str, check: bool = True) -> dict:
    """meta.json, after `verify(path)` unless `check` is False."""
    file = os.path.join(path, _META)
    if check:
        verify(path)
    if not is_complete(path):
        raise CheckpointError(f"{path} is not a complete checkpoint (no {_META} or {_ARRAYS}/)")
    try:
        with open(file, "rb") as f:
            meta = json.loads(f.read().decode("utf-8"))
        if not isinstance(meta, dict):
            raise ValueError(f"a JSON {type(meta).__name__}, not an object")
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: file {_META} is unreadable ({type(e).__name__}: "
                              f"{' '.join(str(e).split())})") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path} has format {meta.get('format')}, expected {FORMAT}")
    return meta


def _write_manifest(directory: str) -> None:
    """manifest.json in `directory`: every file below it (but itself) with its size and SHA-256,
    written to a temporary name, flushed and renamed, so it is either absent or whole."""
    files = {}
    for root, dirs, names in os.walk(directory):
        dirs.sort()
        for name in sorted(names):
            file = os.path.join(root, name)
            rel = os.path.relpath(file, directory).replace(os.sep, "/")
            if rel == _MANIFEST:
                continue
            files[rel] = {"size": os.path.getsize(file), "sha256": _sha256(file)}
    tmp = os.path.join(directory, f".{_MANIFEST}.tmp")
    with open(tmp, "w") as f:
        json.dump({"format": FORMAT, "hash": "sha256", "files": files}, f, indent=1)
        _flush(f)
    os.replace(tmp, os.path.join(directory, _MANIFEST))


# Checkpoints whose hashes matched, with the (size, mtime, inode) of each of their files then:
# restoring reads the metadata, the host arrays and the arrays, and each verifies first; a file
# that has changed since (any write updates its mtime) is hashed again.
_VERIFIED: dict[str, tuple] = {}


def _signature(path: str, names: list[str]) -> tuple:
    out = []
    for name in names:
        st = os.stat(os.path.join(path, *name.split("/")))
        out.append((name, st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(out)


def _sha256(file: str) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(_HASH_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def _remove_stale_temporaries(parent: str, name: str) -> None:
    """Removes what interrupted saves of `name` left behind (hidden `.NAME.tmp-*` / `.old-*`)."""
    for entry in os.listdir(parent):
        if entry.startswith(f".{name}.tmp-") or entry.startswith(f".{name}.old-"):
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


def _flush(f) -> None:
    f.flush()
    os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _json_default(o):
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)
