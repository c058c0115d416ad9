"""The noise multiplier and the clipping norm are traceable: one vmapped program sweeps them with
the seeds (`fedjax_pfl.sweep`), each run giving what a separate private run gives, its ε after
every round included."""

import numpy as np
import pytest
from helpers import make_data

from fedjax_pfl import runner, sweep


@pytest.mark.slow
@pytest.mark.parametrize("more", [{}, {"sampling": "poisson", "dp_clip_quantile": 0.5,
                                       "dp_count_noise": 1.5}], ids=["fixed", "poisson-adaptive"])
def test_vmapped_private_runs_equal_separate_private_runs(more):
    """Also with Poisson sampling and adaptive clipping (the clip traced as its C_0, then state)."""
    data = make_data([7, 23, 12, 9, 15, 11], feature_dim=6)
    hp = {"batch_size": 4, "participation": 0.5, **more}
    traced = [(("dp_clip", 0.05), ("dp_noise_multiplier", 0.0)),
              (("dp_clip", 0.05), ("dp_noise_multiplier", 2.0)),
              (("dp_clip", 1.0), ("dp_noise_multiplier", 0.5))]
    runs = [sweep.RunSpec(seed, t) for t in traced for seed in (0, 3)]
    cfg = runner.RunConfig(algo="fedavg", rounds=3, hparams=hp, progress=False,
                           memory_check=False, model="logreg")
    summaries = sweep.run_group(cfg, runs, data=data, data_info={}, out=None, progress=False)
    for spec, got in [(runs[1], summaries[1]), (runs[3], summaries[3]), (runs[4], summaries[4])]:
        single = runner.RunConfig(algo="fedavg", rounds=3, seed=spec.seed, model="logreg",
                                  hparams={**hp, **dict(spec.traced)}, progress=False,
                                  memory_check=False)
        ref = runner.run(single, data=data, data_info={}, log=lambda *_: None)
        for key in ("acc_mean", "loss", "train_loss"):
            np.testing.assert_allclose(got["last"][key], ref["last"][key], rtol=2e-4,
                                       err_msg=f"{spec.label} {key}")
        # ε: the separate run's (its own z), in the summary and the last round's row; it grows
        # round after round (z = 0: no bound, null).
        assert got["privacy"] == ref["privacy"] and got["dp_epsilon"] == ref["dp_epsilon"]
        eps = [r["dp_epsilon"] for r in got["rows"]]
        if dict(spec.traced)["dp_noise_multiplier"] == 0:
            assert eps == [None] * 3 and ref["dp_epsilon"] is None
        else:
            assert eps[-1] == ref["dp_epsilon"] and eps == sorted(eps) and len(set(eps)) == 3
    # The values reach the program: noise and clipping change the runs of one seed.
    losses = {s.label: round(r["last"]["loss"], 6) for s, r in zip(runs, summaries)}
    assert len(set(losses.values())) == len(runs)


@pytest.mark.slow
def test_each_run_of_a_sweep_has_the_epsilon_of_its_own_noise_multiplier():
    """ε after every round, per run, is the accountant's for that run's z (and M, N, δ); with
    --target-epsilon every run gets the z it calls for, which then cannot vary in the group.
    (Planned before anything compiles: no program is built here.)"""
    from fedjax_pfl.privacy import accounting
    from fedjax_pfl.sweep.group import _privacy_plans

    n, rounds = 40, 6
    cfg = runner.RunConfig(algo="fedrep", rounds=rounds, progress=False, model="logreg",
                           hparams={"participation": 0.25, "dp_clip": 0.5})
    hparams = cfg.validate()
    runs = [sweep.RunSpec(0, (("dp_noise_multiplier", z),)) for z in (0.8, 3.0, 0.0)]
    overrides, resolved, plans = _privacy_plans(cfg, hparams, runs, n)
    delta = n ** -1.1
    for run, plan in zip(runs[:2], plans[:2]):
        want = accounting.epsilons(dict(run.traced)["dp_noise_multiplier"], rounds=rounds,
                                   num_clients=n, clients_per_round=10, sampling="fixed",
                                   delta=delta, accountant="rdp")
        np.testing.assert_allclose(plan.epsilons, want, rtol=1e-12)
        assert plan.clients_per_round == 10 and plan.delta == delta
    assert plans[0].epsilons[-1] > plans[1].epsilons[-1]           # more noise, smaller ε
    assert plans[2].epsilons == (None,) * rounds                   # no noise: no bound
    assert overrides == cfg.hparams and resolved == hparams

    target = runner.RunConfig(**{**cfg.__dict__, "target_epsilon": 4.0})
    clips = [sweep.RunSpec(s, (("dp_clip", c),)) for s, c in ((0, 0.1), (1, 2.0))]
    overrides, resolved, plans = _privacy_plans(target, hparams, clips, n)
    z = accounting.noise_multiplier_for(4.0, rounds=rounds, num_clients=n, clients_per_round=10,
                                        sampling="fixed", delta=delta, accountant="rdp")
    assert overrides["dp_noise_multiplier"] == resolved["dp_noise_multiplier"] == z
    for plan in plans:
        assert plan.noise_multiplier == z and plan.target_epsilon == 4.0
        assert plan.epsilons[-1] <= 4.0
    with pytest.raises(ValueError, match="^target_epsilon sets the noise multiplier"):
        _privacy_plans(target, hparams, runs, n)
