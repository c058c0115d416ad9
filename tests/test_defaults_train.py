"""Defaults that train: `python experiments/run.py --algo X` with nothing else learns the embedded
digits within the default rounds, for every registered algorithm (new ones are covered when
they register).

The run is built by the command line's own parser and config builder, so what is tested is what
a user gets; only --quiet is given, and the run writes no files (files, checkpoints and resume
are tests/test_resume.py's, on the same prepared and compiled configurations). Chance is 0.1 on
10 classes; the bar is a best mean client accuracy of 0.8 (measured, 50 rounds: fedavg 0.94,
fedavg_ft 0.96, fedavg_sar 0.89, fedpc 0.97, fedper 0.90, local 0.90, pfedme 0.97, pfedsop 0.89,
pgfed / pgfed_ce / pgfedmo 0.97, tdpfed 0.94).
"""

import dataclasses

import pytest

import helpers
from fedjax_pfl import algorithms, runner

BAR = 0.8


@pytest.mark.slow     # one 50-round digits run per algorithm: 5–30 s each on 2 busy cores
@pytest.mark.parametrize("name", algorithms.names())
def test_default_configuration_learns_digits(name):
    prep = helpers.default_prepared(name)          # what `run.py --algo NAME --quiet` prepares
    cfg = dataclasses.replace(prep.cfg, out=None)
    assert (cfg.dataset, cfg.partition.scheme, cfg.partition.num_clients) == ("digits", "dirichlet", 20)
    summary = runner.run(cfg, prepared=prep, log=lambda *_: None)
    best, last = summary["best"]["acc_mean"], summary["last"]["acc_mean"]
    assert best >= BAR, (f"--algo {name} with its defaults reaches only {best:.3f} best mean client "
                         f"accuracy on digits in {cfg.rounds} rounds (last {last:.3f}); its default "
                         "configuration must train (issue 11 §4)")
