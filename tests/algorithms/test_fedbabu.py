"""FedBABU: the head bit for bit frozen through federated rounds (momentum buffers included),
federated training = FedAvg on a body-only model = FedRep with τ_h = 0, evaluation = FedAvg-FT's
fine-tuning of the whole model (which moves the head), backends equal, --help."""

import functools

import jax
import numpy as np
import optax
import pytest
from helpers import make_data, tree_allclose, tree_equal

from fedjax_pfl import algorithms, core, models
from fedjax_pfl.algorithms import fedavg as fedavg_lib
from fedjax_pfl.core.local import LocalTrainer
from fedjax_pfl.models import nets
from fedjax_pfl.models import split as split_lib
from fedjax_pfl.models.model import Model

MLP = models.from_flax(nets.MLP(3, hidden=(4,)), (5,))       # Dense_0 (body) → Dense_1 (head)
DATA = make_data([7, 23, 12, 9])
COMMON = dict(lr=0.1, batch_size=4, participation=0.5)


@functools.lru_cache(maxsize=None)
def _run(backend, rounds=3, **hp):
    algo = algorithms.get("fedbabu", model=MLP, backend=backend, **COMMON, **hp)
    state = algo.init(jax.random.key(0), DATA)
    step = algo.round_fn if backend == "loop" else jax.jit(algo.round_fn)
    states, metrics = [state], []
    for r in range(rounds):
        state, m = step(state, DATA, jax.random.key(r))
        states.append(state)
        metrics.append(m)
    return algo, states, metrics


def head(params):
    return split_lib.split(params, split_lib.personal_mask(params, "head"))[1]


@pytest.mark.slow
def test_head_never_changes_during_federated_rounds():
    # The global head (the server keeps θ_H^0); that local training leaves it too is the next
    # test's: unfrozen heads would change the bodies' gradients.
    _, states, _ = _run("vmap", momentum=0.9, momentum_buffer="persist")
    for s in states[1:]:
        tree_equal(head(s.params), head(states[0].params))
        assert not np.array_equal(s.params["Dense_0"]["kernel"], states[0].params["Dense_0"]["kernel"])


@pytest.mark.slow
def test_federated_training_is_fedavg_on_the_body_and_fedrep_without_head_epochs():
    _, states, metrics = _run("vmap", momentum=0.9, momentum_buffer="persist")
    params0 = states[0].params
    mask = split_lib.personal_mask(params0, "head")
    body_only = Model(init=lambda key: split_lib.split(MLP.init(key), mask)[0],
                      apply=lambda b, x: MLP.apply(split_lib.merge(b, head(params0), mask), x))
    fedavg = algorithms.get("fedavg", model=body_only, momentum=0.9, momentum_buffer="persist",
                            **COMMON)
    fedrep = algorithms.get("fedrep", model=MLP, head_epochs=0, local_epochs=1, momentum=0.9,
                            momentum_buffer="persist", **COMMON)
    s_avg, s_rep = fedavg.init(jax.random.key(0), DATA), fedrep.init(jax.random.key(0), DATA)
    for r in range(3):
        s_avg, m_avg = jax.jit(fedavg.round_fn)(s_avg, DATA, jax.random.key(r))
        s_rep, _ = jax.jit(fedrep.round_fn)(s_rep, DATA, jax.random.key(r))
        np.testing.assert_array_equal(metrics[r]["sampled"], m_avg["sampled"])
        tree_allclose(states[r + 1].params["Dense_0"], s_avg.params["Dense_0"], rtol=1e-6, atol=1e-7)
        tree_allclose(states[r + 1].params["Dense_0"], s_rep.body["Dense_0"], rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(metrics[r]["train_loss"], m_avg["train_loss"], rtol=1e-6)


@pytest.mark.slow
def test_evaluation_fine_tunes_the_whole_model_as_fedavg_ft():
    # Default fine-tuning lr: --lr / 5 = 0.02.
    algo, states, _ = _run("vmap", finetune_epochs=2)
    state = states[-1]
    evals = jax.jit(algo.evaluate)(state, DATA)
    # FedAvg-FT with lr 0.02 and 2 fine-tuning epochs, holding FedBABU's global model.
    ft = algorithms.get("fedavg_ft", model=MLP, ft_epochs=2, batch_size=4, lr=0.02)
    expected = jax.jit(ft.evaluate)(fedavg_lib.State(state.params, None, {}, state.round, state.rng),
                                    DATA)
    tree_equal(evals["client"], expected["client"])
    tree_equal(evals["global"], expected["global"])
    assert not np.array_equal(evals["client"].loss_sum, evals["global"].loss_sum)
    # The fine-tuned models' heads moved away from the frozen initial head.
    trainer = LocalTrainer(MLP, optax.sgd(0.02), epochs=2, batch_size=4,
                           mapper=core.client_mapper("vmap", 0))
    ids = np.arange(DATA.num_clients)
    tuned = trainer(DATA, state.params, core.broadcast(trainer.init_opt_state(state.params), 4),
                    core.gather(DATA.clients, ids), jax.random.split(jax.random.key(0), 4),
                    shared_start=True).params
    for i in ids:
        assert not np.array_equal(tuned["Dense_1"]["kernel"][i], state.params["Dense_1"]["kernel"])


@pytest.mark.slow      # the loop backend runs the round eagerly
def test_backends_agree():
    algo, ref_states, _ = _run("loop")
    ref_eval = algo.evaluate(ref_states[-1], DATA)
    for backend in ("vmap", "chunked"):
        extra = {"chunk_size": 1} if backend == "chunked" else {}
        algo, states, _ = _run(backend, **extra)
        tree_allclose(states[-1].params, ref_states[-1].params, rtol=2e-5, atol=1e-6)
        np.testing.assert_allclose(algo.evaluate(states[-1], DATA)["client"].correct,
                                   ref_eval["client"].correct)


def test_help_explains_the_flags():
    import run as cli

    text = " ".join(cli.build_parser().format_help().split())
    assert "--fedbabu-finetune-epochs" in text and "epochs of fine-tuning the whole global model" in text
    assert "--fedbabu-finetune-lr" in text and "--lr / 5" in text
    assert "--fedbabu-head" in text and "frozen at its initialisation" in text
