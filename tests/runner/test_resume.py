"""Checkpoint and exact resume: a run stopped at round k and resumed from its checkpoint writes
the same metrics and ends in the same state, bit for bit, as a run that was never stopped."""

import json

import helpers
import numpy as np
import pytest
import run as cli  # experiments/run.py (on the tests' pythonpath)

from fedjax_pfl import runner
from fedjax_pfl.callbacks import Callback


def _config(algo, out, rounds, *flags, checkpoint_every=2):
    return helpers.default_config(algo, out, rounds, *flags, checkpoint_every=checkpoint_every)


_rows = helpers.metric_rows


@pytest.mark.slow
def test_resume_at_round_k_equals_uninterrupted(tmp_path):
    """FedAvg's default configuration; every other algorithm's is checked the same way by
    tests/runner/test_defaults_train.py on the program it has just trained (compiled once)."""
    helpers.check_resume_equals_uninterrupted("fedavg", tmp_path)


@pytest.mark.slow
@pytest.mark.figures
def test_interrupted_run_records_what_finished_and_resumes(tmp_path, monkeypatch):
    """Ctrl-C after round 3 (KeyboardInterrupt where the runner waits): summary.json says so,
    metrics.jsonl and the learning curve hold rounds 1–3, the last checkpoint is round 3 (every
    3), and resuming ends exactly like an uninterrupted run."""
    full_cfg = _config("fedavg", tmp_path / "full", 5, checkpoint_every=3)
    prep = helpers.default_prepared("fedavg")
    quiet = lambda *_: None
    runner.run(full_cfg, prepared=prep, log=quiet)

    class CtrlCAfterRound4(Callback):
        def on_round_end(self, event):
            if event.round == 4:
                raise KeyboardInterrupt
    out = tmp_path / "stopped"
    with pytest.raises(runner.Interrupted) as exc:
        runner.run(_config("fedavg", out, 5, checkpoint_every=3), prepared=prep, log=quiet,
                   callbacks=[CtrlCAfterRound4()])
    assert (exc.value.last_round, exc.value.checkpoint_round, exc.value.phase) == (4, 3, "rounds")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] and summary["interrupted_during"] == "rounds"
    assert summary["last_completed_round"] == 4 and summary["last_checkpoint_round"] == 3
    assert summary["last"]["acc_mean"] == _rows(out)[-1]["acc_mean"]
    assert len(_rows(out)) == 4 and (out / "learning_curve.png").exists()
    assert np.load(out / "client_metrics.npz")["sampled"].shape[0] == 4
    monkeypatch.undo()

    runner.run(_config("fedavg", out, 5, "--resume", checkpoint_every=3), prepared=prep, log=quiet)
    assert _rows(out) == _rows(tmp_path / "full")          # round 4 was run again from round 3
    assert not json.loads((out / "summary.json").read_text())["interrupted"]


@pytest.mark.slow
def test_target_accuracy_stops_at_the_first_round_that_reaches_it(tmp_path):
    """--target-acc A: the run ends after the first evaluation with acc_mean >= A, found in an
    uninterrupted run's metrics; its rows are that run's first rows, its last checkpoint is the
    stopping round, and resuming it (without a target) continues exactly like the full run."""
    prep = helpers.default_prepared("fedavg")
    quiet = lambda *_: None
    full = runner.run(_config("fedavg", tmp_path / "full", 12), prepared=prep, log=quiet)
    rows = _rows(tmp_path / "full")
    accs = [row["acc_mean"] for row in rows]
    target = float(np.median(accs))                     # reached part-way, not at round 1
    first = next(row["round"] for row in rows if row["acc_mean"] >= target)
    assert 1 < first < 12

    cfg = _config("fedavg", tmp_path / "stopped", 12, "--target-acc", repr(target), checkpoint_every=5)
    summary = runner.run(cfg, prepared=prep, log=quiet)
    assert summary["target"] == {"acc_mean": target, "round": first}
    assert summary["last_completed_round"] == summary["last_checkpoint_round"] == first
    assert _rows(tmp_path / "stopped") == rows[:first]
    assert runner.latest_checkpoint(str(tmp_path / "stopped")).endswith(f"round_{first:06d}")

    resumed = runner.run(_config("fedavg", tmp_path / "stopped", 12, "--resume"), prepared=prep,
                         log=quiet)
    assert "target" not in resumed and resumed["last"]["acc_mean"] == full["last"]["acc_mean"]
    assert _rows(tmp_path / "stopped") == rows

    unreachable = _config("fedavg", tmp_path / "never", 3, "--target-acc", "1")
    assert runner.run(unreachable, prepared=prep, log=quiet)["target"] == {"acc_mean": 1.0, "round": None}


def test_target_accuracy_is_checked_up_front(capsys):
    for value in ("0", "1.5", "-0.1", "nan"):
        with pytest.raises(SystemExit) as e:
            cli.main(["--algo", "fedavg", "--target-acc", value, "--quiet"])
        assert e.value.code == 2
        assert "--target-acc" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["--algo", "fedavg", "--target-acc", "0.5", "--seeds", "1", "2", "--quiet"])
    assert e.value.code == 2 and "--target-acc" in capsys.readouterr().err


def test_a_config_json_that_disagrees_with_its_checkpoint_names_every_differing_setting():
    """The comparison itself, on records written out here: the settings a resume may change
    (rounds, out, …) and where the data live are no disagreement; every other one is named."""
    from fedjax_pfl.runner import checkpoints

    saved = {"algo": "fedavg", "rounds": 4, "out": "a", "hparams": {"lr": 0.05, "batch_size": 10},
             "partition": {"scheme": "dirichlet", "alpha": 0.5},
             "data_options": {"data_dir": "/x", "download": False}, "model_cr": 2.0}
    same = {**saved, "rounds": 9, "out": "b", "data": {"num_clients": 4}, "versions": {},
            "compression": {"given": 2.0, "used": 1.9},     # (derived: config.json's alone)
            "hparams": {"lr": 0.05, "batch_size": 10.0},         # 10 and 10.0: one number
            "data_options": {"data_dir": "/moved", "download": False}}
    checkpoints.check_saved_config("a", same, "a/checkpoints/round_000004", {"config": saved})
    checkpoints.check_saved_config("a", same, "p", {})          # (saved no configuration)
    edited = {**same, "hparams": {"lr": 0.07, "batch_size": 10},
              "partition": {"scheme": "dirichlet", "alpha": 0.3}, "model_cr": 3.0}
    with pytest.raises(runner.ResumeError) as exc:
        checkpoints.check_saved_config("a", edited, "a/checkpoints/round_000004",
                                       {"config": saved})
    assert str(exc.value) == (
        "resume: a/config.json disagrees with the configuration its checkpoint round_000004 "
        "saved, in lr, model_cr, alpha (was it edited?); restore it, or start the run again "
        "with overwrite")
    assert [a for a in exc.value.arguments] == [
        ("resume", ""), ("lr", "hparams"), ("model_cr", ""), ("alpha", "partition"),
        ("overwrite", "")]


@pytest.mark.slow
def test_resume_with_an_edited_config_json_is_refused_before_anything_is_loaded(tmp_path, capsys,
                                                                               monkeypatch):
    import os

    out = tmp_path / "run"
    assert cli.main(["--rounds", "2", "--clients", "4", "--participation", "0.5",
                     "--local-steps", "1", "--checkpoint-every", "1", "--out", str(out),
                     "--quiet"]) == 0
    capsys.readouterr()
    record = json.loads((out / "config.json").read_text())
    record["hparams"]["lr"] = 0.5
    record["partition"]["alpha"] = 0.25
    (out / "config.json").write_text(json.dumps(record))

    def files():
        return {os.path.join(d, f): os.path.getmtime(os.path.join(d, f))
                for d, _, names in os.walk(out) for f in names}
    before = files()

    def no_data(*a, **k):
        raise AssertionError("the data were loaded: the checkpoint's configuration is compared first")
    monkeypatch.setattr(runner, "load_data", no_data)
    with pytest.raises(SystemExit) as exc:
        cli.main(["--resume", str(out), "--rounds", "4", "--quiet"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        f"run.py: error: --resume: {out}/config.json disagrees with the configuration its "
        "checkpoint round_000002 saved, in --lr, --alpha (was it edited?)"), err
    assert files() == before                        # nothing written
