"""runner.resume_config: the configuration that continues a saved run, from a notebook as from
`run.py --resume`: the saved record as the base, the overrides on top, only what a resume may
change allowed to differ, a directory without a run or without a checkpoint refused first."""

import helpers
import pytest
import run as cli  # noqa: E402  (experiments/run.py)

from fedjax_pfl import runner  # noqa: E402
from fedjax_pfl.errors import OptionError  # noqa: E402

quiet = lambda *_: None  # noqa: E731


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A finished pgfed run (2 rounds, a checkpoint at the end) and one made without checkpoints."""
    root = tmp_path_factory.mktemp("saved")
    flags = ["--algo", "pgfed", "--pgfed-mu", "0.2", "--clients", "6", "--participation", "0.5",
             "--local-steps", "1", "--rounds", "2", "--quiet"]
    assert cli.main(flags + ["--out", str(root / "run")]) == 0
    assert cli.main(flags + ["--out", str(root / "nockpt"), "--checkpoint-every", "0"]) == 0
    return root


@pytest.mark.slow
def test_without_overrides_it_is_the_saved_configuration_resumed(saved):
    out = str(saved / "run")
    cfg = runner.resume_config(out)
    again = cli.config_from_args(cli.parse(["--algo", "pgfed", "--pgfed-mu", "0.2", "--clients",
                                            "6", "--participation", "0.5", "--local-steps", "1",
                                            "--rounds", "2", "--out", out, "--resume"]))
    assert cfg.resume and cfg.out == out
    assert cfg.validate() == again.validate()                     # every hyperparameter
    assert (cfg.partition, cfg.rounds, cfg.seed, cfg.dataset, cfg.algo) == (
        again.partition, again.rounds, again.seed, again.dataset, again.algo)
    assert runner.saved_options(out)["hparams"]["mu"] == 0.2


def test_agreeing_and_resumable_overrides_are_what_run_py_resume_builds(saved):
    out = str(saved / "run")
    cfg = runner.resume_config(out, rounds=4, quiet=True, mu=0.2, conv="im2col", seed=0)
    assert (cfg.rounds, cfg.progress, cfg.model_conv, cfg.hparams["mu"]) == (4, False, "im2col", 0.2)
    args = cli.parse(["--resume", out, "--rounds", "4", "--quiet", "--pgfed-mu", "0.2", "--conv",
                      "im2col", "--seed", "0"])
    assert cli._resume_config(args, runner) == cfg
    # (one seed is a plain run: its checks need the options a resume leaves at their defaults)
    one_seed = cli.parse(["--resume", out, "--rounds", "4", "--quiet", "--conv", "im2col",
                          "--seeds", "5"])
    assert cli._resume_config(one_seed, runner) == cfg


@pytest.mark.parametrize("overrides,said,flagged", [
    (dict(seed=5), "seed 0, not 5", "--seed 0, not 5"),
    (dict(mu=0.3), "mu 0.2, not 0.3", "--pgfed-mu 0.2, not 0.3"),
    (dict(hparams={"lr": 0.1}), "lr 0.005, not 0.1", "--lr 0.005, not 0.1"),
    (dict(clients=8), "num_clients 6, not 8", "--clients 6, not 8"),
    (dict(algo="fedavg"), "algo 'pgfed', not 'fedavg'", "--algo 'pgfed', not 'fedavg'"),
    (dict(partition="iid"), "scheme 'dirichlet', not 'iid'", "--partition 'dirichlet', not 'iid'"),
])
def test_conflicting_overrides_are_refused_naming_the_setting(saved, overrides, said, flagged):
    out = str(saved / "run")
    with pytest.raises(runner.ResumeError) as exc:
        runner.resume_config(out, **overrides)
    text = str(exc.value)
    assert text.startswith(f"resume: the run in {out} was made with {said} (only rounds, "
                           "checkpoint_every, target_acc, model_conv, log"), text
    assert cli.message(exc.value, overrides.get("algo", "pgfed")).startswith(
        f"--resume: the run in {out} was made with {flagged} (only --rounds, --checkpoint-every,")


def test_a_folder_without_a_run_or_without_a_checkpoint_is_refused_first(saved, tmp_path):
    with pytest.raises(OptionError, match=f"^resume: {tmp_path} holds no run to resume"):
        runner.resume_config(str(tmp_path))
    with pytest.raises(runner.ResumeError, match="holds no checkpoint to continue from .* "
                                                 "checkpoint_every 0"):
        runner.resume_config(str(saved / "nockpt"), rounds=4)
    with pytest.raises(OptionError, match="^out .* is not the directory of the run to resume"):
        runner.resume_config(str(saved / "run"), out=str(tmp_path))


@pytest.mark.slow
def test_a_resumed_config_continues_the_run(tmp_path):
    """resume_config's configuration, run: the rounds after the checkpoint, as the uninterrupted
    run's (`helpers.default_prepared`: the command line's default fedavg, compiled once)."""
    prep = helpers.default_prepared("fedavg")
    full = tmp_path / "full"
    runner.run(helpers.default_config("fedavg", full, 4), prepared=prep, log=quiet)
    part = tmp_path / "part"
    runner.run(helpers.default_config("fedavg", part, 2), prepared=prep, log=quiet)
    runner.run(runner.resume_config(str(part), rounds=4, quiet=True), prepared=prep, log=quiet)
    assert helpers.metric_rows(part) == helpers.metric_rows(full)


def test_the_compression_config_json_records_is_no_setting_a_resume_compares():
    """config.json's "compression" (what the rank rule made of the rate given: derived) is in no
    configuration a resume builds; the rate itself is compared."""
    cfg = runner.RunConfig.from_options(out="o", algo="tdpfed", cr=20.0)
    hparams = cfg.validate()
    saved = {**runner.config_record(cfg, hparams, "mlp", {}),
             "compression": {"setting": "cr", "given": 20.0, "used": 16.9}}
    assert runner.resume_conflicts(cfg, hparams, "mlp", saved) is None
    other = {**saved, "hparams": {**saved["hparams"], "cr": 10.0}}
    from fedjax_pfl.errors import render

    assert "cr 10.0, not 20.0" in render(runner.resume_conflicts(cfg, hparams, "mlp", other))
