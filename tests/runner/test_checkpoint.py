"""fedjax_pfl.checkpoint: exact round trips (bfloat16, PRNG keys, NamedTuples, numpy), restoring
into the target's sharding, clear mismatch errors, and atomic commits."""

import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_pfl import checkpoint


class Clients(NamedTuple):
    x: dict
    flags: jax.Array


class State(NamedTuple):
    clients: Clients
    key: jax.Array
    opt: object          # None: not a leaf
    round: jax.Array
    host: np.ndarray


def _state(seed=0):
    rng = np.random.default_rng(seed)
    return State(
        clients=Clients({"w": jnp.asarray(rng.normal(size=(4, 3)), jnp.bfloat16),
                         "b": jnp.asarray(rng.normal(size=(4,)), jnp.float32)},
                        jnp.asarray([True, False, True, True])),
        key=jax.random.key(seed), opt=None, round=jnp.int32(7 + seed),
        host=rng.integers(0, 9, size=(2, 2)))


def _assert_same(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(la, lb, strict=True):
        assert x.dtype == y.dtype, (x.dtype, y.dtype)
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_host_arrays_of_every_process_are_read_back_together(tmp_path):
    """One process: `host_local` joins host.npz. Several: each process's part is its own
    host-K.npz (written here by hand in that layout, listed in the manifest), read back merged
    with process 0's `host`, each part's arrays only when asked for; two parts holding the same
    name are refused."""
    path = str(tmp_path / "c")
    checkpoint.save(path, {"w": np.arange(2)}, host={"a": np.arange(3)},
                    host_local={"store/ids": np.array([4])})
    assert os.listdir(path).count("host.npz") == 1 and not any(
        n.startswith("host-") for n in os.listdir(path))
    back = checkpoint.read_host(path)
    assert sorted(back) == ["a", "store/ids"] and back["store/ids"].tolist() == [4]
    for k, ids in ((0, [1, 2]), (1, [7])):
        np.savez(os.path.join(path, f"host-{k:05d}.npz"), **{f"store.p{k}/ids": np.array(ids)})
    checkpoint._write_manifest(path)
    back = checkpoint.read_host(path)
    assert sorted(back) == ["a", "store.p0/ids", "store.p1/ids", "store/ids"]
    # A part's arrays are read when first asked for (a process reads only the parts it needs).
    assert "store.p0/ids" in back and "store.p9/ids" not in back and back.read_from_parts == []
    assert back["store.p1/ids"].tolist() == [7] and back.read_from_parts == ["store.p1/ids"]
    assert back["store.p0/ids"].tolist() == [1, 2]
    assert back.read_from_parts == ["store.p0/ids", "store.p1/ids"]
    np.savez(os.path.join(path, "host-00002.npz"), **{"store.p1/ids": np.array([0])})
    checkpoint._write_manifest(path)
    with pytest.raises(checkpoint.CheckpointError, match="another host file holds too"):
        checkpoint.read_host(path)


def test_round_trip_is_exact(tmp_path):
    state = _state()
    checkpoint.save(str(tmp_path / "c"), state, metadata={"round": 7}, host={"a": np.arange(3)})
    like = _state(seed=1)                       # same shapes, other values
    back = checkpoint.restore(str(tmp_path / "c"), like=like)
    _assert_same(back, state)
    assert isinstance(back.host, np.ndarray) and back.clients.x["w"].dtype == jnp.bfloat16
    assert checkpoint.read_metadata(str(tmp_path / "c")) == {"round": 7}
    np.testing.assert_array_equal(checkpoint.read_host(str(tmp_path / "c"))["a"], np.arange(3))
    # The restored key draws what the saved key draws.
    assert jax.random.uniform(back.key) == jax.random.uniform(state.key)


def test_restore_into_abstract_target_uses_its_sharding(tmp_path):
    state = _state()
    checkpoint.save(str(tmp_path / "c"), state)
    device = jax.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    abstract = jax.tree.map(
        lambda x: x if isinstance(x, np.ndarray) else jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                                          sharding=sharding), state)
    back = checkpoint.restore(str(tmp_path / "c"), like=abstract)
    _assert_same(back, state)
    assert back.clients.x["w"].sharding == sharding


_TWO_DEVICES = """
import sys
import fedjax_pfl
fedjax_pfl.use_cpu_cores()
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from fedjax_pfl import checkpoint
assert jax.device_count() == 2
rows = NamedSharding(Mesh(np.asarray(jax.devices()), ("clients",)), P("clients"))
# the one-device checkpoint, restored into shardings over both devices (the key's too)
like = {"keys": jax.ShapeDtypeStruct((4,), jax.random.key(0).dtype, sharding=rows),
        "w": jax.ShapeDtypeStruct((4, 3), jnp.float32, sharding=rows)}
back = checkpoint.restore(sys.argv[1], like)
assert back["keys"].sharding == rows and back["w"].sharding == rows
np.save(sys.argv[2] + ".keys.npy", np.asarray(jax.random.key_data(back["keys"])))
np.save(sys.argv[2] + ".w.npy", np.asarray(back["w"]))
# a checkpoint of the same arrays written sharded over both devices
checkpoint.save(sys.argv[2], jax.device_put(back, rows))
"""


@pytest.mark.slow
def test_a_checkpoint_restores_on_another_device_count(tmp_path):
    """A checkpoint written on one device is restored on two (a subprocess of 2 CPU devices)
    into shardings over both, and that process's checkpoint, written sharded over its two
    devices, is restored here on one device: into `like`'s sharding, or, where `like` names none
    (abstract shapes of a one-device run), this process's device. PRNG keys included: their data
    is restored in the key's sharding. The values are the saved ones, bit for bit."""
    import subprocess
    import sys

    import helpers

    keys = jax.random.split(jax.random.key(3), 4)
    w = jnp.arange(12, dtype=jnp.float32).reshape(4, 3) / 7
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    checkpoint.save(one, {"keys": keys, "w": w})
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "FEDJAX_PFL_CPU_DEVICES": "2", "PYTHONPATH": root,
           "XLA_FLAGS": helpers.without_device_count(os.environ.get("XLA_FLAGS", ""))}
    proc = subprocess.run([sys.executable, "-c", _TWO_DEVICES, one, two], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    np.testing.assert_array_equal(np.load(two + ".keys.npy"), np.asarray(jax.random.key_data(keys)))
    np.testing.assert_array_equal(np.load(two + ".w.npy"), np.asarray(w))
    assert jax.device_count() == 1
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    for like in ({"keys": jax.ShapeDtypeStruct((4,), keys.dtype), "w": jax.ShapeDtypeStruct((4, 3), w.dtype)},
                 {"keys": keys, "w": w}):
        back = checkpoint.restore(two, like)
        assert back["keys"].sharding == device and back["w"].sharding == device
        _assert_same(back, {"keys": keys, "w": w})


def test_mismatched_target_names_the_leaf(tmp_path):
    checkpoint.save(str(tmp_path / "c"), _state())
    wrong = _state()._replace(round=jnp.zeros(3, jnp.int32))
    with pytest.raises(checkpoint.CheckpointError, match=r"\.round is int32\[\] there but int32\[3\]"):
        checkpoint.restore(str(tmp_path / "c"), like=wrong)
    with pytest.raises(checkpoint.CheckpointError, match="holds 6 arrays but the state has 1"):
        checkpoint.restore(str(tmp_path / "c"), like={"a": jnp.zeros(2)})
    with pytest.raises(checkpoint.CheckpointError, match="not a complete checkpoint"):
        checkpoint.restore(str(tmp_path / "nothing"), like=_state())


def test_an_interrupted_write_never_leaves_a_loadable_checkpoint(tmp_path, monkeypatch):
    import orbax.checkpoint as ocp

    path = str(tmp_path / "c")
    checkpoint.save(path, _state(seed=0))            # an older, complete checkpoint

    def dies_while_writing(self, directory, *args, **kwargs):
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "partial"), "w") as f:
            f.write("half")
        raise KeyboardInterrupt                       # Ctrl-C in the middle of the write

    monkeypatch.setattr(ocp.Checkpointer, "save", dies_while_writing)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(path, _state(seed=1))
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(str(tmp_path / "new"), _state(seed=1))
    monkeypatch.undo()
    assert not os.path.exists(tmp_path / "new") and not checkpoint.is_complete(str(tmp_path / "new"))
    _assert_same(checkpoint.restore(path, like=_state(seed=1)), _state(seed=0))   # the old one
    # A hard kill (no cleanup at all) leaves only a hidden temporary; the next save removes it.
    os.makedirs(tmp_path / ".c.tmp-1-dead")
    checkpoint.save(path, _state(seed=2))
    assert sorted(os.listdir(tmp_path)) == ["c"]
    _assert_same(checkpoint.restore(path, like=_state()), _state(seed=2))


def test_load_numpy_reads_without_a_target(tmp_path):
    state = _state()
    checkpoint.save(str(tmp_path / "c"), state)
    arrays = checkpoint.load_numpy(str(tmp_path / "c"))
    assert arrays[".round"] == 7 and arrays[".clients.x['w']"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(arrays[".key"], jax.random.key_data(state.key))


# -- verification: a manifest of sizes and SHA-256s, checked before any array is read ------------


def _files(path) -> dict[str, bytes]:
    """Every file under the checkpoint directory, by its '/'-separated relative name."""
    out = {}
    for root, _, names in os.walk(path):
        for name in names:
            file = os.path.join(root, name)
            out[os.path.relpath(file, path).replace(os.sep, "/")] = open(file, "rb").read()
    return out


def _no_array_reads(monkeypatch):
    """Makes any orbax restore fail the test: verification must stop a damaged checkpoint first."""
    import orbax.checkpoint as ocp

    def forbidden(*a, **k):
        raise AssertionError("orbax restore was called on a damaged checkpoint")
    monkeypatch.setattr(ocp.Checkpointer, "restore", forbidden)


def test_processes_verify_a_checkpoint_in_shares_of_about_equal_bytes():
    """`verify(shared=True)` over P processes: each hashes the files of its share, largest first
    to the process with the fewest bytes. Sizes 5, 1, 9, 3, 3 over two processes: 9 → p0, 5 → p1,
    3 → p1 (5 < 9), 3 → p1 (8 < 9), 1 → p0 (9 < 11): shares {1, 2} (10 bytes) and {0, 3, 4}
    (11 bytes); one process hashes every file."""
    assert checkpoint.verify_shares([5, 1, 9, 3, 3], 2) == [[1, 2], [0, 3, 4]]
    assert checkpoint.verify_shares([5, 1, 9, 3, 3], 1) == [[0, 1, 2, 3, 4]]
    assert checkpoint.verify_shares([2], 3) == [[0], [], []]


def test_manifest_lists_every_file_with_size_and_sha256(tmp_path):
    import hashlib
    import json

    path = str(tmp_path / "c")
    checkpoint.save(path, _state(), host={"a": np.arange(3)})
    files = _files(path)
    manifest = json.loads(files.pop("manifest.json"))["files"]
    # Every other file, arrays included, with the size and the SHA-256 hashlib computes here.
    assert set(manifest) == set(files) and {"meta.json", "host.npz"} <= set(files)
    assert any(name.startswith("arrays/") for name in manifest)
    for name, data in files.items():
        assert manifest[name] == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert checkpoint.is_intact(path)
    _assert_same(checkpoint.restore(path, like=_state(seed=1)), _state())
    assert checkpoint.is_intact(path)          # restoring leaves the files as the manifest says


def _largest_array_file(path) -> str:
    files = {n: len(d) for n, d in _files(path).items() if n.startswith("arrays/") and "/d/" in n}
    return max(files, key=files.get)


def _truncate(file):
    data = open(file, "rb").read()
    open(file, "wb").write(data[: len(data) // 2])


def _flip(file):
    data = bytearray(open(file, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(file, "wb").write(bytes(data))


@pytest.mark.parametrize("damage,target", [
    ("truncate", "array"), ("truncate", "host.npz"), ("delete", "meta.json"),
    ("delete", "array"), ("flip", "array"), ("flip", "host.npz"),
])
def test_damaged_checkpoint_is_refused_naming_the_file(tmp_path, monkeypatch, damage, target):
    path = str(tmp_path / "c")
    checkpoint.save(path, _state(), metadata={"round": 7}, host={"a": np.arange(1000)})
    checkpoint.verify(path)                    # intact (and hashed once: a later change is seen)
    name = _largest_array_file(path) if target == "array" else target
    file = os.path.join(path, *name.split("/"))
    {"truncate": _truncate, "delete": os.remove, "flip": _flip}[damage](file)
    _no_array_reads(monkeypatch)
    with pytest.raises(checkpoint.CheckpointError) as exc:
        checkpoint.verify(path)
    message = str(exc.value)
    assert "\n" not in message and f"file {name} " in message and path in message
    assert {"truncate": "truncated", "delete": "is missing", "flip": "SHA-256"}[damage] in message
    assert not checkpoint.is_intact(path)
    for read in (lambda: checkpoint.restore(path, like=_state(seed=1)),
                 lambda: checkpoint.read_host(path), lambda: checkpoint.read_metadata(path),
                 lambda: checkpoint.load_numpy(path)):
        with pytest.raises(checkpoint.CheckpointError, match=f"file {name} "):
            read()


def test_checkpoint_without_manifest_is_accepted_as_before(tmp_path):
    """A checkpoint written before manifests (no manifest.json, no "manifest" in meta.json)
    restores as it always did; one whose meta.json says it has a manifest, but lacks it, does not."""
    import json

    path = str(tmp_path / "c")
    checkpoint.save(path, _state(), host={"a": np.arange(3)})
    os.remove(os.path.join(path, "manifest.json"))
    with pytest.raises(checkpoint.CheckpointError, match="manifest.json is missing"):
        checkpoint.verify(path)
    meta_file = os.path.join(path, "meta.json")
    meta = json.load(open(meta_file))
    del meta["manifest"]
    json.dump(meta, open(meta_file, "w"))
    assert checkpoint.is_intact(path)
    _assert_same(checkpoint.restore(path, like=_state(seed=1)), _state())
    np.testing.assert_array_equal(checkpoint.read_host(path)["a"], np.arange(3))


def test_unreadable_manifest_or_metadata_is_one_line(tmp_path):
    path = str(tmp_path / "c")
    checkpoint.save(path, _state())
    open(os.path.join(path, "manifest.json"), "w").write('{"files": {"meta.json": ')   # cut short
    with pytest.raises(checkpoint.CheckpointError, match="manifest.json is unreadable") as exc:
        checkpoint.verify(path)
    assert "\n" not in str(exc.value)

# -- Guards for fedjax_pfl.checkpoint (issue 30, item 10): a leaf restored into a target of another ----


@pytest.mark.parametrize("target_dtype", [jnp.bfloat16, jnp.float16, jnp.int32])
def test_a_leaf_of_another_dtype_is_refused_not_cast(tmp_path, target_dtype):
    """checkpoint.restore's contract: `like` fixes the dtypes, and a leaf whose saved dtype differs
    raises CheckpointError naming the leaf and both dtypes. A silent cast would lose bits: the
    float32 value 1 + 2⁻²⁰ is not representable in bfloat16, float16 or int32."""
    saved = {"w": jnp.asarray([1.0 + 2.0 ** -20, -3.25], jnp.float32), "n": jnp.int32(4)}
    path = str(tmp_path / "c")
    checkpoint.save(path, saved)
    like = {"w": jnp.zeros(2, target_dtype), "n": jnp.int32(0)}
    name = jnp.dtype(target_dtype).name
    with pytest.raises(checkpoint.CheckpointError,
                       match=rf"\['w'\] is float32\[2\] there but {name}\[2\] here"):
        checkpoint.restore(path, like=like)
    # The same target with the saved dtype restores the saved bits exactly.
    back = checkpoint.restore(path, like={"w": jnp.zeros(2, jnp.float32), "n": jnp.int32(0)})
    assert back["w"].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(back["w"]).view(np.uint32),
                                  np.asarray([1.0 + 2.0 ** -20, -3.25], np.float32).view(np.uint32))


def test_a_numpy_leaf_of_another_dtype_is_refused(tmp_path):
    """Host-side numpy leaves (a run's logs) obey the same rule: int64 saved, int32 asked for."""
    path = str(tmp_path / "c")
    checkpoint.save(path, {"log": np.asarray([2**40, 3], np.int64)})
    with pytest.raises(checkpoint.CheckpointError, match=r"int64\[2\] there but int32\[2\] here"):
        checkpoint.restore(path, like={"log": np.zeros(2, np.int32)})
    back = checkpoint.restore(path, like={"log": np.zeros(2, np.int64)})
    assert back["log"].dtype == np.int64
    np.testing.assert_array_equal(back["log"], [2**40, 3])


@pytest.mark.parametrize("impl", ["rbg", "unsafe_rbg"])
@pytest.mark.slow
def test_a_non_default_prng_key_comes_back_as_its_own_implementation(tmp_path, impl):
    """A key made with jax.random.key(s, impl=...) is stored as its key data (4 uint32 words
    for the rbg family, 2 for the default threefry) and must be rebuilt with the SAME
    implementation: same impl, same key bits, and the same numbers drawn from it (and from its
    splits and folds, the runner's uses). Rebuilt as the default one it would either fail on the
    data's shape or draw another stream."""
    key = jax.random.key(7, impl=impl)
    keys = jax.random.split(jax.random.key(8, impl=impl), 3)
    path = str(tmp_path / "c")
    checkpoint.save(path, {"key": key, "keys": keys})
    like = {"key": jax.random.key(0, impl=impl), "keys": jax.random.split(jax.random.key(0, impl=impl), 3)}
    back = checkpoint.restore(path, like=like)
    for got, want in ((back["key"], key), (back["keys"], keys)):
        assert str(jax.random.key_impl(got)) == str(jax.random.key_impl(want))
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(jax.random.key_data(got)),
                                      np.asarray(jax.random.key_data(want)))
    assert np.asarray(jax.random.key_data(back["key"])).shape == (4,)        # the rbg family's data
    np.testing.assert_array_equal(np.asarray(jax.random.uniform(back["key"], (5,))),
                                  np.asarray(jax.random.uniform(key, (5,))))
    np.testing.assert_array_equal(
        np.asarray(jax.random.normal(jax.random.fold_in(back["keys"][2], 3), (4,))),
        np.asarray(jax.random.normal(jax.random.fold_in(keys[2], 3), (4,))))


def test_a_key_of_one_implementation_is_not_restored_into_another(tmp_path):
    """An rbg key saved and a default (threefry) key asked for: refused by name, since the two
    key types hold different data (4 words against 2) and draw different streams."""
    path = str(tmp_path / "c")
    checkpoint.save(path, {"key": jax.random.key(3, impl="rbg")})
    with pytest.raises(checkpoint.CheckpointError, match=r"\['key'\] is key<rbg>\[\] there but key<fry>\[\] here"):
        checkpoint.restore(path, like={"key": jax.random.key(0)})


# -- a manifest cannot name a file outside its checkpoint ---------------------------------------


def _point_outside(path, outside, how) -> str:
    """Makes the checkpoint at `path` name a file of `outside` (a directory beside it) in its
    manifest, by `how`, with the size and SHA-256 of that file, so that only the check that the
    file lies inside the checkpoint can refuse it. Returns the manifest entry."""
    import hashlib
    import json
    import shutil

    manifest_file = os.path.join(path, "manifest.json")
    manifest = json.load(open(manifest_file))
    os.makedirs(outside)
    if how in ("dotdot", "absolute"):
        stray = os.path.join(outside, "stray.bin")
        open(stray, "wb").write(b"not a checkpoint's")
        entry = (os.path.relpath(stray, path).replace(os.sep, "/") if how == "dotdot"
                 else os.path.abspath(stray))
        assert (".." in entry.split("/")) == (how == "dotdot") and os.path.isabs(entry) == (how == "absolute")
        data = open(stray, "rb").read()
        manifest["files"][entry] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        json.dump(manifest, open(manifest_file, "w"))
        return entry
    if how == "file_symlink":        # host.npz moved out, a link to it left in its place
        entry = "host.npz"
        shutil.move(os.path.join(path, entry), os.path.join(outside, entry))
        os.symlink(os.path.join(outside, entry), os.path.join(path, entry))
    else:                             # the whole arrays/ directory moved out, a link left
        shutil.move(os.path.join(path, "arrays"), os.path.join(outside, "arrays"))
        os.symlink(os.path.join(outside, "arrays"), os.path.join(path, "arrays"))
        entry = sorted(n for n in manifest["files"] if n.startswith("arrays/"))[0]
    return entry                      # (sizes and SHA-256s as listed: the files are the same)


@pytest.mark.parametrize("how", ["dotdot", "absolute", "file_symlink", "directory_symlink"])
def test_a_manifest_naming_a_file_outside_the_checkpoint_is_refused(tmp_path, monkeypatch, how):
    """A manifest entry with `..`, an absolute path, or reached through a symbolic link that
    leads out of the checkpoint (a file, or a directory on the way): one line naming the
    checkpoint and the entry, before any size is compared, byte hashed or array read."""
    path = str(tmp_path / "c")
    checkpoint.save(path, _state(), host={"a": np.arange(1000)})
    entry = _point_outside(path, str(tmp_path / "elsewhere"), how)
    hashed = []
    monkeypatch.setattr(checkpoint, "_sha256", lambda f: hashed.append(f) or "")
    _no_array_reads(monkeypatch)
    with pytest.raises(checkpoint.CheckpointError) as exc:
        checkpoint.verify(path)
    message = str(exc.value)
    assert "\n" not in message and path in message and repr(entry) in message
    assert "outside the checkpoint" in message or "not a file inside" in message
    assert hashed == [] and not checkpoint.is_intact(path)
    with pytest.raises(checkpoint.CheckpointError, match="manifest is damaged"):
        checkpoint.restore(path, like=_state(seed=1))


def test_symbolic_links_that_stay_inside_the_checkpoint_are_accepted(tmp_path):
    """A link whose target lies inside the checkpoint (e.g. a file system that deduplicates
    with links) reads the checkpoint's own bytes: it verifies and restores."""
    import shutil

    path = str(tmp_path / "c")
    checkpoint.save(path, _state(), host={"a": np.arange(3)})
    shutil.move(os.path.join(path, "host.npz"), os.path.join(path, "host.copy"))
    os.symlink("host.copy", os.path.join(path, "host.npz"))
    checkpoint.verify(path)
    np.testing.assert_array_equal(checkpoint.read_host(path)["a"], np.arange(3))
    _assert_same(checkpoint.restore(path, like=_state(seed=1)), _state())
