"""The noise multiplier and the clipping norm are traceable: one vmapped program sweeps them with
the seeds (`fedjax_pfl.sweep`), each run giving what a separate private run gives."""

import numpy as np
import pytest

from fedjax_pfl import runner, sweep
from helpers import make_data


@pytest.mark.slow
def test_vmapped_private_runs_equal_separate_private_runs():
    data = make_data([7, 23, 12, 9, 15, 11], feature_dim=6)
    hp = {"batch_size": 4, "participation": 0.5}
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
    # The values reach the program: noise and clipping change the runs of one seed.
    losses = {s.label: round(r["last"]["loss"], 6) for s, r in zip(runs, summaries)}
    assert len(set(losses.values())) == len(runs)
