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
