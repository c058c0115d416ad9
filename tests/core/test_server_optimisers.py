"""Server optimisers (--server-opt, `core.server.server_optimizer`, `ops.server_opt`): FedAvgM,
FedAdam, FedYogi and FedAdagrad against a float64 NumPy transcription of Reddi et al.'s
Algorithm 2 ("Adaptive Federated Optimization", ICLR 2021) written here, fed the mean update
Δ_t that FedAvg's own round computes from the same state; the default chain is today's; the
optimiser's state survives a checkpoint exactly; sweeps over --server-lr equal separate runs;
algorithms without an averaged pseudo-gradient refuse it in one line."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import linear_model, make_data

from fedjax_pfl import algorithms
from fedjax_pfl.algorithms import engine as engine_lib
from fedjax_pfl.algorithms import registry
from fedjax_pfl.algorithms.engine import EngineConfig
from fedjax_pfl.errors import OptionError

LR, B1, B2, TAU, MU = 0.05, 0.9, 0.99, 1e-3, 0.9
COMMON = {"batch_size": 4, "participation": 0.5, "lr": 0.1}


# -- the reference: Reddi et al. 2021, Algorithm 2 (and FedAvgM), in float64 ----------------------


def reference_step(kind: str, x, delta, m, v, t: int, *, lr, momentum=0.0, b1=B1, b2=B2,
                   tau=TAU, bias_correction=False):
    """One server step of Algorithm 2 on flat float64 arrays: (x_{t+1}, m_t, v_t) from x_t, Δ_t,
    m_{t−1}, v_{t−1} (t counts from 1). FedAvgM (Hsu et al. 2019; Reddi et al. Section 5): the
    momentum buffer m_t = μ m_{t−1} + Δ_t, x_{t+1} = x_t + η m_t, or with Nesterov's look-ahead
    x_t + η (Δ_t + μ m_t). Bias correction: Kingma & Ba's m̂ = m/(1 − β1^t), v̂ = v/(1 − β2^t)."""
    if kind == "sgd":
        return x + lr * delta, m, v
    if kind in ("momentum", "nesterov"):
        m = momentum * m + delta
        step = delta + momentum * m if kind == "nesterov" else m
        return x + lr * step, m, v
    m = b1 * m + (1 - b1) * delta
    if kind == "adagrad":
        v = v + delta ** 2
    elif kind == "adam":
        v = b2 * v + (1 - b2) * delta ** 2
    elif kind == "yogi":
        v = v - (1 - b2) * delta ** 2 * np.sign(v - delta ** 2)
    if bias_correction:
        return x + lr * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + tau), m, v
    return x + lr * m / (np.sqrt(v) + tau), m, v


def reference_init(kind: str, size: int, *, bias_correction=False):
    """m_{−1} = 0; v_{−1} = τ² (Algorithm 2's smallest allowed start), 0 for Kingma & Ba's."""
    v0 = 0.0 if bias_correction or kind in ("sgd", "momentum", "nesterov") else TAU ** 2
    return np.zeros(size), np.full(size, v0)


def flat(tree) -> np.ndarray:
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])


def moments(kind: str, opt_state, bias_correction=False):
    """(m, v) of the optax state as the reference keeps them: the optimiser sees g = −Δ, so its
    first moment (or momentum trace) is −m; v is a square and keeps its sign."""
    inner = opt_state[0]
    if kind in ("momentum", "nesterov"):
        return -flat(inner.trace), None
    if bias_correction:
        return -flat(inner.mu), flat(inner.nu)
    return -flat(inner.m), flat(inner.v)


CASES = {
    "fedavgm": dict(server_opt="momentum", server_opt_momentum=MU),
    "fedavgm-nesterov": dict(server_opt="nesterov", server_opt_momentum=MU),
    "fedadam": dict(server_opt="adam", server_opt_b1=B1, server_opt_b2=B2, server_opt_eps=TAU),
    "fedyogi": dict(server_opt="yogi", server_opt_b1=B1, server_opt_b2=B2, server_opt_eps=TAU),
    "fedadagrad": dict(server_opt="adagrad", server_opt_b1=B1, server_opt_eps=TAU),
    "adam-bias-corrected": dict(server_opt="adam", server_opt_b1=B1, server_opt_b2=B2,
                                server_opt_eps=TAU, server_opt_bias_correction=True),
}


def _data():
    return make_data([7, 12, 5, 9, 11, 6], feature_dim=5)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.slow
def test_three_rounds_follow_reddi_algorithm_2(case):
    """Each round t: Δ_t is what plain FedAvg's round makes of the same state with the same key
    (the mean model − x_t), the reference steps x_t with it, and the server optimiser's round
    must land on the reference's x_{t+1} with the reference's m_t and v_t."""
    settings = CASES[case]
    kind, bias = settings["server_opt"], settings.get("server_opt_bias_correction", False)
    data, model = _data(), linear_model()
    opt = algorithms.get("fedavg", model=model, **COMMON, server_opt_lr=LR, **settings)
    plain = algorithms.get("fedavg", model=model, **COMMON)
    state = opt.init(jax.random.key(0), data)
    x = flat(state.params)
    m, v = reference_init(kind, x.size, bias_correction=bias)
    for t in range(1, 4):
        key = jax.random.key(100 + t)
        mean_state, _ = plain.round_fn(state._replace(server={}), data, key)
        delta = flat(mean_state.params) - flat(state.params)
        want_x, m, v = reference_step(kind, flat(state.params), delta, m, v, t, lr=LR,
                                      momentum=settings.get("server_opt_momentum", 0.0),
                                      bias_correction=bias)
        state, _ = opt.round_fn(state, data, key)
        assert np.abs(delta).max() > 1e-3            # the clients moved: a real pseudo-gradient
        np.testing.assert_allclose(flat(state.params), want_x, rtol=2e-6, atol=2e-7,
                                   err_msg=f"{case} x_{t}")
        got_m, got_v = moments(kind, state.server["server_opt"], bias)
        np.testing.assert_allclose(got_m, m, rtol=2e-5, atol=1e-9, err_msg=f"{case} m_{t}")
        if got_v is not None:
            np.testing.assert_allclose(got_v, v, rtol=2e-5, atol=1e-12, err_msg=f"{case} v_{t}")


@pytest.mark.slow
def test_fedavgm_with_momentum_zero_is_fedavg_with_a_server_learning_rate():
    """μ = 0: x_{t+1} = x_t + η Δ_t, each round, from Δ_t of plain FedAvg's round."""
    data, model = _data(), linear_model()
    eta = 0.7
    fedavgm = algorithms.get("fedavg", model=model, **COMMON, server_opt="momentum",
                             server_opt_momentum=0.0, server_opt_lr=eta)
    plain = algorithms.get("fedavg", model=model, **COMMON)
    state = fedavgm.init(jax.random.key(0), data)
    for t in range(1, 4):
        key = jax.random.key(t)
        mean_state, _ = plain.round_fn(state._replace(server={}), data, key)
        delta = flat(mean_state.params) - flat(state.params)
        want = flat(state.params) + eta * delta
        state, _ = fedavgm.round_fn(state, data, key)
        np.testing.assert_allclose(flat(state.params), want, rtol=2e-6, atol=2e-7)


@pytest.mark.slow
def test_with_privacy_the_optimiser_steps_along_the_noised_mean_update():
    """clip → noised mean → optimiser: Δ_t is DP-FedAvg's x_t + noised mean − x_t (the same
    noise, from the round's key), then Algorithm 2's FedAdam step."""
    data, model = _data(), linear_model()
    dp = {"dp_clip": 0.05, "dp_noise_multiplier": 1.0}
    opt = algorithms.get("fedavg", model=model, **COMMON, **dp, server_opt="adam",
                         server_opt_lr=LR)
    private = algorithms.get("fedavg", model=model, **COMMON, **dp)
    state = opt.init(jax.random.key(0), data)
    m, v = reference_init("adam", flat(state.params).size)
    for t in range(1, 4):
        key = jax.random.key(t)
        noised, _ = private.round_fn(state._replace(server={}), data, key)
        delta = flat(noised.params) - flat(state.params)
        want, m, v = reference_step("adam", flat(state.params), delta, m, v, t, lr=LR)
        state, _ = opt.round_fn(state, data, key)
        np.testing.assert_allclose(flat(state.params), want, rtol=2e-6, atol=2e-7)


# -- the defaults are today's chain ---------------------------------------------------------------


@pytest.mark.parametrize("dp", [{}, {"dp_clip": 1.0}, {"dp_clip": 1.0, "dp_clip_quantile": 0.5}],
                         ids=["plain", "private", "adaptive"])
def test_the_default_chain_is_todays(dp):
    """SGD at η = 1 (given or not) builds the chain of before the server optimisers, with no
    optimiser link (start + 1·(mean − start) is not the mean in floating point) and no state of
    its own; any other setting replaces apply_update with the optimiser."""
    today = {(): ("weighted_mean", "apply_update"),
             ("dp_clip",): ("clip", "noised_mean", "apply_update"),
             ("dp_clip", "dp_clip_quantile"): ("adaptive_clip", "noised_mean", "apply_update")}
    want = today[tuple(dp)]
    for config in (EngineConfig(**dp), EngineConfig(**dp, server_opt="sgd", server_opt_lr=1.0)):
        chain = engine_lib.server_chain(config)
        assert tuple(link.name for link in chain.links) == want
    params = {"w": jnp.ones((3, 2))}
    assert "server_opt" not in engine_lib.server_chain(EngineConfig(**dp)).init(params)
    other = engine_lib.server_chain(EngineConfig(**dp, server_opt_lr=0.5))
    assert tuple(link.name for link in other.links) == want[:-1] + ("server_opt",)


def test_a_default_fedavg_round_is_the_weighted_mean_bit_for_bit():
    """Today's FedAvg server step, exactly: Σ (n_i/Σn) θ_i of the trained clients."""
    from fedjax_pfl import core

    data, model = _data(), linear_model()
    algo = algorithms.get("fedavg", model=model, **COMMON)
    engine = engine_lib.Engine(model, EngineConfig(**COMMON))
    state = algo.init(jax.random.key(0), data)
    key = jax.random.key(5)
    new, _ = algo.round_fn(state, data, key)
    rnd = engine.begin(data, key)
    trained = engine.train(rnd, state.params, opt_rows=state.opt_state, shared_start=True)
    want = core.mean_over_clients(trained.params, rnd.train_counts)
    for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# -- which algorithms take one --------------------------------------------------------------------


def _aggregates(name: str) -> bool:
    """Whether algorithm `name`'s round sends uploads through `Engine.aggregate` (traced, not
    run: jax.eval_shape of its test configuration's round)."""
    calls = []
    original = engine_lib.Engine.aggregate

    def recording(self, *args, **kwargs):
        calls.append(name)
        return original(self, *args, **kwargs)

    data = make_data([7, 9, 5, 8], feature_dim=5)
    spec = algorithms.spec(name)
    algo = algorithms.get(name, model=linear_model(), **dict(spec.test_hparams or {}))
    state = algo.init(jax.random.key(0), data)
    engine_lib.Engine.aggregate = recording
    try:
        jax.eval_shape(algo.round_fn, state, data, jax.random.key(1))
    finally:
        engine_lib.Engine.aggregate = original
    return bool(calls)


@pytest.mark.slow
def test_every_algorithm_that_aggregates_is_declared_and_the_others_refuse():
    """The table (`registry.SERVER_OPTIMISED`, `NO_SERVER_OPTIMISER`) against the code: every
    algorithm whose round calls Engine.aggregate is in one of them (taking the optimiser, its
    state shaped like the value it aggregates, or refusing it with its reason), and none that
    does not call it takes one."""
    data = make_data([7, 9, 5, 8], feature_dim=5)
    for name in algorithms.names():
        aggregates = _aggregates(name)
        declared = name in registry.SERVER_OPTIMISED or name in registry.NO_SERVER_OPTIMISER
        assert aggregates == declared, f"{name}: aggregates={aggregates}, declared={declared}"
        hparams = {**dict(algorithms.spec(name).test_hparams or {}), "server_opt": "adam"}
        if name in registry.SERVER_OPTIMISED:
            algo = algorithms.get(name, model=linear_model(), **hparams)
            state = algo.init(jax.random.key(0), data)
            new, _ = jax.eval_shape(algo.round_fn, state, data, jax.random.key(1))
            assert "server_opt" in state.server and "server_opt" in new.server, name
        else:
            with pytest.raises(OptionError, match=f"^{name} takes no server optimiser"):
                algorithms.get(name, model=linear_model(), **hparams)


@pytest.mark.parametrize("algo,flags", [
    ("fedamp", ["--server-opt", "adam"]),
    ("local", ["--server-lr", "0.5"]),
    ("scaffold", ["--server-opt", "momentum"]),
    ("pfedsop", ["--server-lr", "0.5"]),
])
def test_an_algorithm_without_a_server_pseudo_gradient_refuses_in_one_line(algo, flags, capsys):
    import run as cli  # experiments/run.py

    with pytest.raises(SystemExit) as exc:
        cli.main(["--algo", algo, *flags, "--rounds", "1", "--quiet"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"--algo {algo} takes no server optimiser" in err and flags[0] in err
    from fedjax_pfl import runner

    with pytest.raises(OptionError, match="takes no server optimiser"):
        runner.RunConfig.from_options(algo=algo, hparams={
            "server_opt" if flags[0] == "--server-opt" else "server_opt_lr":
                flags[1] if flags[0] == "--server-opt" else 0.5})


def test_scaffolds_server_lr_is_not_the_server_optimisers():
    """`server_lr` is SCAFFOLD's own η_g (--scaffold-server-lr); elsewhere the name points to
    server_opt_lr (--server-lr), the server optimiser's learning rate."""
    from fedjax_pfl import runner

    assert runner.RunConfig.from_options(algo="scaffold", server_lr=0.5).hparams == {"server_lr": 0.5}
    with pytest.raises(OptionError, match="^server_lr is SCAFFOLD's η_g; .* is server_opt_lr$"):
        runner.RunConfig.from_options(algo="fedavg", server_lr=0.5)


@pytest.mark.parametrize("given,refused", [
    ({"server_opt_momentum": 0.5}, "server_opt_momentum"),                   # sgd has none
    ({"server_opt": "adagrad", "server_opt_b2": 0.9}, "server_opt_b2"),      # Adagrad has no β2
    ({"server_opt": "yogi", "server_opt_bias_correction": True}, "server_opt_bias_correction"),
    ({"server_opt": "momentum", "server_opt_eps": 0.1}, "server_opt_eps"),
])
def test_a_setting_of_another_optimiser_is_refused(given, refused):
    from fedjax_pfl import runner

    with pytest.raises(OptionError, match=f"^{refused} applies to server_opt"):
        runner.RunConfig.from_options(algo="fedavg", hparams=given)


# -- checkpoints and sweeps -----------------------------------------------------------------------

FLAGS = ["--server-opt", "adam", "--server-lr", "0.03"]


@pytest.mark.slow
def test_resume_restores_the_server_optimiser_state_exactly(tmp_path):
    """FedAdam stopped at round 2 and resumed to round 4: the same metrics and final state bit
    for bit as an uninterrupted run, its moments m and v included (and they moved)."""
    import helpers
    import run as cli

    from fedjax_pfl import checkpoint, runner

    config = lambda out, rounds, *more: helpers.default_config("fedavg", tmp_path / out, rounds,
                                                               *FLAGS, *more, checkpoint_every=2)
    prep = runner.prepare(cli.config_from_args(cli.parse(["--algo", "fedavg", "--quiet", *FLAGS])))
    quiet = lambda *_: None
    runner.run(config("full", 4), prepared=prep, log=quiet)
    runner.run(config("resumed", 2), prepared=prep, log=quiet)
    runner.run(config("resumed", 4, "--resume"), prepared=prep, log=quiet)
    assert helpers.metric_rows(tmp_path / "resumed") == helpers.metric_rows(tmp_path / "full")
    like = prep.program.init(jax.random.fold_in(prep.root, 0))
    final = [checkpoint.restore(str(tmp_path / run / "checkpoints" / "round_000004"), like=like)
             for run in ("full", "resumed")]
    for x, y in zip(jax.tree.leaves(final[0]), jax.tree.leaves(final[1]), strict=True):
        np.testing.assert_array_equal(helpers.host_array(x), helpers.host_array(y))
    moments_ = final[1].server["server_opt"][0]
    start = like.server["server_opt"][0]
    assert np.abs(flat(moments_.m)).max() > 0 and not np.allclose(flat(moments_.v), flat(start.v))


@pytest.mark.slow
def test_a_sweep_over_the_server_learning_rate_equals_separate_runs():
    """--server-lr traced in one vmapped program (FedAvgM): each run what its own run gives."""
    from fedjax_pfl import runner, sweep

    data = make_data([7, 23, 12, 9, 15, 11], feature_dim=6)
    hp = {"batch_size": 4, "participation": 0.5, "server_opt": "momentum"}
    runs = [sweep.RunSpec(seed, (("server_opt_lr", lr),)) for lr in (0.3, 1.0, 2.5) for seed in (0, 1)]
    cfg = runner.RunConfig(algo="fedavg", rounds=3, hparams=hp, progress=False,
                           memory_check=False, model="logreg")
    summaries = sweep.run_group(cfg, runs, data=data, data_info={}, out=None, progress=False)
    for spec, got in zip(runs, summaries):
        single = runner.RunConfig(algo="fedavg", rounds=3, seed=spec.seed, model="logreg",
                                  hparams={**hp, **dict(spec.traced)}, progress=False,
                                  memory_check=False)
        ref = runner.run(single, data=data, data_info={}, log=lambda *_: None)
        for key in ("acc_mean", "loss", "train_loss"):
            np.testing.assert_allclose(got["last"][key], ref["last"][key], rtol=2e-5,
                                       err_msg=f"{spec.label} {key}")
    losses = {s.label: round(r["last"]["loss"], 6) for s, r in zip(runs, summaries)}
    assert len(set(losses.values())) == len(runs)           # the learning rate reached the runs


def test_a_run_saved_before_the_server_optimisers_resumes_at_their_defaults():
    """A config.json without the server_opt* hyperparameters (written before they existed)
    was made with their defaults: it resumes with them, and conflicts with any other value."""
    from fedjax_pfl import runner
    from fedjax_pfl.runner import config as config_lib

    cfg = runner.RunConfig.from_options(algo="fedavg", out="/tmp/unused", rounds=3)
    hparams = cfg.validate()
    saved = config_lib.config_record(cfg, hparams, "mlp", {})
    saved["hparams"] = {k: v for k, v in hparams.items() if not k.startswith("server_opt")}
    assert config_lib.resume_conflicts(cfg, hparams, "mlp", saved) is None
    adam = runner.RunConfig.from_options(algo="fedavg", out="/tmp/unused", rounds=3,
                                         server_opt="adam")
    from fedjax_pfl.errors import render

    found = config_lib.resume_conflicts(adam, adam.validate(), "mlp", saved)
    assert found is not None and "server_opt None, not 'adam'" in render(found)
