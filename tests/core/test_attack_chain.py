"""The threat model (--attack-fraction, --attack-redraw, the attack seed) and model poisoning on
the server chain (`core.server.model_attack`): the malicious set's size and seeding, a FedAvg
round's new model against the weighted mean written here in NumPy float64 with the malicious
uploads replaced by their formula, F = 0 keeping the plain run's bits, the refusals."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from helpers import linear_model, make_data

from fedjax_pfl import algorithms
from fedjax_pfl.algorithms import engine as engine_lib
from fedjax_pfl.algorithms.engine import EngineConfig
from fedjax_pfl.errors import OptionError

COMMON = {"batch_size": 4, "participation": 0.8, "lr": 0.1}
SIZES = [7, 12, 5, 9, 11, 6, 8, 10, 13, 4]


# -- the malicious set ----------------------------------------------------------------------------


@pytest.mark.parametrize("fraction,n,k", [(0.3, 10, 3), (0.25, 10, 3), (0.1, 7, 1),
                                          (0.5, 33, 17), (0.0, 10, 0)])
def test_the_set_has_ceil_f_n_members(fraction, n, k):
    assert k == math.ceil(fraction * n - 1e-9)
    mask = engine_lib.malicious_mask(fraction, 0, n)
    assert mask.shape == (n,) and mask.dtype == bool and mask.sum() == k
    redrawn = engine_lib.redrawn_mask(jax.random.key(3), 0, fraction, n, n + 2)
    assert int(redrawn.sum()) == k and not bool(redrawn[n:].any())   # padding never malicious


def test_the_set_depends_on_the_seed_and_covers_the_clients():
    sets = {tuple(np.flatnonzero(engine_lib.malicious_mask(0.3, s, 20))) for s in range(40)}
    assert len(sets) > 30                                   # seeds give different sets
    hits = sum(engine_lib.malicious_mask(0.3, s, 20) for s in range(400))
    assert hits.min() > 0.3 * 400 * 0.6                     # every client is drawn about F of the time
    np.testing.assert_array_equal(engine_lib.malicious_mask(0.3, 5, 20),
                                  engine_lib.malicious_mask(0.3, 5, 20))


def test_fixed_across_rounds_unless_redrawn():
    data = make_data(SIZES, feature_dim=3)
    fixed = engine_lib.Engine(linear_model(), EngineConfig(**COMMON, attack_fraction=0.3,
                                                           attack_seed=4))
    redraw = engine_lib.Engine(linear_model(), EngineConfig(**COMMON, attack_fraction=0.3,
                                                            attack_seed=4, attack_redraw=True))
    a = [np.asarray(fixed.begin(data, jax.random.key(t)).attackers) for t in range(6)]
    b = [np.asarray(redraw.begin(data, jax.random.key(t)).attackers) for t in range(6)]
    assert all(np.array_equal(a[0], x) for x in a) and a[0].sum() == 3
    assert len({tuple(np.flatnonzero(x)) for x in b}) > 1 and all(x.sum() == 3 for x in b)
    np.testing.assert_array_equal(a[0], engine_lib.malicious_mask(0.3, 4, len(SIZES)))
    # The round's [M] mask is the set read at the sampled slots.
    rnd = fixed.begin(data, jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(rnd.malicious()), a[0][np.asarray(rnd.idx)])


def test_no_fraction_no_set():
    data = make_data(SIZES, feature_dim=3)
    engine = engine_lib.Engine(linear_model(), EngineConfig(**COMMON, attack="sign_flip"))
    assert engine.begin(data, jax.random.key(0)).attackers is None


# -- model poisoning on FedAvg's round ------------------------------------------------------------


def host_leaves(tree) -> list[np.ndarray]:
    """The state's leaves as NumPy arrays (a PRNG key as its key data)."""
    return [np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
                       else x) for x in jax.tree.leaves(tree)]


def flat(tree) -> np.ndarray:
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])


def round_inputs(state, data, key, model, config):
    """The round's honest updates [M, d] as the engine trains them, the weights, the malicious
    slots."""
    engine = engine_lib.Engine(model, config)
    rnd = engine.begin(data, key)
    trained = engine.train(rnd, state.params, opt_rows=state.opt_state, shared_start=True)
    m = rnd.m
    rows = np.concatenate([np.asarray(x, np.float64).reshape(m, -1)
                           for x in jax.tree.leaves(trained.params)], axis=1)
    return (rows - flat(state.params)[None], np.asarray(rnd.train_counts, np.float64),
            np.asarray(rnd.malicious()))


def ref_alie(x, mal):
    b = x[~mal]
    n, f = len(x), mal.sum()
    s = max(math.floor(n / 2 + 1) - f, 1)
    p = (n - s) / n
    lo, hi = -10.0, 10.0                                   # Φ⁻¹(p) by bisection
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if 0.5 * (1 + math.erf(mid / math.sqrt(2))) < p else (lo, mid)
    return b.mean(0) - lo * b.std(0)


@pytest.mark.parametrize("kind,extra,sent", [
    ("sign_flip", {"attack_scale": 4.0}, lambda x, mal, m: -4.0 * x),
    ("sign_flip", {}, lambda x, mal, m: -x),
    ("scale", {}, lambda x, mal, m: m * x),                 # default S: the round's M slots
    ("ipm", {"attack_eps": 2.0}, lambda x, mal, m: np.broadcast_to(-2.0 * x[~mal].mean(0),
                                                                   x.shape)),
    ("alie", {}, lambda x, mal, m: np.broadcast_to(ref_alie(x, mal), x.shape)),
])
@pytest.mark.slow
def test_a_poisoned_fedavg_round_against_its_formula(kind, extra, sent):
    data, model = make_data(SIZES, feature_dim=5), linear_model()
    hp = {**COMMON, "attack": kind, "attack_fraction": 0.3, **extra}
    algo = algorithms.get("fedavg", model=model, attack_seed=2, **hp)
    state = algo.init(jax.random.key(0), data)
    key = jax.random.key(11)
    x, w, mal = round_inputs(state, data, key, model, EngineConfig(**hp, attack_seed=2))
    assert 0 < mal.sum() < len(mal)
    uploads = np.where(mal[:, None], sent(x, mal, len(x)), x)
    want = flat(state.params) + (w / w.sum()) @ uploads
    new, metrics = algo.round_fn(state, data, key)
    np.testing.assert_allclose(flat(new.params), want, rtol=2e-5, atol=2e-6)
    assert int(metrics["attack_malicious"]) == mal.sum()


def test_gaussian_uploads_move_the_mean_by_the_noise():
    data, model = make_data(SIZES, feature_dim=5), linear_model()
    hp = {**COMMON, "attack": "gaussian", "attack_fraction": 0.3, "attack_std": 50.0}
    algo = algorithms.get("fedavg", model=model, **hp)
    state = algo.init(jax.random.key(0), data)
    x, w, mal = round_inputs(state, data, jax.random.key(1), model, EngineConfig(**hp))
    honest = flat(state.params) + (w / w.sum()) @ x
    new, _ = algo.round_fn(state, data, jax.random.key(1))
    # The noise's share (Σ_mal w_i / Σ w) · N(0, 50²) is far from the honest mean.
    assert np.abs(flat(new.params) - honest).max() > 1.0


@pytest.mark.slow
def test_fraction_zero_keeps_the_plain_run_bit_for_bit():
    data, model = make_data(SIZES, feature_dim=5), linear_model()
    plain = algorithms.get("fedavg", model=model, **COMMON)
    runs = [algorithms.get("fedavg", model=model, **COMMON, attack=kind, attack_fraction=0.0)
            for kind in ("sign_flip", "alie", "label_flip", "backdoor")]
    states = [plain.init(jax.random.key(0), data)] * (1 + len(runs))
    for t in range(3):
        key = jax.random.key(t)
        out = [a.round_fn(s, data, key) for a, s in zip([plain, *runs], states)]
        states = [s for s, _ in out]
        for s, m in out[1:]:
            for a, b in zip(host_leaves(states[0]), host_leaves(s), strict=True):
                np.testing.assert_array_equal(a, b)
            assert m.keys() == out[0][1].keys()


def test_a_malicious_set_without_an_attack_changes_nothing():
    """--attack none with F > 0 marks clients (for the benign metrics) and trains as usual."""
    data, model = make_data(SIZES, feature_dim=5), linear_model()
    plain = algorithms.get("fedavg", model=model, **COMMON)
    marked = algorithms.get("fedavg", model=model, **COMMON, attack_fraction=0.3)
    a = plain.init(jax.random.key(0), data)
    b, _ = marked.round_fn(a, data, jax.random.key(5))
    a, _ = plain.round_fn(a, data, jax.random.key(5))
    for x, y in zip(host_leaves(a), host_leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


def test_the_attack_link_comes_first():
    chain = engine_lib.server_chain(EngineConfig(attack="ipm", attack_fraction=0.2,
                                                 aggregator="median"))
    assert [link.name for link in chain.links] == ["model_attack", "robust_mean", "apply_update"]
    chain = engine_lib.server_chain(EngineConfig(attack="ipm", attack_fraction=0.2, dp_clip=1.0))
    assert [link.name for link in chain.links][:2] == ["model_attack", "clip"]
    assert "model_attack" not in [link.name for link in engine_lib.server_chain(
        EngineConfig(attack="label_flip", attack_fraction=0.2)).links]


# -- refusals -------------------------------------------------------------------------------------


def test_refusals():
    model = linear_model()
    with pytest.raises(OptionError, match="^fedamp takes no attack sign_flip: it aggregates no "
                                          "uploads"):
        algorithms.get("fedamp", model=model, attack="sign_flip", attack_fraction=0.2)
    algorithms.get("fedamp", model=model, attack="label_flip", attack_fraction=0.2)
    with pytest.raises(OptionError, match="^attack_std applies to attack gaussian only, not "
                                          "attack ipm"):
        algorithms.get("fedavg", model=model, attack="ipm", attack_std=2.0)
    with pytest.raises(OptionError, match="^attack_redraw re-draws"):
        algorithms.get("fedavg", model=model, attack="ipm", attack_redraw=True)
    with pytest.raises(ValueError, match="--attack-fraction must be in \\[0, 1\\)"):
        algorithms.get("fedavg", model=model, attack_fraction=1.0)
    with pytest.raises(ValueError, match="--attack must be one of"):
        algorithms.get("fedavg", model=model, attack="nope")


# -- an attack that wrecks FedAvg, held by robust rules (measured: docs/attacks.md) ---------------


@pytest.mark.slow
def test_sign_flip_wrecks_the_mean_and_median_and_trimmed_mean_hold_it(tmp_path):
    """FedAvg on digits (10 of 20 clients a round, 30 rounds), 30 % of the clients sending
    −4·Δ: the mean's benign accuracy falls to chance (measured 0.10, clean 0.89), the median's
    and the trimmed mean's (β = 0.3) stay well above it (measured 0.61 and 0.60)."""
    from fedjax_pfl.runner import RunConfig, run

    def benign(aggregator, attack, **extra):
        hp = dict(participation=0.5, aggregator=aggregator, **extra)
        if attack:
            hp.update(attack="sign_flip", attack_fraction=0.3, attack_scale=4.0)
        cfg = RunConfig.from_options(algo="fedavg", dataset="digits", rounds=30, eval_every=30,
                                     out=str(tmp_path / f"{aggregator}{attack}"), quiet=True,
                                     hparams=hp)
        s = run(cfg)
        return s["attack"]["acc_mean_benign"] if attack else s["last"]["acc_mean"]

    assert benign("mean", False) > 0.8
    assert benign("mean", True) < 0.2
    assert benign("median", True) > 0.5
    assert benign("trimmed_mean", True, aggregator_beta=0.3) > 0.5
