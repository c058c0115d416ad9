"""Server steps under --dp-clip that are more than FedAvg's mean (docs/privacy.md). For TDPFed and
pFedMe it is DP-FedAvg's on what the server averages, then β (TDPFed eq. 18 / 19, pFedMe
Algorithm 1 line 12):
  TDPFed AFM: A_{t+1} = A_t + β·(Σ_k clip_C(A_k − A_t) + N(0, z²C²))/M
  TDPFed ACT: ω̃_{t+1} = ⟦A_t⟧ + β·(Σ_k clip_C(⟦A_k⟧ − ⟦A_t⟧) + N(0, z²C²))/M
  pFedMe:     w_{t+1} = w_t + β·(Σ_k clip_C(w_k − w_t) + N(0, z²C²))/M
Without clipping or noise that is the uniform-weight round, (1 − β)·X_t + β·mean_k X_k, checked
against the plain round with weights="uniform" (a different program: to float rounding); with
every update clipped and no noise the shared state moves by at most β·C, the norm computed here
over every factor and bias.

SCAFFOLD clips the joint upload u_i = (Δy_i, Δc_i): (Δ̃y, Δ̃c) = (Σ clip_C(u_i) + N(0, z²C²))/M,
x ← x + η_g Δ̃y, c ← c + (M/N) Δ̃c. Without clipping or noise: the plain round with uniform
weights; clipped: ‖(Δx/η_g, Δc·N/M)‖ ≤ C.

pFedSOP's uplink is Δ_i itself: Δ = (Σ clip_C(Δ_i) + N(0, z²C²))/M, of norm ≤ C without noise,
each client keeping its unclipped Δ_i. FedAvg-SAR at C = ∞ is its round on equal clients.

FedDyn reads both server lines from the noisy mean update Δ̃: h' = h − α(M/N)Δ̃, θ' = θ + Δ̃ − h'/α
(its state moves by more than C: −h'/α comes on top).

Privacy acting on the uplink only, the clients' training and personal models untouched:
tests/algorithms/test_private_uplinks.py."""

import jax
import numpy as np
import pytest
from helpers import linear_model, make_data

# The quick suite keeps SCAFFOLD's joint clipping; the full suite runs every case.
from fedjax_pfl import algorithms
from fedjax_pfl.models import cp

HP = dict(local_steps=2, batch_size=4, participation=0.5, beta=0.5, weights="uniform")
CASES = {"afm": ("tdpfed", {"cr": 1.2, "aggregate": "afm"}),
         "act": ("tdpfed", {"cr": 1.2, "aggregate": "act"}),
         "pfedme": ("pfedme", {})}


def _one_round(case, **dp):
    data = make_data([12, 30, 7, 19, 25, 3], feature_dim=5, num_classes=3, seed=1)
    name, own = CASES[case]
    algo = algorithms.get(name, model=linear_model(), **own, **HP, **dp)
    before = jax.jit(algo.init)(jax.random.key(0), data)
    after, metrics = jax.jit(algo.round_fn)(before, data, jax.random.key(4))
    return jax.device_get(before), jax.device_get(after), jax.device_get(metrics)


def _shared(state, case):
    """What the server computes: the factors (AFM), ω̃ (ACT) or w (pFedMe), as float64 leaves."""
    tree = {"afm": lambda: state.factors, "act": lambda: state.omega,
            "pfedme": lambda: state.params}[case]()
    return [np.asarray(x, np.float64) for x in jax.tree.leaves(tree)]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_without_clipping_or_noise_it_is_the_uniform_round(case):
    _, plain, m_plain = _one_round(case)
    _, private, m_private = _one_round(case, dp_clip=float("inf"))
    assert float(m_private["dp_clipped_fraction"]) == 0.0
    np.testing.assert_array_equal(m_private["sampled"], m_plain["sampled"])
    for a, b in zip(_shared(private, case), _shared(plain, case), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    if case == "act":            # the factors refitted to the same ω̃
        for a, b in zip(jax.tree.leaves(private.factors), jax.tree.leaves(plain.factors)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_clipped_updates_move_the_server_state_by_at_most_beta_c(case):
    clip = 1e-3
    before, after, m = _one_round(case, dp_clip=clip)
    assert float(m["dp_clipped_fraction"]) == 1.0
    start = ([np.asarray(x, np.float64) for x in jax.tree.leaves(cp.reconstruct(before.factors))]
             if case == "act" else _shared(before, case))
    step = np.sqrt(sum(((a - b) ** 2).sum() for a, b in zip(_shared(after, case), start,
                                                            strict=True)))
    # β·‖mean of M updates of norm exactly C‖: at most β·C, and more than 0.
    assert 0 < step <= HP["beta"] * clip * (1 + 1e-4)


SCAFFOLD = dict(local_steps=2, batch_size=4, participation=0.5, server_lr=0.5, weights="uniform",
                momentum=0.0)


def _scaffold_round(**dp):
    data = make_data([12, 30, 7, 19, 25, 3], feature_dim=5, num_classes=3, seed=1)
    algo = algorithms.get("scaffold", model=linear_model(), **SCAFFOLD, **dp)
    state = jax.jit(algo.init)(jax.random.key(0), data)
    step = jax.jit(algo.round_fn)
    state, _ = step(state, data, jax.random.key(3))       # c ≠ 0 and c_i ≠ 0 from here on
    after, metrics = step(state, data, jax.random.key(4))
    return jax.device_get(state), jax.device_get(after), jax.device_get(metrics)


def _floats(tree):
    return [np.asarray(x, np.float64) for x in jax.tree.leaves(tree)]


@pytest.mark.slow
def test_scaffold_without_clipping_or_noise_is_the_uniform_round():
    _, plain, _ = _scaffold_round()
    _, private, m = _scaffold_round(dp_clip=float("inf"))
    assert float(m["dp_clipped_fraction"]) == 0.0
    for a, b in zip(_floats((private.params, private.control)),
                    _floats((plain.params, plain.control)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_scaffold_clips_model_and_control_updates_jointly():
    clip = 1e-3
    before, after, m = _scaffold_round(dp_clip=clip)
    assert float(m["dp_clipped_fraction"]) == 1.0
    share = 3 / 6                                        # M / N: 3 of the 6 clients
    dx = [a - b for a, b in zip(_floats(after.params), _floats(before.params))]
    dc = [a - b for a, b in zip(_floats(after.control), _floats(before.control))]
    joint = np.sqrt(sum((d ** 2).sum() for d in dx) / SCAFFOLD["server_lr"] ** 2
                    + sum((d ** 2).sum() for d in dc) / share ** 2)
    # The mean of M joint updates of norm exactly C: at most C, and both parts moved.
    assert 0 < joint <= clip * (1 + 1e-4)
    assert sum(np.abs(d).sum() for d in dx) > 0 and sum(np.abs(d).sum() for d in dc) > 0


FEDDYN = dict(local_steps=2, batch_size=4, participation=0.5, alpha=0.1)


def _feddyn_round(**dp):
    data = make_data([12, 30, 7, 19, 25, 3], feature_dim=5, num_classes=3, seed=1)
    if dp.get("sampling") == "poisson":
        data = data.pad_clients(1, minimum=1)       # the empty slots' client (core.Program's)
    plain = algorithms.get("feddyn", model=linear_model(), **FEDDYN)
    algo = algorithms.get("feddyn", model=linear_model(), **FEDDYN, **dp)
    state = jax.jit(plain.init)(jax.random.key(0), data)
    state, _ = jax.jit(plain.round_fn)(state, data, jax.random.key(3))      # h ≠ 0 from here on
    after, metrics = jax.jit(algo.round_fn)(state, data, jax.random.key(4))
    return jax.device_get(state), jax.device_get(after), jax.device_get(metrics)


@pytest.mark.slow
def test_feddyn_without_clipping_or_noise_is_its_round():
    _, plain, _ = _feddyn_round()
    _, private, m = _feddyn_round(dp_clip=float("inf"))
    assert float(m["dp_clipped_fraction"]) == 0.0
    for a, b in zip(_floats((private.params, private.h)), _floats((plain.params, plain.h)),
                    strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("sampling", ["fixed", "poisson"])
def test_feddyn_reads_h_and_the_model_from_one_clipped_mean_update(sampling):
    """Lines 9–10 with the noisy mean update Δ̃: h' = h − α(M/N)Δ̃ and θ' = θ + Δ̃ − h'/α, so
    Δ̃ = θ' − θ + h'/α is recovered here, of norm at most C·|S|/M, and h' − h = −α(M/N)Δ̃
    exactly. Under Poisson sampling M is the expected q·N (here 3 of 6 either way), not the
    round's K slots."""
    clip, alpha, share = 1e-3, FEDDYN["alpha"], 3 / 6
    before, after, m = _feddyn_round(dp_clip=clip, sampling=sampling)
    took_part = int(np.sum(np.asarray(m["sampled"]) < 6))
    assert took_part > 0 and float(m["dp_clipped_fraction"]) == 1.0
    update = [p1 - p0 + h1 / alpha for p1, p0, h1 in
              zip(_floats(after.params), _floats(before.params), _floats(after.h))]
    norm = np.sqrt(sum((u ** 2).sum() for u in update))
    assert 0 < norm <= clip * took_part / 3 * (1 + 1e-3)
    for h1, h0, u in zip(_floats(after.h), _floats(before.h), update, strict=True):
        np.testing.assert_allclose(h1 - h0, -alpha * share * u, rtol=1e-3, atol=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("fill", ["keep", "zero"])
def test_fedavg_sar_without_clipping_or_noise_is_its_round_on_equal_clients(fill):
    """w + mean_i(received_i − w) = mean_i received_i: the plain round's sample-weighted mean
    when every client has the same number of samples."""
    data = make_data([10] * 6, feature_dim=5, num_classes=3, seed=1)
    out = {}
    for label, dp in (("plain", {}), ("private", {"dp_clip": float("inf")})):
        algo = algorithms.get("fedavg_sar", model=linear_model(), mask_fill=fill, local_steps=2,
                              batch_size=4, participation=0.5, **dp)
        state = jax.jit(algo.init)(jax.random.key(0), data)
        out[label] = jax.device_get(jax.jit(algo.round_fn)(state, data, jax.random.key(4)))
    assert float(out["private"][1]["dp_clipped_fraction"]) == 0.0
    for a, b in zip(_floats(out["private"][0].params), _floats(out["plain"][0].params),
                    strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def _pfedsop_round(**dp):
    """pFedSOP's second round (returning clients take the Newton step from the first round's Δ)."""
    data = make_data([12, 30, 7, 19, 25, 3], feature_dim=5, num_classes=3, seed=1)
    hp = dict(local_steps=2, batch_size=4, participation=0.5)
    plain = algorithms.get("pfedsop", model=linear_model(), **hp)
    algo = algorithms.get("pfedsop", model=linear_model(), **hp, **dp)
    state = jax.jit(plain.init)(jax.random.key(0), data)
    state, _ = jax.jit(plain.round_fn)(state, data, jax.random.key(3))
    after, metrics = jax.jit(algo.round_fn)(state, data, jax.random.key(4))
    return jax.device_get(after), jax.device_get(metrics)


@pytest.mark.slow
def test_pfedsop_sends_its_accumulated_gradients_clipped():
    """Δ = (1/M) Σ Δ_i without clipping or noise; every Δ_i clipped: ‖Δ‖ ≤ C, while each client
    keeps its own unclipped Δ_i (the angle of its next round)."""
    plain, _ = _pfedsop_round()
    unclipped, m = _pfedsop_round(dp_clip=float("inf"))
    assert float(m["dp_clipped_fraction"]) == 0.0
    for a, b in zip(_floats(unclipped.delta_glob), _floats(plain.delta_glob), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    clip = 1e-3
    clipped, m = _pfedsop_round(dp_clip=clip)
    assert float(m["dp_clipped_fraction"]) == 1.0
    norm = np.sqrt(sum((d ** 2).sum() for d in _floats(clipped.delta_glob)))
    assert 0 < norm <= clip * (1 + 1e-4)
    for a, b in zip(_floats(clipped.clients), _floats(plain.clients), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)    # (two programs)
