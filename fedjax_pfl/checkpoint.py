"""Checkpoints of a run's state: orbax writes the arrays, a rename commits the directory.

    from fedjax_pfl import checkpoint
    checkpoint.save("ckpt/round_10", state)                  # any pytree of arrays
    state = checkpoint.restore("ckpt/round_10", like=state)  # same structure, shapes, dtypes

Layout of a checkpoint directory `path`:

    arrays/      orbax (OCDBT) with one entry per pytree leaf, named by its flat index
    meta.json    format version, number of leaves, each leaf's path/shape/dtype, `metadata`
    host.npz     optional host-side numpy arrays (`host=`), e.g. a run's per-round logs

Atomicity: everything is written into a hidden sibling `.NAME.tmp-PID-…`, flushed, and the
directory is then renamed to `path` in one `os.rename`. A write that is interrupted (Ctrl-C,
kill, full disk) leaves only the hidden temporary, which `restore` never reads and the next
`save` into the same parent removes; a directory named `path` is always complete.

`restore(path, like=...)` takes the structure, shapes and dtypes from `like` (arrays or
`jax.ShapeDtypeStruct`s) and puts every array directly in `like`'s sharding, so a client state
sharded over devices is read shard by shard; PRNG key arrays are stored as their key data and
rebuilt; bfloat16 leaves stay bfloat16.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from typing import Any

import jax
import numpy as np

FORMAT = 1
_META = "meta.json"
_HOST = "host.npz"
_ARRAYS = "arrays"


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, or does not match the state it is restored into."""


def save(path: str, state: Any, *, metadata: dict | None = None,
         host: dict[str, np.ndarray] | None = None) -> str:
    """Writes `state` (a pytree of arrays) to the directory `path`, atomically.

    Args:
      path: the checkpoint directory; replaced if it exists.
      state: any pytree whose leaves are jax arrays (sharded or not, PRNG keys included), numpy
        arrays or Python scalars.
      metadata: JSON-serialisable dict stored in meta.json (read back by `read_metadata`).
      host: numpy arrays stored in host.npz (read back by `read_host`).
    Returns:
      The absolute path written.
    """
    import orbax.checkpoint as ocp

    path = os.path.abspath(path)
    parent, name = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    _remove_stale_temporaries(parent, name)
    tmp = os.path.join(parent, f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
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
        os.makedirs(tmp)
        checkpointer = ocp.Checkpointer(ocp.StandardCheckpointHandler())
        checkpointer.save(os.path.join(tmp, _ARRAYS), args=ocp.args.StandardSave(arrays))
        if host:
            with open(os.path.join(tmp, _HOST), "wb") as f:
                np.savez(f, **host)
                _flush(f)
        with open(os.path.join(tmp, _META), "w") as f:
            json.dump({"format": FORMAT, "num_leaves": len(described), "leaves": described,
                       "metadata": metadata or {}}, f, indent=1, default=_json_default)
            _flush(f)
        if os.path.lexists(path):                     # replace: move the old one aside first
            old = os.path.join(parent, f".{name}.old-{uuid.uuid4().hex[:8]}")
            os.rename(path, old)
            os.rename(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, path)                       # the commit
        _fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def is_complete(path: str) -> bool:
    """True when `path` is a committed checkpoint (the rename happened)."""
    return os.path.isfile(os.path.join(path, _META)) and os.path.isdir(os.path.join(path, _ARRAYS))


def read_metadata(path: str) -> dict:
    """The `metadata` dict saved with the checkpoint."""
    return _read_meta(path)["metadata"]


def read_host(path: str) -> dict[str, np.ndarray]:
    """The `host` arrays saved with the checkpoint ({} if none)."""
    file = os.path.join(path, _HOST)
    if not os.path.exists(file):
        return {}
    with np.load(file) as z:
        return {k: z[k] for k in z.files}


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

    meta = _read_meta(path)
    leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(like)
    if meta["num_leaves"] != len(leaves_with_paths):
        raise CheckpointError(f"checkpoint {path} holds {meta['num_leaves']} arrays but the state "
                              f"has {len(leaves_with_paths)}: it was saved from another "
                              "algorithm or configuration")
    targets, kinds = {}, []
    for i, ((key_path, leaf), saved) in enumerate(zip(leaves_with_paths, meta["leaves"])):
        name = jax.tree_util.keystr(key_path)
        is_key = _is_prng_key(leaf)
        shape = tuple(np.shape(leaf))
        dtype = str(leaf.dtype) if hasattr(leaf, "dtype") else str(np.asarray(leaf).dtype)
        if tuple(saved["shape"]) != shape or saved["dtype"] != dtype:
            raise CheckpointError(
                f"checkpoint {path}: state leaf {name or i} is {saved['dtype']}{saved['shape']} "
                f"there but {dtype}{list(shape)} here")
        sharding = getattr(leaf, "sharding", None)
        if is_key:
            data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(shape, leaf.dtype))
            targets[f"{i:06d}"] = jax.ShapeDtypeStruct(data.shape, data.dtype)
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
                value = jax.device_put(value, sharding)
        elif kind == "numpy":
            value = np.asarray(value)
            if extra is not np.ndarray and np.ndim(value) == 0:
                value = extra(value.item()) if extra in (int, float, bool) else value
        leaves.append(value)
    return jax.tree_util.tree_unflatten(treedef, leaves)


# ----------------------------------------------------------------------------------------------


def _is_prng_key(leaf) -> bool:
    dtype = getattr(leaf, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _key_impl(dtype):
    """The PRNG implementation of a key dtype (None: JAX's default)."""
    return getattr(dtype, "_impl", None)


def _read_meta(path: str) -> dict:
    file = os.path.join(path, _META)
    if not is_complete(path):
        raise CheckpointError(f"{path} is not a complete checkpoint (no {_META} or {_ARRAYS}/)")
    with open(file) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path} has format {meta.get('format')}, expected {FORMAT}")
    return meta


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
