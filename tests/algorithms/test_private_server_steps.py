"""TDPFed and pFedMe under --dp-clip (docs/privacy.md): the server step is DP-FedAvg's on what
the server averages, then β (TDPFed eq. 18 / 19, pFedMe Algorithm 1 line 12):
  TDPFed AFM: A_{t+1} = A_t + β·(Σ_k clip_C(A_k − A_t) + N(0, z²C²))/M
  TDPFed ACT: ω̃_{t+1} = ⟦A_t⟧ + β·(Σ_k clip_C(⟦A_k⟧ − ⟦A_t⟧) + N(0, z²C²))/M
  pFedMe:     w_{t+1} = w_t + β·(Σ_k clip_C(w_k − w_t) + N(0, z²C²))/M
Without clipping or noise that is the uniform-weight round, (1 − β)·X_t + β·mean_k X_k, checked
against the plain round with weights="uniform" (a different program: to float rounding); with
every update clipped and no noise the shared state moves by at most β·C, the norm computed here
over every factor and bias. (Privacy acting on the uplink only, the clients' training and
personal models untouched: tests/algorithms/test_private_uplinks.py.)"""

import jax
import numpy as np
import pytest

from fedjax_pfl import algorithms
from fedjax_pfl.models import cp
from helpers import linear_model, make_data

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
