"""Guards for fedjax_pfl.checkpoint (issue 30, item 10): a leaf restored into a target of another
dtype is refused by name instead of being cast, and a PRNG key of a non-default implementation
comes back as that implementation, with the saved key bits and the saved random stream.

Expected values come from the saved arrays themselves (their bytes) and from JAX's PRNG called
on the original key, never from a second restore."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_pfl import checkpoint


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
