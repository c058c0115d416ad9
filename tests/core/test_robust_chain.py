"""--aggregator on the server chain (`core.server.robust_mean`, `algorithms.engine.server_chain`):
a robust FedAvg round is start + the rule over the trained clients' updates (the rule written
here in NumPy float64 on what the engine's own training gives); centered clipping carries the
previous aggregate as its centre; a server optimiser steps along the robust update; the default
builds today's chain and today's bits; bad combinations are refused in one line."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import linear_model, make_data

from fedjax_pfl import algorithms
from fedjax_pfl.algorithms import engine as engine_lib
from fedjax_pfl.algorithms.engine import EngineConfig
from fedjax_pfl.errors import OptionError

COMMON = {"batch_size": 4, "participation": 0.8, "lr": 0.1}
SIZES = [7, 12, 5, 9, 11, 6, 8, 10, 13, 4]


def flat(tree) -> np.ndarray:
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])


def trained_updates(state, data, key, model):
    """[M, d] float64: the round's clients' updates θ_i − x as the engine trains them."""
    engine = engine_lib.Engine(model, EngineConfig(**COMMON))
    rnd = engine.begin(data, key)
    trained = engine.train(rnd, state.params, opt_rows=state.opt_state, shared_start=True)
    m = rnd.m
    rows = np.concatenate([np.asarray(x, np.float64).reshape(m, -1)
                           for x in jax.tree.leaves(trained.params)], axis=1)
    return rows - flat(state.params)[None], np.asarray(rnd.train_counts, np.float64)


def ref_median(x):
    s = np.sort(x, axis=0)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def ref_multi_krum(x, f, m):
    n = len(x)
    d = ((x[:, None] - x[None]) ** 2).sum(-1)
    scores = [np.sort(np.delete(d[i], i))[:n - f - 2].sum() for i in range(n)]
    return x[np.argsort(scores, kind="stable")[:m]].mean(0)


def ref_cclip(x, w, v, tau):
    a = w / w.sum()
    z = x - v
    return v + a @ (z * np.minimum(1, tau / np.linalg.norm(z, axis=1))[:, None])


@pytest.mark.parametrize("kind,extra,ref", [
    ("median", {}, lambda x, w: ref_median(x)),
    ("multi_krum", {"aggregator_f": 2, "aggregator_m": 3}, lambda x, w: ref_multi_krum(x, 2, 3)),
    ("norm_bound", {"aggregator_radius": 0.05},
     lambda x, w: (w / w.sum()) @ (x / np.maximum(1, np.linalg.norm(x, axis=1) / 0.05)[:, None])),
])
@pytest.mark.slow
def test_a_robust_fedavg_round_is_start_plus_the_rule_over_the_updates(kind, extra, ref):
    data, model = make_data(SIZES, feature_dim=5), linear_model()
    algo = algorithms.get("fedavg", model=model, **COMMON, aggregator=kind, **extra)
    state = algo.init(jax.random.key(0), data)
    for t in range(2):
        key = jax.random.key(10 + t)
        x, w = trained_updates(state, data, key, model)
        want = flat(state.params) + ref(x, w)
        state, _ = algo.round_fn(state, data, key)
        np.testing.assert_allclose(flat(state.params), want, rtol=2e-5, atol=2e-6)


@pytest.mark.slow
def test_centered_clipping_iterates_from_the_previous_rounds_aggregate():
    data, model = make_data(SIZES, feature_dim=5), linear_model()
    tau = 0.02
    algo = algorithms.get("fedavg", model=model, **COMMON, aggregator="centered_clip",
                          aggregator_tau=tau)
    state = algo.init(jax.random.key(0), data)
    center = np.zeros_like(flat(state.params))
    assert np.array_equal(flat(state.server["robust_mean"]), center)     # zeros at the start
    for t in range(3):
        key = jax.random.key(20 + t)
        x, w = trained_updates(state, data, key, model)
        step = ref_cclip(x, w, center, tau)
        want = flat(state.params) + step
        state, _ = algo.round_fn(state, data, key)
        np.testing.assert_allclose(flat(state.params), want, rtol=2e-5, atol=2e-6)
        np.testing.assert_allclose(flat(state.server["robust_mean"]), step, rtol=2e-5, atol=2e-6)
        center = step


@pytest.mark.slow
def test_a_server_optimiser_steps_along_the_robust_update():
    """--server-opt momentum (μ = 0) at η = 0.5 after the median: x + 0.5·median(Δ)."""
    data, model = make_data(SIZES, feature_dim=5), linear_model()
    algo = algorithms.get("fedavg", model=model, **COMMON, aggregator="median",
                          server_opt="momentum", server_opt_momentum=0.0, server_opt_lr=0.5)
    state = algo.init(jax.random.key(0), data)
    key = jax.random.key(3)
    x, _ = trained_updates(state, data, key, model)
    want = flat(state.params) + 0.5 * ref_median(x)
    state, _ = algo.round_fn(state, data, key)
    np.testing.assert_allclose(flat(state.params), want, rtol=2e-5, atol=2e-6)


# -- the default is today's chain -----------------------------------------------------------------


def test_the_default_aggregator_builds_todays_chain():
    for config in (EngineConfig(), EngineConfig(aggregator="mean")):
        assert tuple(link.name for link in engine_lib.server_chain(config).links) == (
            "weighted_mean", "apply_update")
        assert engine_lib.server_chain(config).init({"w": jnp.ones(3)}) == {}
    robust = engine_lib.server_chain(EngineConfig(aggregator="krum"))
    assert tuple(link.name for link in robust.links) == ("robust_mean", "apply_update")
    assert robust.init({"w": jnp.ones(3)}) == {}                       # stateless
    assert "robust_mean" in engine_lib.server_chain(EngineConfig(aggregator="centered_clip")
                                                    ).init({"w": jnp.ones(3)})


@pytest.mark.slow
def test_aggregator_mean_given_keeps_fedavgs_round_bit_for_bit():
    """Three rounds with --aggregator mean given equal the plain run's, and the plain run's
    server step is exactly Σ (n_i/Σn) θ_i of the trained clients (the metrics too)."""
    from fedjax_pfl import core

    data, model = make_data(SIZES, feature_dim=5), linear_model()
    plain = algorithms.get("fedavg", model=model, **COMMON)
    given = algorithms.get("fedavg", model=model, **COMMON, aggregator="mean")
    a = b = plain.init(jax.random.key(0), data)
    for t in range(3):
        key = jax.random.key(t)
        engine = engine_lib.Engine(model, EngineConfig(**COMMON))
        rnd = engine.begin(data, key)
        trained = engine.train(rnd, a.params, opt_rows=a.opt_state, shared_start=True)
        want = core.mean_over_clients(trained.params, rnd.train_counts)
        a, ma = plain.round_fn(a, data, key)
        b, mb = given.round_fn(b, data, key)
        for x, y, z in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params),
                           jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
            np.testing.assert_array_equal(np.asarray(x), np.asarray(z))
        for k in ma:
            np.testing.assert_array_equal(np.asarray(ma[k]), np.asarray(mb[k]), err_msg=k)


# -- refusals -------------------------------------------------------------------------------------


def test_refusals_name_the_flag():
    model = linear_model()
    with pytest.raises(OptionError, match="^scaffold takes no robust aggregator .*control variate"):
        algorithms.get("scaffold", model=model, aggregator="median")
    with pytest.raises(OptionError, match="^fedamp takes no robust aggregator"):
        algorithms.get("fedamp", model=model, aggregator="median")
    with pytest.raises(OptionError, match="^aggregator krum does not apply with dp_clip"):
        algorithms.get("fedavg", model=model, aggregator="krum", dp_clip=1.0)
    algorithms.get("pfedsop", model=model, aggregator="geomed")          # a mean of updates


def test_too_few_clients_a_round_for_f_is_refused_before_the_round():
    data, model = make_data(SIZES, feature_dim=5), linear_model()     # M = 8 of 10
    algo = algorithms.get("fedavg", model=model, **COMMON, aggregator="bulyan", aggregator_f=2)
    with pytest.raises(ValueError, match=r"^--aggregator bulyan --aggregator-f 2: bulyan with "
                                         r"f = 2 needs n >= 4f \+ 3: at least 11 clients a "
                                         r"round, got 8 \(lower"):
        algo.init(jax.random.key(0), data)


@pytest.mark.parametrize("hparams,refused", [
    ({"aggregator": "krum", "aggregator_beta": 0.2}, "aggregator_beta applies to aggregator "
                                                     "trimmed_mean only, not aggregator krum"),
    ({"aggregator_tau": 1.0}, "aggregator_tau applies to aggregator centered_clip only"),
    ({"aggregator": "median", "dp_clip": 1.0}, "aggregator does not apply with dp_clip"),
])
def test_a_setting_the_run_does_not_use_is_refused(hparams, refused):
    from fedjax_pfl import runner

    with pytest.raises(OptionError, match=f"^{refused}"):
        runner.RunConfig.from_options(algo="fedavg", hparams=hparams)


def test_the_command_line_refuses_in_one_line(capsys):
    import run as cli  # experiments/run.py

    with pytest.raises(SystemExit) as exc:
        cli.main(["--algo", "fedavg", "--aggregator", "median", "--dp-clip", "1", "--rounds", "1",
                  "--quiet"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--aggregator does not apply with --dp-clip" in err
