"""DP-FedAvg (`--dp-clip`, `--dp-noise-multiplier`; McMahan et al., ICLR 2018): the server step
θ + (Σ clip_C(θ_i − θ) + N(0, z²C²)) / M checked against the client updates of the same round,
clipped by hand in float64; the clients' training untouched by privacy; the noise's scale; and
algorithms that do not privatise their uplink refusing --dp-clip."""

import jax
import numpy as np
import pytest
from helpers import linear_model, make_data

from fedjax_pfl import algorithms, core

SIZES = [12, 30, 7, 19, 25, 3, 40, 11, 9, 22]


_PROGRAMS = {}


def _round(data, key=1, **hp):
    """(start, end) flat float64 global models of round 1 under key `key`, and its metrics; one
    compiled program per dataset and hyperparameters."""
    tag = (id(data), tuple(sorted(hp.items())))
    if tag not in _PROGRAMS:
        algo = algorithms.get("fedavg", model=linear_model(), batch_size=4, lr=0.1, **hp)
        _PROGRAMS[tag] = (data, core.Program(algo, data, mesh=None))
    program = _PROGRAMS[tag][1]
    state = program.init(jax.random.key(0))
    start = np.concatenate([np.asarray(x, np.float64).ravel()
                            for x in jax.tree.leaves(state.params)])
    state, m = program.run_rounds(state, jax.random.key(key), 0, 1)
    end = np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(state.params)])
    return start, end, m[0]


def test_one_client_a_round_the_step_is_its_clipped_update():
    """M = 1: without clipping or noise the server's step is the client's update Δ exactly; with
    C below ‖Δ‖ it is C·Δ/‖Δ‖ (the same client trained with the same keys), and the metrics say
    it was clipped."""
    data = make_data(SIZES)
    start, free, m_free = _round(data, participation=0.1, dp_clip=float("inf"))
    delta = free - start
    clip = 0.25 * np.linalg.norm(delta)
    start2, clipped, m = _round(data, participation=0.1, dp_clip=clip)
    np.testing.assert_array_equal(start, start2)
    np.testing.assert_array_equal(m["sampled"], m_free["sampled"])
    np.testing.assert_allclose(clipped - start, clip * delta / np.linalg.norm(delta),
                               rtol=1e-5, atol=1e-7)
    assert float(m["dp_clipped_fraction"]) == 1.0 and float(m_free["dp_clipped_fraction"]) == 0.0
    np.testing.assert_allclose(float(m["dp_update_norm"]), np.linalg.norm(delta), rtol=1e-5)


@pytest.mark.slow
def test_without_clipping_or_noise_it_is_the_uniform_mean_and_clients_train_as_in_fedavg():
    """With equal client sizes FedAvg's sample weights are uniform: DP-FedAvg with C = ∞, z = 0
    (θ + Σ(θ_i − θ)/M) gives FedAvg's model up to float rounding, from the same sampled clients
    whose training losses are bit for bit FedAvg's (privacy acts on the server side only)."""
    data = make_data([16] * 10)
    _, plain, m_plain = _round(data, participation=0.5)
    _, private, m_private = _round(data, participation=0.5, dp_clip=float("inf"))
    np.testing.assert_array_equal(m_private["sampled"], m_plain["sampled"])
    np.testing.assert_array_equal(m_private["train_loss"], m_plain["train_loss"])
    np.testing.assert_allclose(private, plain, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_the_noise_on_the_model_has_standard_deviation_z_c_over_m():
    """The same round with and without noise (z = 2, C = 0.5, M = 5): their difference is the
    noise over M; over 30 round keys × 18 parameters its standard deviation is z·C/M within 20 %
    (the sample standard deviation of 540 draws has a relative standard error of 3 %)."""
    data = make_data(SIZES)
    diffs = []
    for key in range(30):
        _, quiet, _ = _round(data, key, participation=0.5, dp_clip=0.5)
        _, noisy, _ = _round(data, key, participation=0.5, dp_clip=0.5, dp_noise_multiplier=2.0)
        diffs.append(noisy - quiet)
    diffs = np.concatenate(diffs)
    assert abs(diffs.std() / (2.0 * 0.5 / 5) - 1) < 0.2


def test_algorithms_that_do_not_privatise_their_uplink_refuse_dp_clip():
    with pytest.raises(ValueError, match="pgfedmo does not privatise its uplink.*pairwise server "
                                         "mixture.*built for: apfl, ditto.*fedavg"):
        algorithms.get("pgfedmo", model=linear_model(), dp_clip=1.0)
    assert algorithms.spec("fedavg").private_uplink and algorithms.spec("pgfedmo").private_uplink is None
