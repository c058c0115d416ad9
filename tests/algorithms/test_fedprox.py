"""FedProx and FedProx-FT: μ = 0 is FedAvg (and FedAvg-FT) bit for bit, the proximal gradient by
hand, backends equal, the flags in --help."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import linear_model, make_data, tree_allclose, tree_equal

from fedjax_pfl import algorithms
from fedjax_pfl.algorithms import _prox
from fedjax_pfl.data.federated import FederatedData
from fedjax_pfl.models.model import Model

# Per-example loss ½‖w − x‖²: the full-batch gradient at w is w − mean(x).
QUADRATIC = Model(init=lambda key: {"w": jnp.zeros(2)}, apply=lambda p, x: p["w"] - x,
                  loss=lambda out, y: 0.5 * jnp.sum(out**2, axis=-1))
DATA = make_data([7, 23, 12, 9])


def quadratic_data():
    # Client A trains on [1,0], [3,0] (mean [2,0]); client B on [0,3], [0,6], [0,0] (mean [0,3]).
    x = np.array([[1, 0], [3, 0], [0, 3], [0, 6], [0, 0], [9, 9], [9, 9], [9, 9]], np.float64)
    return FederatedData.from_arrays(x, np.zeros(8), [np.array([0, 1]), np.array([2, 3, 4])],
                                     [np.array([5]), np.array([6, 7])], num_classes=1)


def _rounds(name, rounds=2, data=DATA, backend="vmap", model=None, **hp):
    algo = algorithms.get(name, model=model or linear_model(), backend=backend, chunk_size=2,
                          lr=0.1, batch_size=4, local_epochs=2, participation=0.5, **hp)
    step = algo.round_fn if backend == "loop" else jax.jit(algo.round_fn)
    state, metrics = algo.init(jax.random.key(0), data), []
    for r in range(rounds):
        state, m = step(state, data, jax.random.key(r))
        metrics.append(m)
    return state, metrics, algo.evaluate(state, data)


@pytest.mark.slow
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_mu_zero_is_fedavg_bit_for_bit(momentum):
    hp = dict(momentum=momentum, momentum_buffer="persist")
    s_prox, m_prox, e_prox = _rounds("fedprox", mu=0.0, **hp)
    s_avg, m_avg, e_avg = _rounds("fedavg", **hp)
    tree_equal(s_prox.params, s_avg.params)
    for a, b in zip(m_prox, m_avg):
        tree_equal(a, b)
    tree_equal(e_prox, e_avg)
    assert not np.array_equal(_rounds("fedprox", mu=1.0, **hp)[0].params["w"], s_avg.params["w"])


@pytest.mark.slow
def test_fedprox_ft_mu_zero_is_fedavg_ft_bit_for_bit():
    _, _, e_prox = _rounds("fedprox_ft", mu=0.0, ft_epochs=2)
    _, _, e_avg = _rounds("fedavg_ft", ft_epochs=2)
    tree_equal(e_prox, e_avg)
    assert not np.allclose(e_prox["client"].loss_sum, e_prox["global"].loss_sum)


def test_proximal_term_is_mu_times_the_distance_to_the_anchor():
    tx = _prox.add_proximal_term(0.5)
    g = {"a": jnp.array([1.0, -2.0])}
    w = {"a": jnp.array([3.0, 3.0])}
    anchor = {"a": jnp.array([1.0, 5.0])}
    out, _ = tx.update(g, tx.init(w), w, anchor=anchor)
    np.testing.assert_allclose(out["a"], [1 + 0.5 * 2, -2 + 0.5 * -2])       # g + μ(w − w_g)


def test_local_steps_by_hand(x64):
    # Two full-batch epochs, η = 0.5, μ = 0.5, from w^t = 0 (step 1 has no prox pull: w = w^t).
    # A: w1 = 0.5·[2,0] = [1,0]; w2 = w1 − 0.5((w1 − [2,0]) + 0.5·w1) = [1,0] − 0.5·[−0.5,0] = [1.25,0].
    # B: w1 = [0,1.5];          w2 = [0,1.5] − 0.5([0,−1.5] + [0,0.75]) = [0,1.875].
    # Weights 2 : 3 → w^1 = [0.5, 1.125]  (FedAvg's would be (2·[1.5,0] + 3·[0,2.25])/5 = [0.6,1.35]).
    algo = algorithms.get("fedprox", model=QUADRATIC, mu=0.5, participation=1.0, lr=0.5,
                          batch_size=8, local_epochs=2)
    data = quadratic_data()
    state = algo.init(jax.random.key(0), data)
    state, _ = jax.jit(algo.round_fn)(state, data, jax.random.key(1))
    np.testing.assert_allclose(state.params["w"], [0.5, 1.125], rtol=1e-12)
    # Round 2 against a NumPy transcription of w ← w − η(w − x̄ + μ(w − w^t)).
    wt = np.array([0.5, 1.125])
    ends = []
    for mean in (np.array([2.0, 0.0]), np.array([0.0, 3.0])):
        w = wt.copy()
        for _ in range(2):
            w = w - 0.5 * ((w - mean) + 0.5 * (w - wt))
        ends.append(w)
    state, _ = jax.jit(algo.round_fn)(state, data, jax.random.key(2))
    np.testing.assert_allclose(state.params["w"], (2 * ends[0] + 3 * ends[1]) / 5, rtol=1e-12)


@pytest.mark.slow      # the loop backend runs rounds eagerly
@pytest.mark.parametrize("name,hp", [("fedprox", {"mu": 0.3}), ("fedprox_ft", {"mu": 0.3})])
def test_vmapped_and_chunked_equal_loop_backend(ragged_data, name, hp):
    ref_state, ref_metrics, ref_eval = _rounds(name, data=ragged_data, backend="loop", **hp)
    for backend in ("vmap", "chunked"):
        state, metrics, ev = _rounds(name, data=ragged_data, backend=backend, **hp)
        tree_allclose(state.params, ref_state.params, rtol=2e-5, atol=1e-6)
        for a, b in zip(metrics, ref_metrics):
            np.testing.assert_array_equal(a["sampled"], b["sampled"])
            np.testing.assert_allclose(a["train_loss"], b["train_loss"], rtol=2e-5)
        for key in ref_eval:
            np.testing.assert_allclose(ev[key].correct, ref_eval[key].correct)


@pytest.mark.slow
def test_evaluate_honours_ids():
    state, _, full = _rounds("fedprox_ft", rounds=1, mu=0.1)
    algo = algorithms.get("fedprox_ft", model=linear_model(), lr=0.1, batch_size=4, mu=0.1)
    ids = jnp.array([3, 1], jnp.int32)
    sub = algo.evaluate(state, DATA, ids)
    for key in ("client", "global"):
        np.testing.assert_allclose(sub[key].correct, np.asarray(full[key].correct)[[3, 1]])


def test_cli_help_explains_the_flags():
    import run as cli

    text = " ".join(cli.build_parser().format_help().split())
    assert "--fedprox-mu FLOAT μ, weight of the proximal term" in text
    assert "--ft-epochs INT local epochs of fine-tuning" in text
    args = cli.parse(["--algo", "fedprox_ft", "--fedprox-mu", "0.5", "--ft-epochs", "3"])
    hp = algorithms.spec("fedprox_ft").resolve(cli.config_from_args(args).hparams)
    assert (hp["mu"], hp["ft_epochs"]) == (0.5, 3)
