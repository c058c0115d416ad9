"""models/split.py: leaf paths, the head of each model, masks, split/merge and row flattening."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import tree_equal

from fedjax_pfl import core, models
from fedjax_pfl.models import split as S


def shapes(name, input_shape, classes=10):
    return jax.eval_shape(models.get(name, input_shape, classes).init, jax.random.key(0))


@pytest.mark.parametrize("name,input_shape,head", [
    ("mlp", (8, 8, 1), ["Dense_1/bias", "Dense_1/kernel"]),
    ("cnn", (28, 28, 1), ["Dense_1/bias", "Dense_1/kernel"]),
    ("resnet9", (32, 32, 3), ["Dense_0/bias", "Dense_0/kernel"]),
    ("logreg", (8, 8, 1), ["Dense_0/bias", "Dense_0/kernel"]),        # the head is the model
])
def test_head_is_the_last_dense_layer(name, input_shape, head):
    params = shapes(name, input_shape)
    mask = S.personal_mask(params, "head")
    paths = S.leaf_paths(params)
    assert [p for p, m in zip(paths, jax.tree.leaves(mask)) if m] == head


def test_numbers_compare_as_numbers_and_flat_trees():
    params = {f"Dense_{i}": {"kernel": jnp.zeros((2, 2))} for i in (0, 2, 10)}
    assert S.head_pattern(params) == "^Dense_10/"
    flat = {"w": jnp.zeros(3), "b": jnp.zeros(1)}
    assert jax.tree.leaves(S.personal_mask(flat, "head")) == [True, True]


def test_patterns_all_none_regex_and_errors():
    params = shapes("mlp", (8, 8, 1))
    assert all(jax.tree.leaves(S.personal_mask(params, "all")))
    assert not any(jax.tree.leaves(S.personal_mask(params, "none")))
    bias = S.personal_mask(params, r"/bias$")
    assert [p for p, m in zip(S.leaf_paths(params), jax.tree.leaves(bias)) if m] == \
        ["Dense_0/bias", "Dense_1/bias"]
    with pytest.raises(ValueError, match=r"matches no parameter; the paths are \['Dense_0/bias'"):
        S.personal_mask(params, "Conv")
    with pytest.raises(ValueError, match="not a valid regex"):
        S.personal_mask(params, "Dense_(")


def test_split_merge_round_trip_plain_and_stacked():
    params = jax.tree.map(lambda s: jnp.arange(s.size, dtype=jnp.float32).reshape(s.shape),
                          shapes("mlp", (8, 8, 1)))                 # the MLP's tree, cheap values
    mask = S.personal_mask(params, "head")
    shared, personal = S.split(params, mask)
    assert shared["Dense_1"]["kernel"] is None and personal["Dense_0"]["kernel"] is None
    assert S.count(shared) == 64 * 100 + 100 and S.count(personal) == 100 * 10 + 10
    tree_equal(S.merge(shared, personal, mask), params)
    stacked = core.broadcast(params, 3)
    s_shared, s_personal = S.split(stacked, mask)
    assert S.count(s_personal, stacked=True) == 1010
    rows = core.gather(s_personal, jnp.array([2, 0]))                  # parts go through the engine
    merged = jax.jit(lambda a, b: S.merge(a, b, mask))(core.gather(s_shared, jnp.array([2, 0])), rows)
    tree_equal(merged, core.gather(stacked, jnp.array([2, 0])))


def test_flatten_rows_round_trip():
    tree = {"a": jnp.arange(24.0).reshape(2, 3, 4), "b": jnp.arange(4.0).reshape(2, 2), "c": None}
    mat = S.flatten_rows(tree)
    assert mat.shape == (2, 14)
    np.testing.assert_array_equal(mat[1], np.concatenate([np.arange(12.0, 24.0), [2.0, 3.0]]))
    back = S.unflatten_rows(mat, tree)
    tree_equal(back, tree)
    assert back["c"] is None
    with pytest.raises(ValueError, match="13 columns"):
        S.unflatten_rows(mat[:, :13], tree)


def test_complement_swaps_the_parts():
    params = {"Dense_0": {"kernel": jnp.ones((2, 3))}, "Dense_1": {"kernel": jnp.ones((3, 1))}}
    mask = S.personal_mask(params, "head")
    assert jax.tree.leaves(S.complement(mask)) == [True, False]
    assert S.complement(S.complement(mask)) == mask


@pytest.mark.parametrize("part", ["head", "^Dense_0/"])
def test_train_only_freezes_the_other_part_bit_for_bit(part):
    # Three SGD-momentum steps on random gradients: the frozen leaves are exactly what they were
    # (w + 0 = w), the trained leaves follow momentum SGD, and only they carry a buffer.
    params = {"Dense_0": {"kernel": jnp.arange(6.0).reshape(2, 3) / 7, "bias": -jnp.ones(3) / 3},
              "Dense_1": {"kernel": jnp.arange(3.0).reshape(3, 1) / 9, "bias": jnp.ones(1) / 11}}
    trainable = S.personal_mask(params, part)
    tx = S.train_only(optax.sgd(0.1, momentum=0.9), trainable)
    state, p = tx.init(params), params
    assert len(jax.tree.leaves(state)) == sum(jax.tree.leaves(trainable))
    ref = jax.tree.map(np.asarray, params)
    buf = jax.tree.map(np.zeros_like, ref)
    rng = np.random.default_rng(0)
    for _ in range(3):
        g = jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32), ref)
        updates, state = tx.update(jax.tree.map(jnp.asarray, g), state, p)
        p = optax.apply_updates(p, updates)
        buf = jax.tree.map(lambda b, gi: 0.9 * b + gi, buf, g)
        ref = jax.tree.map(lambda r, b: r - 0.1 * b, ref, buf)
    tree_equal(S.split(p, trainable)[0], S.split(params, trainable)[0])       # frozen: exact
    for got, want, start in zip(jax.tree.leaves(S.split(p, trainable)[1]),
                                jax.tree.leaves(S.split(ref, trainable)[1]),
                                jax.tree.leaves(S.split(params, trainable)[1])):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)          # momentum SGD
        assert not np.array_equal(got, start)
