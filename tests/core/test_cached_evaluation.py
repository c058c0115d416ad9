"""core.CachedEvaluation: a client's personalised model is evaluated again only after a round
changed it, and the results equal a fresh evaluation of every client."""

import jax
import numpy as np
import pytest
from helpers import linear_model, make_data

from fedjax_pfl import algorithms, core


def _algorithm(name, **hp):
    """Algorithm `name` on the linear model with its declared test configuration."""
    return algorithms.get(name, model=linear_model(),
                          **{**algorithms.spec(name).test_hparams, **hp})


# Every registered algorithm that splits its evaluation (`evaluate_parts`); a new one is covered
# when it registers.
PARTED = [n for n in algorithms.names() if _algorithm(n).evaluate_parts is not None]
# Algorithms of one module share their evaluate (pgfed, pgfedmo and pgfed_ce: algorithms/pgfed.py):
# one of each module stands for the others. The quick suite keeps PGFedMo.
QUICK = "pgfedmo"
_MODULES = {algorithms.spec(QUICK).factory.__module__}
CASES = [QUICK]
for _name in PARTED:
    if algorithms.spec(_name).factory.__module__ not in _MODULES:
        _MODULES.add(algorithms.spec(_name).factory.__module__)
        CASES.append(pytest.param(_name, marks=pytest.mark.slow))


def _program(name, data):
    algo = _algorithm(name, participation=0.3, batch_size=4)
    return core.Program(algo, data, mesh=None)


def test_the_personalised_algorithms_declare_their_parts():
    # Each keeps a personalised model per client that only its sampled rounds change. pFedMe and
    # TDPFed train every client every round, so theirs change every round: no parts. (At least
    # these: an algorithm registered later may declare parts too.)
    assert {"ditto", "local", "pfedsop", "pgfed", "pgfedmo", "pgfed_ce"} <= set(PARTED)
    assert not {"pfedme", "tdpfed", "fedavg"} & set(PARTED)


@pytest.mark.matrix
@pytest.mark.parametrize("name", CASES)
@pytest.mark.slow
def test_cached_evaluation_equals_a_fresh_evaluation_of_every_client(name, monkeypatch):
    data = make_data([7, 23, 12, 1, 9, 5, 14, 3, 8, 11])     # 10 clients, 3 sampled a round
    program = _program(name, data)
    evaluation = core.CachedEvaluation(program)
    evaluated = []                         # the clients each "rows" call evaluated
    part = program.evaluate_part

    def spy(which, state, ids=None):
        if which == "rows":
            evaluated.append(np.arange(program.num_clients) if ids is None else np.unique(ids))
        return part(which, state, ids)

    monkeypatch.setattr(program, "evaluate_part", spy)
    state = program.init(jax.random.key(0))
    keys = jax.random.key(5)
    first = evaluation(state)                                  # round 0: everyone
    since = set()
    for r in range(5):
        state, metrics = program.run_rounds(state, keys, r, 1)
        sampled = np.asarray(metrics[0]["sampled"])
        evaluation.changed(sampled)
        since |= set(sampled.tolist())
        if r == 1:                    # no evaluation after round 2: two rounds' clients are due
            continue
        ids = np.array([0, 4, 2]) if r == 3 else None          # an --eval-clients subset
        calls = len(evaluated)
        got, want = evaluation(state, ids), program.evaluate(state, ids)
        assert list(got) == list(want)                          # same entries, same order
        for entry in want:
            for g, w in zip(got[entry], want[entry], strict=True):
                assert (g is None) == (w is None)               # ClientEval.loss_count: absent
                if w is not None:
                    np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6,
                                               err_msg=f"{entry}, round {r + 1}")
        wanted = set(range(10)) if ids is None else set(ids.tolist())
        now = set().union(*(set(e.tolist()) for e in evaluated[calls:]))
        assert now == since & wanted, r                         # only the changed ones
        since -= wanted
    assert set(first) == set(program.evaluate(state))
    # In groups of 4 (the power of two at or above the 3 sampled), the first evaluation too.
    assert set(np.concatenate(evaluated[:3]).tolist()) == set(range(10))
    assert all(e.size <= 4 for e in evaluated)


def test_without_parts_it_is_the_programs_evaluation():
    data = make_data([7, 23, 12])
    program = _program("fedavg", data)
    state = program.init(jax.random.key(0))
    got, want = core.CachedEvaluation(program)(state), program.evaluate(state)
    np.testing.assert_array_equal(got["client"].loss_sum, want["client"].loss_sum)
