"""Defaults that train: `python experiments/run.py --algo X` with nothing else learns the embedded
digits within the default rounds, for every registered algorithm (new ones are covered when
they register).

The run is built by the command line's own parser and config builder, so what is tested is what
a user gets; only --quiet is given, and the run writes no files. The same test then checks exact
resume (issue 11 §1) on that configuration, with the program it has just compiled
(`helpers.check_resume_equals_uninterrupted`: stopped at round 2 and resumed = 4 rounds never
stopped); tests/runner/test_resume.py checks files, interrupts and targets on FedAvg's. Chance is 0.1 on
10 classes; the bar is a mean client accuracy of 0.8 within the default 50 rounds, which the run
stops at (--target-acc 0.8; tests/runner/test_resume.py checks that the stop is the first round that
reaches it). Measured (`python experiments/run.py --algo NAME --target-acc 0.8` prints the
round): the first round at or above 0.8 is 4 (fedpc, pfedme), 5 (tdpfed),
7 (feddyn, perfedavg, pgfed, pgfed_ce, pgfedmo), 9 (fedavg_ft, fedprox_ft), 10 (local), 11
(fedrod), 12 (apfl), 16 (fedavg, fedprox), 17 (lg_fedavg), 20 (ditto), 22 (pfedsop), 23
(fedbabu), 25 (fedper, fedrep), 34 (fedavg_sar); their best over all 50 rounds is 0.89-0.97.
FFA-LoRA runs on adapters only: with nothing else it is refused, and it is trained with
`helpers.ALGO_FLAGS` (--peft lora --lora-targets all --lr 0.5: 0.87 at round 45).
"""

import dataclasses

import helpers
import pytest

from fedjax_pfl import algorithms, runner

BAR = 0.8


@pytest.mark.slow     # per algorithm: 3 short runs (resume) and one of up to 50 rounds, 5–20 s
@pytest.mark.matrix
@pytest.mark.parametrize("name", algorithms.names())
def test_default_configuration_learns_digits_and_resumes_exactly(name, tmp_path):
    if name in helpers.ALGO_FLAGS:       # (refused with nothing else: the fewest flags that run)
        import run as cli

        with pytest.raises(ValueError, match="has no adapters: build it with models.lora"):
            runner.prepare(cli.config_from_args(cli.parse(["--algo", name, "--quiet"])))
    # First exact resume (so that a configuration below the bar still has it checked), then
    # the training bar, on the same compiled program.
    helpers.check_resume_equals_uninterrupted(name, tmp_path)
    prep = helpers.default_prepared(name)          # what `run.py --algo NAME --quiet` prepares
    cfg = dataclasses.replace(prep.cfg, out=None, target_acc=BAR)
    assert (cfg.dataset, cfg.partition.scheme, cfg.partition.num_clients, cfg.rounds) == (
        "digits", "dirichlet", 20, 50)
    summary = runner.run(cfg, prepared=prep, log=lambda *_: None)
    best, last = summary["best"]["acc_mean"], summary["last"]["acc_mean"]
    assert summary["target"]["round"] is not None and best >= BAR, (
        f"--algo {name} with its defaults reaches only {best:.3f} best mean client accuracy on "
        f"digits in {cfg.rounds} rounds (last {last:.3f}); its default configuration must train "
        "(issue 11 §4)")
