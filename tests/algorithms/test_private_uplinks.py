"""Every algorithm that declares what it privatises (`AlgorithmSpec.private_uplink`) under
--dp-clip: its clients train exactly as without privacy (same sampled clients, same losses bit
for bit); with noise off the shared model moves at most C a round (the mean of M updates each
clipped to C, over the fixed denominator M); and the Gaussian noise reaches the shared state only:
every per-client row (personal models, heads, optimizer states) is bit for bit the same with and
without noise."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_pfl import algorithms, core
import helpers
from helpers import linear_model, make_data

SIZES = [12, 30, 7, 19, 25, 3, 40, 11, 9, 22]
PRIVATE = [n for n in algorithms.names() if algorithms.spec(n).private_uplink]
QUICK = ("fedavg", "fedrep")
# FedPer's test configuration keeps the whole linear model {w, b} on the client (its head is the
# last dense layer): nothing would be sent. Here its head is the bias, as in the other split
# models' test configurations.
OVERRIDES = {"fedper": {"head": "^b$"}}


def _one_round(name, data, **dp):
    """(state before, state after, metrics, client mask) of one round. Compiled at XLA's
    default settings (`helpers.product_jit`): at the suite's fast-compile settings two programs
    of the same arithmetic (with and without the noise) may differ by an ulp in the clients'
    training."""
    hp = {"participation": 0.3, "batch_size": 4, "lr": 0.1,
          **algorithms.spec(name).test_hparams, **OVERRIDES.get(name, {}), **dp}
    algo = algorithms.get(name, model=linear_model(), **hp)
    before = helpers.product_jit(algo.init)(jax.random.key(0), data)
    state, m = helpers.product_jit(algo.round_fn)(before, data, jax.random.key(3))
    return jax.device_get(before), jax.device_get(state), jax.device_get(m), core.client_mask(before)


def _shared_floats(tree, mask):
    return [np.asarray(x, np.float64) for x, c in zip(jax.tree.leaves(tree), jax.tree.leaves(mask))
            if not c and jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)]


def _client_rows(tree, mask):
    return [np.asarray(jax.random.key_data(x) if jnp.issubdtype(jnp.asarray(x).dtype,
                                                                jax.dtypes.prng_key) else x)
            for x, c in zip(jax.tree.leaves(tree), jax.tree.leaves(mask)) if c]


@pytest.mark.parametrize("name", [n if n in QUICK else pytest.param(n, marks=pytest.mark.slow)
                                  for n in PRIVATE])
def test_privacy_acts_on_the_uplink_only(name):
    assert len(PRIVATE) >= 11
    data = make_data(SIZES)
    _, _, plain, _ = _one_round(name, data)
    clip = 1e-3
    before, quiet, m_quiet, mask = _one_round(name, data, dp_clip=clip)
    _, noisy, m_noisy, _ = _one_round(name, data, dp_clip=clip, dp_noise_multiplier=5.0)
    # The clients' side: the same clients, the same training losses, bit for bit.
    for m in (m_quiet, m_noisy):
        np.testing.assert_array_equal(m["sampled"], plain["sampled"])
        np.testing.assert_array_equal(m["train_loss"], plain["train_loss"])
    assert float(m_quiet["dp_clipped_fraction"]) == 1.0       # every update is longer than C
    # No noise: the shared state moved at most C (Σ of M updates of norm C, over M).
    step = np.sqrt(sum(((a - b) ** 2).sum() for a, b in
                       zip(_shared_floats(quiet, mask), _shared_floats(before, mask))))
    assert 0 < step <= clip * (1 + 1e-4)
    # Noise: the shared state differs, every client row is untouched by it.
    assert any(not np.array_equal(a, b) for a, b in
               zip(_shared_floats(noisy, mask), _shared_floats(quiet, mask)))
    for a, b in zip(_client_rows(noisy, mask), _client_rows(quiet, mask), strict=True):
        np.testing.assert_array_equal(a, b)
