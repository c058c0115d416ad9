"""ops.dp: per-client L2 clipping and the Gaussian mechanism of DP-FedAvg, against float64
references written here and a statistical check of the noise's standard deviation."""

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_pfl.ops import dp


def _tree(rng, scale):
    return {"w": jnp.asarray(rng.normal(size=(4, 3)) * scale, jnp.float32),
            "b": jnp.asarray(rng.normal(size=(3,)) * scale, jnp.float32)}


def _flat(tree):
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])


def test_clipping_bounds_every_norm_and_keeps_small_updates_bit_for_bit():
    rng = np.random.default_rng(0)
    clip = 1.5
    for scale in (0.01, 0.2, 1.0, 5.0, 100.0):
        update = _tree(rng, scale)
        clipped, norm = dp.clip_update(update, clip)
        v = _flat(update)
        assert np.isclose(float(norm), np.linalg.norm(v), rtol=1e-6)
        got = _flat(clipped)
        if np.linalg.norm(v) <= clip:                    # unchanged, bit for bit
            for a, b in zip(jax.tree.leaves(clipped), jax.tree.leaves(update)):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        else:                                            # C · v / ‖v‖
            np.testing.assert_allclose(got, clip * v / np.linalg.norm(v), rtol=1e-6, atol=1e-7)
        assert np.linalg.norm(got) <= clip * (1 + 1e-6)


def test_no_clipping_at_infinity_and_a_zero_update_stays_zero():
    update = _tree(np.random.default_rng(1), 1e6)
    clipped, _ = dp.clip_update(update, float("inf"))
    for a, b in zip(jax.tree.leaves(clipped), jax.tree.leaves(update)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    zero = jax.tree.map(jnp.zeros_like, update)
    clipped, norm = dp.clip_update(zero, 0.5)
    assert float(norm) == 0 and not _flat(clipped).any()


def test_the_noise_has_standard_deviation_z_c_over_the_denominator():
    """20,000 draws of a 50-entry sum: the sample standard deviation of (noisy − exact) is
    z·C/D within 1 % (its own relative standard error is 1/sqrt(2n) = 0.07 %, so 1 % is 14 of
    them), its mean 0 within 5 standard errors; draws of different keys differ."""
    z, clip, denominator = 1.3, 0.7, 8.0
    total = {"a": jnp.linspace(-1.0, 1.0, 50, dtype=jnp.float32)}
    keys = jax.random.split(jax.random.key(42), 20000)
    noisy = jax.vmap(lambda k: dp.noisy_mean(total, k, clip=clip, noise_multiplier=z,
                                             denominator=denominator))(keys)
    noise = np.asarray(noisy["a"], np.float64) - np.asarray(total["a"], np.float64) / denominator
    sigma = z * clip / denominator
    assert abs(noise.std() / sigma - 1) < 0.01
    assert abs(noise.mean()) < 5 * sigma / np.sqrt(noise.size)
    assert not np.array_equal(noise[0], noise[1])


def test_without_noise_the_mean_is_the_sum_over_the_denominator_exactly():
    total = _tree(np.random.default_rng(2), 3.0)
    out = dp.noisy_mean(total, jax.random.key(0), clip=float("inf"), noise_multiplier=0.0,
                        denominator=6)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(total)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b / 6))


def test_the_stacked_clipped_sum_is_the_sum_of_each_clients_clipped_update():
    """dp.clipped_update_sum (the engine's form: from the models and their start) against
    clip_update of each client's θ_k − start, summed in float64: clients below, near and far
    above C; and the norms."""
    rng = np.random.default_rng(3)
    start = _tree(rng, 1.0)
    updates = [_tree(rng, scale) for scale in (0.01, 0.3, 1.0, 4.0, 50.0)]
    models = jax.tree.map(lambda s, *u: jnp.stack([s + d for d in u]), start, *updates)
    clip = 1.2
    total, norms = dp.clipped_update_sum(models, start, clip)
    deltas = [jax.tree.map(lambda m, s, k=k: m[k] - s, models, start) for k in range(5)]
    want = sum(_flat(dp.clip_update(d, clip)[0]) for d in deltas)
    np.testing.assert_allclose(_flat(total), want, rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(np.asarray(norms), [np.linalg.norm(_flat(d)) for d in deltas],
                               rtol=1e-5)


def test_leaves_of_the_same_shape_get_independent_noise():
    """A zero sum of two leaves of one shape, 4,000 keys: the noises of the two leaves differ in
    every draw, each has standard deviation z·C/D (within 5 of its relative standard errors,
    1/sqrt(2n), n = 4,000·16 draws), and their sample correlation over the n pairs is 0 within
    5/sqrt(n) (its standard error for independent normals). One key for both leaves would make
    them equal: correlation 1."""
    z, clip, denominator, rounds = 0.8, 1.5, 4.0, 4000
    zero = {"a": jnp.zeros((4, 4), jnp.float32), "b": jnp.zeros((4, 4), jnp.float32)}
    keys = jax.random.split(jax.random.key(11), rounds)
    noisy = jax.vmap(lambda k: dp.noisy_mean(zero, k, clip=clip, noise_multiplier=z,
                                             denominator=denominator))(keys)
    a = np.asarray(noisy["a"], np.float64).reshape(rounds, -1)
    b = np.asarray(noisy["b"], np.float64).reshape(rounds, -1)
    assert not np.any(np.all(a == b, axis=1))
    n = a.size
    sigma = z * clip / denominator
    for leaf in (a, b):
        assert abs(leaf.std() / sigma - 1) < 5 / np.sqrt(2 * n)
    corr = np.corrcoef(a.ravel(), b.ravel())[0, 1]
    assert abs(corr) < 5 / np.sqrt(n)
