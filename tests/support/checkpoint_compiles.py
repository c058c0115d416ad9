"""What a checkpoint save and restore compile, on this process's devices: the scenario of
tests/runner/test_checkpoint_cost.py, run in the test process (one device) and, as
`python tests/support/checkpoint_compiles.py DIR` with FEDJAX_PFL_CPU_DEVICES=2, on two devices
(the layout where orbax's replica-parallel writing sliced every replicated leaf on each device).

The state mixes what a run's state holds: replicated server leaves (float32, bfloat16, an int32
scalar, a PRNG key), client rows sharded over the devices (float32, bool, one key per client), a
numpy leaf, and, as under host state placement, host arrays beside them (`host=`, `host_local=`).
Every value is built on the host first, so what is compared after the restore is that host copy,
not anything the checkpoint code produced."""

from __future__ import annotations

import json
import sys

import numpy as np


def host_values(devices: int) -> dict:
    """The state's values as numpy (keys as their raw uint32 data), rows a multiple of `devices`."""
    import ml_dtypes

    rng = np.random.default_rng(7)
    n = 2 * devices
    return {
        "server": {"w": rng.normal(size=(6, 4)).astype(np.float32),
                   "b": rng.normal(size=(4,)).astype(ml_dtypes.bfloat16),
                   "round": np.int32(11),
                   "key": np.array([0, 42], np.uint32)},
        "clients": {"w": rng.normal(size=(n, 3)).astype(np.float32),
                    "flags": rng.integers(0, 2, size=(n,)).astype(bool),
                    "keys": rng.integers(0, 2**32, size=(n, 2), dtype=np.uint32)},
        "table": rng.integers(0, 9, size=(2, 3)),
    }


def place(values: dict, replicated, rows) -> dict:
    """`values` on the devices: the server leaves under `replicated`, the client rows under
    `rows` (both None: numpy, as `like` of an abstract-free restore would be)."""
    import jax

    key = lambda data, sharding: jax.device_put(jax.random.wrap_key_data(data), sharding)
    s, c = values["server"], values["clients"]
    return {
        "server": {"w": jax.device_put(s["w"], replicated), "b": jax.device_put(s["b"], replicated),
                   "round": jax.device_put(s["round"], replicated),
                   "key": key(s["key"], replicated)},
        "clients": {"w": jax.device_put(c["w"], rows), "flags": jax.device_put(c["flags"], rows),
                    "keys": key(c["keys"], rows)},
        "table": values["table"],
    }


def abstract(state: dict, swap: bool, replicated, rows) -> dict:
    """`state` as `jax.ShapeDtypeStruct`s; `swap`: every leaf in the other sharding (the server
    leaves split over the devices where their first dimension allows, the client rows
    replicated): a restore into another layout."""
    import jax

    def one(path, leaf):
        if isinstance(leaf, np.ndarray):
            return leaf
        server = path[0].key == "server"
        sharding = leaf.sharding
        if swap:
            splittable = leaf.ndim and leaf.shape[0] % len(jax.devices()) == 0
            sharding = (rows if splittable else replicated) if server else replicated
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

    return jax.tree_util.tree_map_with_path(one, state)


def mismatches(restored: dict, values: dict) -> list[str]:
    """The leaves of `restored` whose bits, dtype or key-ness differ from `values` (host)."""
    import jax

    out = []
    flat_values = dict(jax.tree_util.tree_flatten_with_path(values)[0])
    for path, leaf in jax.tree_util.tree_flatten_with_path(restored)[0]:
        want = np.asarray(flat_values[path])
        is_key = jax.dtypes.issubdtype(getattr(leaf, "dtype", np.int8), jax.dtypes.prng_key)
        got = np.asarray(jax.random.key_data(leaf) if is_key else leaf)
        name = jax.tree_util.keystr(path)
        if (("key" in name) != is_key or got.dtype != want.dtype or got.shape != want.shape
                or got.tobytes() != want.tobytes()):
            out.append(name)
    return out


def scenario(directory: str) -> dict:
    """Saves and restores (into the saved shardings, and into swapped ones) the state, each inside
    `compiles.record()`; returns the programs each compiled, a probe's count (one jitted op, to
    show the recorder sees programs here), the leaves that came back different and whether every
    restored leaf has the sharding asked for."""
    import os

    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from fedjax_pfl import checkpoint, compiles

    mesh = Mesh(np.asarray(jax.devices()), ("clients",))
    replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("clients"))
    values = host_values(len(jax.devices()))
    state = place(values, replicated, rows)
    host = {"sampled": np.arange(5)}
    host_local = {"store/rows": values["clients"]["w"] + 1}
    path = os.path.join(directory, "c")
    like_same = abstract(state, False, replicated, rows)
    like_other = abstract(state, True, replicated, rows)
    programs: dict[str, list[str]] = {}
    with compiles.record() as log:
        checkpoint.save(path, state, metadata={"round": 3}, host=host, host_local=host_local)
    programs["save"] = log.names
    with compiles.record() as log:
        checkpoint.save(path, state, metadata={"round": 4}, host=host, host_local=host_local)
    programs["save_again"] = log.names
    restored = {}
    for name, like in (("restore", state), ("restore_abstract", like_same),
                       ("restore_other_layout", like_other)):
        with compiles.record() as log:
            restored[name] = checkpoint.restore(path, like)
            back_host = checkpoint.read_host(path)
        programs[name] = log.names
    with compiles.record() as log:
        jax.jit(lambda x: x * 2)(state["server"]["w"]).block_until_ready()
    want_shardings = jax.tree.leaves(like_other, is_leaf=lambda x: isinstance(
        x, (jax.ShapeDtypeStruct, np.ndarray)))
    got_shardings = jax.tree.leaves(restored["restore_other_layout"])
    return {
        "devices": len(jax.devices()),
        "programs": programs,
        "probe": log.names,
        "different": {name: mismatches(r, values) for name, r in restored.items()},
        "host_equal": (np.array_equal(back_host["sampled"], host["sampled"])
                       and back_host["store/rows"].tobytes() == host_local["store/rows"].tobytes()),
        # (equivalent, not equal: a restored key's data sharding says P(None) where P() was asked)
        "shardings_as_asked": all(
            isinstance(w, np.ndarray) or g.sharding.is_equivalent_to(w.sharding, len(w.shape))
            for w, g in zip(want_shardings, got_shardings, strict=True)),
    }


if __name__ == "__main__":
    import fedjax_pfl

    fedjax_pfl.use_cpu_cores()
    print(json.dumps(scenario(sys.argv[1])))
