"""Every algorithm that declares what it privatises (`AlgorithmSpec.private_uplink`) under
--dp-clip: its clients train exactly as without privacy (same sampled clients, same losses bit
for bit); with noise off the shared model moves at most C a round (the mean of M updates each
clipped to C, over the fixed denominator M); and the Gaussian noise reaches the shared state only:
every per-client row (personal models, heads, optimizer states) is bit for bit the same with and
without noise. The clipping norm and the noise multiplier are traced (as a sweep passes them), so
the runs with and without noise are one compiled program."""

import helpers
import jax
import numpy as np
import pytest
from helpers import linear_model, make_data

from fedjax_pfl import algorithms, core

SIZES = [12, 30, 7, 19, 25, 3, 40, 11, 9, 22]
PRIVATE = [n for n in algorithms.names() if algorithms.spec(n).private_uplink]
QUICK = ("fedavg",)                # (FedRep, a split model, in the full suite)
# FedPer's test configuration keeps the whole linear model {w, b} on the client (its head is the
# last dense layer): nothing would be sent. Here its head is the bias, as in the other split
# models' test configurations.
OVERRIDES = {"fedper": {"head": "^b$"}}


# Whose server state moves by more than the noisy mean update (FedDyn: θ also moves by −h/α):
# their bounds are checked in tests/algorithms/test_private_server_steps.py.
OWN_BOUND = ("feddyn",)


def _rounds(name, data):
    """(state before, plain round, private round, client mask): `plain(state, data, key)` is one
    round without privacy, `private(clip, z, state, data, key)` one round under --dp-clip with the clipping
    norm and the noise multiplier traced (AlgorithmSpec.traceable: one compiled program for
    every (C, z), as in a sweep)."""
    hp = {"participation": 0.3, "batch_size": 4, "lr": 0.1,
          **algorithms.spec(name).test_hparams, **OVERRIDES.get(name, {})}
    spec = algorithms.spec(name)
    assert {"dp_clip", "dp_noise_multiplier"} <= set(spec.traceable)
    algo = algorithms.get(name, model=linear_model(), **hp)
    static = spec.resolve({**hp, "dp_clip": 1.0})

    def private(clip, z, state, data, key):
        built = spec.build(linear_model(), {**static, "dp_clip": clip, "dp_noise_multiplier": z})
        return built.round_fn(state, data, key)

    before = jax.jit(algo.init)(jax.random.key(0), data)
    plain = jax.jit(algo.round_fn)
    return jax.device_get(before), plain, jax.jit(private), core.client_mask(before)


@pytest.mark.matrix
@pytest.mark.parametrize("name", [n if n in QUICK else pytest.param(n, marks=pytest.mark.slow)
                                  for n in PRIVATE])
def test_privacy_acts_on_the_uplink_only(name):
    assert len(PRIVATE) >= 11
    data = make_data(SIZES)
    before, plain_round, private_round, mask = _rounds(name, data)
    key, clip = jax.random.key(3), 1e-3
    _, plain = jax.device_get(plain_round(before, data, key))
    quiet, m_quiet = jax.device_get(private_round(clip, 0.0, before, data, key))
    noisy, m_noisy = jax.device_get(private_round(clip, 5.0, before, data, key))
    # The clients' side: the same clients, the same training losses, bit for bit.
    for m in (m_quiet, m_noisy):
        np.testing.assert_array_equal(m["sampled"], plain["sampled"])
        np.testing.assert_array_equal(m["train_loss"], plain["train_loss"])
    assert float(m_quiet["dp_clipped_fraction"]) == 1.0       # every update is longer than C
    # No noise: the shared state moved at most C (Σ of M updates of norm C, over M).
    shared, rows = helpers.shared_floats, helpers.client_rows
    step = np.sqrt(sum(((a - b) ** 2).sum() for a, b in
                       zip(shared(quiet, mask), shared(before, mask))))
    assert 0 < step <= clip * (1 + 1e-4) or (name in OWN_BOUND and step > 0)
    # Noise: the shared state differs, every client row is untouched by it.
    assert any(not np.array_equal(a, b) for a, b in
               zip(shared(noisy, mask), shared(quiet, mask)))
    for a, b in zip(rows(noisy, mask), rows(quiet, mask), strict=True):
        np.testing.assert_array_equal(a, b)
