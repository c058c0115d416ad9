"""Local, FedAvg and FedAvg-FT: hand-computed rounds, backend equivalence, compile-once, registry."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_states_close, linear_model, tree_equal

from fedjax_pfl import algorithms, core
from fedjax_pfl.data.federated import FederatedData
from fedjax_pfl.models.model import Model

# Per-example loss ½‖w − x‖²: the full-batch gradient at w is w − mean(x).
QUADRATIC = Model(init=lambda key: {"w": jnp.zeros(2)}, apply=lambda p, x: p["w"] - x,
                  loss=lambda out, y: 0.5 * jnp.sum(out**2, axis=-1))


def quadratic_data():
    # Client A trains on [1,0], [3,0] (mean [2,0]); client B on [0,3], [0,6], [0,0] (mean [0,3]).
    # Test rows are extra rows that must not influence training or the weights.
    x = np.array([[1, 0], [3, 0], [0, 3], [0, 6], [0, 0], [9, 9], [9, 9], [9, 9]], np.float64)
    return FederatedData.from_arrays(x, np.zeros(8), [np.array([0, 1]), np.array([2, 3, 4])],
                                     [np.array([5]), np.array([6, 7])], num_classes=1)


def test_fedavg_round_by_hand(x64):
    # One epoch, full batch, η = 0.5, from w = 0: w_A = 0.5·[2,0] = [1,0]; w_B = 0.5·[0,3] = [0,1.5].
    # Weights are TRAIN counts 2 and 3: θ = (2·[1,0] + 3·[0,1.5]) / 5 = [0.4, 0.9].
    algo = algorithms.get("fedavg", model=QUADRATIC, participation=1.0, lr=0.5, batch_size=8)
    state = algo.init(jax.random.key(0), quadratic_data())
    state, m = jax.jit(algo.round_fn)(state, quadratic_data(), jax.random.key(1))
    np.testing.assert_allclose(state.params["w"], [0.4, 0.9], rtol=1e-12)
    # Round 2 from θ = [0.4, 0.9]: w_A = θ − 0.5(θ − [2,0]) = [1.2, 0.45]; w_B = [0.2, 1.95].
    # θ' = (2·[1.2, 0.45] + 3·[0.2, 1.95]) / 5 = [0.6, 1.35].
    state, m = jax.jit(algo.round_fn)(state, quadratic_data(), jax.random.key(2))
    np.testing.assert_allclose(state.params["w"], [0.6, 1.35], rtol=1e-12)
    np.testing.assert_array_equal(m["sampled"], [0, 1])
    assert int(m["client_steps"]) == 2


def _run(name, data, backend, rounds=3, **hp):
    model = linear_model()
    algo = algorithms.get(name, model=model, backend=backend, chunk_size=2, lr=0.1,
                          batch_size=4, local_epochs=2, participation=0.75, **hp)
    step = algo.round_fn if backend == "loop" else jax.jit(algo.round_fn)
    state = algo.init(jax.random.key(0), data)
    metrics = []
    for r in range(rounds):
        state, m = step(state, data, jax.random.fold_in(jax.random.key(1), r))
        metrics.append(m)
    return state, metrics, algo.evaluate(state, data)


@pytest.mark.slow
@pytest.mark.parametrize("name,hp", [      # the loop backend runs eagerly: ~20 s of CPU each
    ("fedavg", {}),
    pytest.param("local", {"momentum": 0.9, "momentum_buffer": "persist"}, marks=pytest.mark.slow),
    pytest.param("fedavg_ft", {"ft_epochs": 2}, marks=pytest.mark.slow)])
def test_vmapped_and_chunked_equal_loop_backend(ragged_data, name, hp):
    ref_state, ref_metrics, ref_eval = _run(name, ragged_data, "loop", **hp)
    for backend in ("vmap", "chunked"):
        state, metrics, ev = _run(name, ragged_data, backend, **hp)
        assert_states_close(state, ref_state)
        for a, b in zip(metrics, ref_metrics):
            np.testing.assert_array_equal(a["sampled"], b["sampled"])
            np.testing.assert_allclose(a["train_loss"], b["train_loss"], rtol=2e-5)
        for key in ref_eval:
            np.testing.assert_allclose(ev[key].correct, ref_eval[key].correct)


@pytest.mark.slow
def test_unsampled_clients_are_bitwise_unchanged_in_local(ragged_data):
    algo = algorithms.get("local", model=linear_model(), participation=0.5, momentum=0.9,
                          momentum_buffer="persist")
    state = algo.init(jax.random.key(0), ragged_data)
    new, m = jax.jit(algo.round_fn)(state, ragged_data, jax.random.key(3))
    sampled = set(np.asarray(m["sampled"]).tolist())
    assert len(sampled) == 2
    for i in range(4):
        old_i = jax.tree.map(lambda x: x[i], (state.params, state.opt_state))
        new_i = jax.tree.map(lambda x: x[i], (new.params, new.opt_state))
        if i in sampled:
            assert not np.array_equal(old_i[0]["w"], new_i[0]["w"])
        else:
            tree_equal(old_i, new_i)


@pytest.mark.slow
def test_round_fn_compiles_once(ragged_data):
    algo = algorithms.get("fedavg", model=linear_model(), participation=0.5)
    traced = chex.assert_max_traces(algo.round_fn, n=1)
    step = jax.jit(traced)
    state = algo.init(jax.random.key(0), ragged_data)
    for r in range(4):
        state, _ = step(state, ragged_data, jax.random.key(r))


@pytest.mark.slow
def test_fedavg_ft_fine_tunes_the_global_model_before_evaluation(ragged_data):
    algo = algorithms.get("fedavg_ft", model=linear_model(), participation=1.0, ft_epochs=3)
    state = algo.init(jax.random.key(0), ragged_data)
    state, _ = jax.jit(algo.round_fn)(state, ragged_data, jax.random.key(1))
    ev = algo.evaluate(state, ragged_data)
    plain = algorithms.get("fedavg", model=linear_model(), participation=1.0)
    np.testing.assert_array_equal(ev["global"].correct, plain.evaluate(state, ragged_data)["client"].correct)
    # The personalised models are the global model after ft_epochs of local SGD from the same
    # per-client keys: reproduce them with the engine's trainer and evaluate those.
    trainer = core.LocalTrainer(linear_model(), optax.sgd(0.05), epochs=3, batch_size=10,
                                mapper=core.client_mapper("loop"))
    ids = jnp.arange(4)
    keys = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.fold_in(state.rng, state.round), ids)
    tuned = trainer(ragged_data, core.broadcast(state.params, 4),
                    core.broadcast(trainer.init_opt_state(state.params), 4), ragged_data.clients, keys)
    expected = core.Evaluator(linear_model(), batch_size=7, mapper=core.client_mapper("loop"))
    np.testing.assert_allclose(ev["client"].loss_sum,
                               expected.personal(ragged_data, tuned.params).loss_sum, rtol=1e-5)
    assert not np.allclose(ev["client"].loss_sum, ev["global"].loss_sum)


def test_registry_validates_hyperparameters():
    model = linear_model()
    with pytest.raises(ValueError, match="unknown algorithm 'fedsgd'"):
        algorithms.get("fedsgd", model=model)
    with pytest.raises(ValueError, match=r"--participation must be in \(0, 1\], got 1.5"):
        algorithms.get("fedavg", model=model, participation=1.5)
    with pytest.raises(ValueError, match="--lr must be > 0"):
        algorithms.get("fedavg", model=model, lr=0.0)
    with pytest.raises(ValueError, match="has no hyperparameter ft_epochs"):
        algorithms.get("fedavg", model=model, ft_epochs=2)
    with pytest.raises(ValueError, match="--momentum-buffer must be one of"):
        algorithms.get("local", model=model, momentum_buffer="keep")
    assert algorithms.get("fedavg_ft", model=model).hparams["ft_epochs"] == 1


@pytest.mark.slow
def test_every_algorithm_starts_from_the_same_model(ragged_data):
    # "Same initialization for all methods" (pFedSOP §V; PGFed code): from one key, every
    # algorithm's round-0 models are the same, so they evaluate identically before training.
    evals = {}
    for name, hp in (("fedavg", {}), ("local", {}), ("pfedsop", {}), ("pgfed", {}),
                     ("pgfedmo", {}), ("pfedme", {}), ("fedavg_sar", {}), ("tdpfed", {"cr": 1.0})):
        algo = algorithms.get(name, model=linear_model(), **hp)
        evals[name] = algo.evaluate(algo.init(jax.random.key(5), ragged_data), ragged_data)["client"]
    for name, ev in evals.items():
        np.testing.assert_allclose(ev.loss_sum, evals["fedavg"].loss_sum, rtol=1e-6, err_msg=name)


@pytest.mark.slow
def test_fedavg_rounds_on_a_linear_model_by_hand(x64):
    # Linear regression ŷ = w·x, per-example loss ½(w·x − y)², full batches, one epoch, η = 0.5.
    # Client A: x = [1,0], y = 2 and x = [0,1], y = 1.  Client B: x = [1,1], y = 1.
    linear = Model(init=lambda key: {"w": jnp.zeros(2)}, apply=lambda p, x: x @ p["w"],
                   loss=lambda out, y: 0.5 * (out - y) ** 2)
    x = np.array([[1, 0], [0, 1], [1, 1], [5, 5]], np.float64)
    y = np.array([2, 1, 1, 0])
    data = FederatedData.from_arrays(x, y, [np.array([0, 1]), np.array([2])],
                                     [np.array([3]), np.array([3])], num_classes=3)
    algo = algorithms.get("fedavg", model=linear, participation=1.0, lr=0.5, batch_size=4)
    state = algo.init(jax.random.key(0), data)
    step = jax.jit(algo.round_fn)
    # Round 1 from w = 0: ∇f = −mean(y·x). A: −[1, 0.5] → w_A = [0.5, 0.25]; B: −[1, 1] →
    # w_B = [0.5, 0.5]. Weights 2 : 1 → θ = [0.5, 1/3].
    state, _ = step(state, data, jax.random.key(1))
    np.testing.assert_allclose(state.params["w"], [0.5, 1 / 3], rtol=1e-12)
    # Round 2 from θ = [0.5, 1/3]. A: residuals −1.5 and −2/3 → ∇f = [−0.75, −1/3] →
    # w_A = [0.875, 0.5]. B: residual −1/6 → ∇f = [−1/6, −1/6] → w_B = [7/12, 5/12].
    # θ' = (2·w_A + w_B)/3 = [(1.75 + 7/12)/3, (1 + 5/12)/3] = [7/9, 17/36].
    state, _ = step(state, data, jax.random.key(2))
    np.testing.assert_allclose(state.params["w"], [7 / 9, 17 / 36], rtol=1e-12)
