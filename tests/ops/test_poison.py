"""Data poisoning (`ops.poison`, `core.local.DataPoison`): label flipping and the backdoor
trigger on the chosen rows only, against hand-built arrays; a backdoor client's poisoned share
is exactly ⌈f·n⌉ of its examples, fixed by the seed."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_pfl.core.local import DataPoison
from fedjax_pfl.data.federated import ClientSplits
from fedjax_pfl.ops import poison

CHOSEN = np.array([True, False, True, False, False])


def test_flip_labels_is_the_reversal_permutation_or_a_target():
    y = jnp.array([0, 1, 2, 9, 4], jnp.int32)
    np.testing.assert_array_equal(poison.flip_labels(y, 10), [9, 8, 7, 0, 5])
    np.testing.assert_array_equal(poison.flip_labels(y, 10, target=3), [3, 3, 3, 3, 3])
    _, got = poison.label_flip(jnp.zeros((5, 2)), y, jnp.asarray(CHOSEN), num_classes=10)
    np.testing.assert_array_equal(got, [9, 1, 7, 9, 4])      # rows 0 and 2 only


def test_the_image_trigger_is_the_bottom_right_patch_on_the_chosen_rows():
    x = np.arange(5 * 4 * 4 * 2, dtype=np.float32).reshape(5, 4, 4, 2) / 100
    y = np.array([1, 2, 3, 4, 5], np.int32)
    gx, gy = poison.backdoor(jnp.asarray(x), jnp.asarray(y), jnp.asarray(CHOSEN), target=7,
                             size=2, value=1.0, inputs="image")
    want = x.copy()
    for j in (0, 2):
        want[j, 2:4, 2:4, :] = 1.0                            # rows 2–3, columns 2–3, all channels
    np.testing.assert_array_equal(np.asarray(gx), want)
    np.testing.assert_array_equal(np.asarray(gy), [7, 2, 7, 4, 5])


def test_features_and_tokens_get_their_last_entries():
    x = np.zeros((5, 6), np.float32)
    gx, _ = poison.backdoor(jnp.asarray(x), jnp.zeros(5, jnp.int32), jnp.asarray(CHOSEN),
                            target=0, size=3, value=1.0, inputs="features")
    want = x.copy()
    want[[0, 2], 3:] = 1.0
    np.testing.assert_array_equal(np.asarray(gx), want)
    t = np.ones((5, 4), np.int32)
    gt = poison.stamp_trigger(jnp.asarray(t), 1, 99, "tokens")
    np.testing.assert_array_equal(np.asarray(gt)[:, -1], 99)
    np.testing.assert_array_equal(np.asarray(gt)[:, :-1], 1)
    # A 3-d image batch [B, H, W] (no channel axis).
    g3 = poison.stamp_trigger(jnp.zeros((2, 3, 3)), 1, 5.0, "image")
    assert float(g3[:, 2, 2].sum()) == 10.0 and float(g3.sum()) == 10.0


def client(start, n):
    a = lambda v: jnp.asarray(v, jnp.int32)
    return ClientSplits(a(start), a(n), a(0), a(0))


@pytest.mark.parametrize("n,fraction", [(10, 0.5), (7, 0.3), (23, 0.1), (5, 1.0), (1, 0.2)])
@pytest.mark.slow
def test_a_backdoor_client_poisons_exactly_ceil_f_n_examples(n, fraction):
    p = DataPoison("backdoor", 0, fraction, 2, seed=3)
    chosen = np.asarray(p.chosen(client(40, n), jnp.arange(n)))
    assert chosen.sum() == math.ceil(fraction * n - 1e-9)
    # The same examples whatever the batch a position is read in.
    again = np.concatenate([np.asarray(p.chosen(client(40, n), jnp.arange(k, min(k + 3, n))))
                            for k in range(0, n, 3)])
    np.testing.assert_array_equal(again, chosen)


def test_the_poisoned_examples_depend_on_the_seed_and_the_client():
    sets = {tuple(np.flatnonzero(np.asarray(DataPoison("backdoor", 0, 0.5, 2, seed=s).chosen(
        client(0, 12), jnp.arange(12))))) for s in range(12)}
    assert len(sets) > 6
    a = DataPoison("backdoor", 0, 0.5, 2, seed=1)
    assert not np.array_equal(np.asarray(a.chosen(client(0, 12), jnp.arange(12))),
                              np.asarray(a.chosen(client(50, 12), jnp.arange(12))))
    assert np.asarray(DataPoison("label_flip", None).chosen(client(0, 4), jnp.arange(4))).all()
