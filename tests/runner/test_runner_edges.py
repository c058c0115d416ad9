"""The runner's edges: what a resume checks before it compiles or writes, a damaged checkpoint's
fallback, an interrupt during a save, the scheduler's warning signal, the callback protocol and
the one-round learning curve."""

import json
import os
import signal

import helpers
import numpy as np
import pytest

from fedjax_pfl import checkpoint, core, plots, runner
from fedjax_pfl.callbacks import Callback

quiet = lambda *_: None


def _config(out, rounds, *flags, checkpoint_every=2):
    return helpers.default_config("fedavg", out, rounds, *flags, checkpoint_every=checkpoint_every)


def _forbid_compile(monkeypatch):
    def compile_(*args, **kwargs):
        raise AssertionError("compiled although the resume was already known to fail")
    monkeypatch.setattr(core.Program, "compile", compile_)


def _snapshot(out):
    return {name: (out / name).read_bytes() for name in sorted(os.listdir(out))
            if (out / name).is_file()}


def _truncate_an_array_file(ckpt):
    arrays = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(ckpt, "arrays")) for f in fs]
    biggest = max(arrays, key=os.path.getsize)
    with open(biggest, "r+b") as f:
        f.truncate(os.path.getsize(biggest) // 2)
    return biggest


@pytest.mark.slow
def test_resume_with_fewer_rounds_than_done_fails_before_compiling_and_writing(tmp_path, monkeypatch):
    prep = helpers.default_prepared("fedavg")
    out = tmp_path / "run"
    runner.run(_config(out, 4), prepared=prep, log=quiet)
    before = _snapshot(out)
    fresh = runner.prepare(_config(out, 2, "--resume"))           # not compiled yet
    _forbid_compile(monkeypatch)
    with pytest.raises(runner.ResumeError, match=r"^rounds 2 is less than the 4 rounds"):
        runner.run(_config(out, 2, "--resume"), prepared=fresh, log=quiet)
    assert _snapshot(out) == before                                # config.json untouched


@pytest.mark.slow
def test_a_damaged_last_checkpoint_falls_back_to_the_one_before(tmp_path):
    prep = helpers.default_prepared("fedavg")
    runner.run(_config(tmp_path / "full", 8), prepared=prep, log=quiet)
    out = tmp_path / "stopped"
    runner.run(_config(out, 6), prepared=prep, log=quiet)
    kept = sorted(os.listdir(out / "checkpoints"))
    assert kept == ["round_000004", "round_000006"]                # the last two are kept
    damaged = _truncate_an_array_file(str(out / "checkpoints" / "round_000006"))
    said = []
    runner.run(_config(out, 8, "--resume"), prepared=prep, log=said.append)
    warning = [line for line in said if " is damaged " in line]
    assert len(warning) == 1 and "round_000006" in warning[0]
    assert os.path.basename(damaged) in warning[0]                 # names the file
    assert any("resuming from" in line and "round_000004" in line for line in said)
    assert helpers.metric_rows(out) == helpers.metric_rows(tmp_path / "full")


def test_no_intact_checkpoint_is_one_error_naming_the_file_before_compiling(tmp_path, monkeypatch):
    prep = helpers.default_prepared("fedavg")
    out = tmp_path / "run"
    runner.run(_config(out, 2), prepared=prep, log=quiet)
    os.remove(os.path.join(out, "checkpoints", "round_000002", "host.npz"))
    before = _snapshot(out)
    fresh = runner.prepare(_config(out, 4, "--resume"))
    _forbid_compile(monkeypatch)
    with pytest.raises(runner.ResumeError, match=r"no intact checkpoint .*host\.npz"):
        runner.run(_config(out, 4, "--resume"), prepared=fresh, log=quiet)
    assert _snapshot(out) == before


def test_an_interrupt_during_a_save_reports_the_checkpoint_it_wrote(tmp_path, monkeypatch):
    prep = helpers.default_prepared("fedavg")
    real_save = checkpoint.save

    def save_while_ctrl_c(path, *args, **kwargs):
        if path.endswith("round_000004"):
            os.kill(os.getpid(), signal.SIGINT)     # arrives while the checkpoint is written
        return real_save(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "save", save_while_ctrl_c)
    out = tmp_path / "run"
    with pytest.raises(runner.Interrupted) as info:
        runner.run(_config(out, 8, checkpoint_every=2), prepared=prep, log=quiet)
    assert (info.value.last_round, info.value.checkpoint_round) == (4, 4)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["last_checkpoint_round"] == 4 and summary["last_completed_round"] == 4
    assert sorted(os.listdir(out / "checkpoints")) == ["round_000002", "round_000004"]
    assert runner.latest_checkpoint(str(out)).endswith("round_000004")


def test_checkpoint_on_signal_saves_at_the_next_round_boundary(tmp_path):
    prep = helpers.default_prepared("fedavg")

    class WarnAtRound2(Callback):
        def on_round_end(self, event):
            if event.round == 2:
                os.kill(os.getpid(), signal.SIGUSR1)

    out = tmp_path / "run"
    runner.run(_config(out, 5, "--checkpoint-on-signal", "USR1", checkpoint_every=0),
               prepared=prep, log=quiet, callbacks=[WarnAtRound2()])
    # The run's own writers see round 2 before the warning: the next boundary is round 3.
    assert sorted(os.listdir(out / "checkpoints")) == ["round_000003"]
    assert checkpoint.read_metadata(str(out / "checkpoints" / "round_000003"))["round"] == 3


def test_callbacks_see_every_round_as_written(tmp_path):
    prep = helpers.default_prepared("fedavg")

    class Record(Callback):
        def __init__(self):
            self.starts, self.events, self.summaries = [], [], []

        def on_run_start(self, start):
            self.starts.append(start)

        def on_round_end(self, event):
            self.events.append(event)

        def on_run_end(self, summary):
            self.summaries.append(summary)

    rec = Record()
    out = tmp_path / "run"
    summary = runner.run(_config(out, 3, "--eval-every", "2"), prepared=prep, log=quiet,
                         callbacks=[rec])
    assert [(s.first_round, s.total_rounds, s.out) for s in rec.starts] == [(0, 3, str(out))]
    assert rec.starts[0].config["algo"] == "fedavg"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [dict(e.row) for e in rec.events] == rows
    assert [e.round for e in rec.events] == [1, 2, 3]
    assert [e.final for e in rec.events] == [False, False, True]
    assert all(e.state is not None for e in rec.events)       # one round per call
    evaluated = [e.round for e in rec.events if e.accuracy is not None]
    assert evaluated == [2, 3]
    npz = np.load(out / "client_metrics.npz")
    np.testing.assert_array_equal(np.stack([e.accuracy for e in rec.events if e.accuracy is not None]),
                                  npz["accuracy"])
    np.testing.assert_array_equal(np.stack([e.sampled for e in rec.events]), npz["sampled"])
    # The mean of the per-client accuracies the callback got is the row's acc_mean.
    last = rec.events[-1]
    assert np.nanmean(last.accuracy) == pytest.approx(last.row["acc_mean"], rel=1e-6)
    assert rec.summaries == [summary]


def test_a_one_round_curve_is_drawn_with_markers():
    import matplotlib.pyplot as plt

    fig = plots.learning_curve_figure({"fedavg": [{"round": 1, "acc_mean": 0.4,
                                                   "train_loss": 1.2}]})
    acc, loss = fig.axes[:2]
    for ax in (acc, loss):
        (line,) = ax.get_lines()
        assert line.get_marker() == "o" and len(line.get_xdata()) == 1
    plt.close(fig)
    fig = plots.learning_curve_figure({"fedavg": [{"round": r, "acc_mean": 0.1 * r,
                                                   "train_loss": 1.0} for r in (1, 2, 3)]})
    assert fig.axes[0].get_lines()[0].get_marker() in ("None", None, "")
    plt.close(fig)


@pytest.mark.slow
def test_log_tensorboard_in_a_real_run_holds_the_metrics_rows_and_overwrite_clears_it(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    prep = helpers.default_prepared("fedavg")
    out = tmp_path / "run"
    runner.run(_config(out, 3, "--log", "tensorboard"), prepared=prep, log=quiet)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    for key in ("train_loss", "acc_mean"):
        events = acc.Scalars(key)
        assert [e.step for e in events] == [row["round"] for row in rows]
        np.testing.assert_allclose([e.value for e in events], [row[key] for row in rows],
                                   rtol=1e-6)     # TensorBoard stores float32
    # A new run in that directory (--overwrite) starts without the old run's sink files.
    runner.run(_config(out, 1), prepared=prep, log=quiet)
    assert not (out / "tensorboard").exists()


def _cli_resume_refused(out, argv, capsys):
    import run as cli  # experiments/run.py

    before = _snapshot(out)
    ckpts = {n: sorted(os.listdir(out / "checkpoints" / n)) for n in os.listdir(out / "checkpoints")}
    with pytest.raises(SystemExit) as exc:
        cli.main(["--resume", str(out), "--quiet", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1, err
    assert _snapshot(out) == before                     # no file of the run changed
    assert {n: sorted(os.listdir(out / "checkpoints" / n))
            for n in os.listdir(out / "checkpoints")} == ckpts
    return err[0]


def test_cli_resume_with_fewer_rounds_or_no_intact_checkpoint_is_one_line_exit_2(tmp_path, capsys):
    prep = helpers.default_prepared("fedavg")
    out = tmp_path / "run"
    runner.run(_config(out, 4), prepared=prep, log=quiet)
    line = _cli_resume_refused(out, ["--rounds", "3"], capsys)
    assert line.startswith("run.py: error: --rounds 3 is less than the 4 rounds")
    for name in os.listdir(out / "checkpoints"):
        _truncate_an_array_file(str(out / "checkpoints" / name))
    line = _cli_resume_refused(out, ["--rounds", "6"], capsys)
    assert line.startswith("run.py: error: --resume: no intact checkpoint in")
    assert "round_000004" in line and "arrays" in line


@pytest.mark.parametrize("how", ["checkpoint_every_0", "checkpoints_removed"])
@pytest.mark.slow
def test_a_resume_with_no_checkpoint_is_refused_and_changes_no_file(tmp_path, capsys, monkeypatch,
                                                                   how):
    """--resume of a run that has nothing to continue from (made with --checkpoint-every 0, or
    its checkpoints/ removed) is one line and exit 2 before anything is loaded or compiled; its
    metrics, summary and record stay as they were (it used to start again from round 0 and
    replace them)."""
    import shutil

    import run as cli  # experiments/run.py

    prep = helpers.default_prepared("fedavg")
    out = tmp_path / "run"
    runner.run(_config(out, 2, checkpoint_every=0 if how == "checkpoint_every_0" else 2),
               prepared=prep, log=quiet)
    if how == "checkpoints_removed":
        shutil.rmtree(out / "checkpoints")
    assert runner.latest_checkpoint(str(out)) is None
    before = _snapshot(out)
    assert {"metrics.jsonl", "summary.json", "config.json"} <= set(before)
    fresh = runner.prepare(_config(out, 4, "--resume"))
    _forbid_compile(monkeypatch)
    with pytest.raises(runner.ResumeError, match=r"holds no checkpoint to continue from"):
        runner.run(_config(out, 4, "--resume"), prepared=fresh, log=quiet)
    assert _snapshot(out) == before
    monkeypatch.setattr(runner, "load_data", lambda *a, **k: pytest.fail("loaded the data"))
    with pytest.raises(SystemExit) as exc:
        cli.main(["--resume", str(out), "--quiet", "--rounds", "4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(f"run.py: error: --resume: {out} holds no checkpoint")
    assert "--overwrite" in err[0]
    assert _snapshot(out) == before


def test_an_interrupt_before_the_first_checkpoint_does_not_offer_a_resume(tmp_path, capsys):
    """The message after a stop names --resume only where a checkpoint exists to continue from;
    before the first one it says there is nothing to resume."""
    import run as cli  # experiments/run.py

    out = tmp_path / "run"
    out.mkdir()
    cli._report_interrupt(runner.Interrupted(3, None, str(out), "rounds"))
    err = capsys.readouterr().err
    assert "after round 3" in err and "nothing to resume" in err and "--resume" not in err
    prep = helpers.default_prepared("fedavg")
    runner.run(_config(out, 2), prepared=prep, log=quiet)
    cli._report_interrupt(runner.Interrupted(2, 2, str(out), "rounds"))
    err = capsys.readouterr().err
    assert "last checkpoint: round 2" in err and f"--resume {out}" in err


def test_a_checkpoint_whose_manifest_points_outside_falls_back_to_the_one_before(tmp_path):
    """The newest checkpoint's host.npz replaced by a symbolic link to a file outside it (the
    same bytes, so sizes and SHA-256s match): the resume reports it damaged, naming the
    checkpoint and the entry, and continues from the checkpoint before it."""
    import shutil

    from fedjax_pfl.runner import checkpoints

    out = tmp_path / "run"
    for r in (1, 2):
        checkpoint.save(str(out / "checkpoints" / f"round_{r:06d}"), {"w": np.full(3, r)},
                        metadata={"round": r}, host={"a": np.arange(r)})
    newest = out / "checkpoints" / "round_000002"
    shutil.move(newest / "host.npz", tmp_path / "elsewhere.npz")
    os.symlink(tmp_path / "elsewhere.npz", newest / "host.npz")
    said = []
    path, meta = checkpoints.resume_point(str(out), said.append)
    assert path.endswith("round_000001") and meta == {"round": 1}
    assert len(said) == 1 and str(newest) in said[0] and "'host.npz'" in said[0]
    assert "outside the checkpoint" in said[0] and "using the one before it" in said[0]


def test_run_refuses_data_that_is_not_a_dataset_or_has_no_labels_before_compiling(tmp_path,
                                                                                  monkeypatch):
    """runner.run(cfg, data=...) from a notebook: build_federated's (data, info) pair, or a
    dataset without labels, is one line naming `data` before anything is placed or compiled."""
    import dataclasses

    from fedjax_pfl.errors import OptionError

    _forbid_compile(monkeypatch)
    data = helpers.make_data([6] * 4)
    cfg = runner.RunConfig.from_options(algo="fedavg", rounds=1, model="mlp", quiet=True,
                                        out=str(tmp_path / "run"))
    with pytest.raises(OptionError) as e:
        runner.run(cfg, data=(data, {}), log=quiet)
    assert str(e.value) == ("data must be a fedjax_pfl.data.FederatedData, got tuple "
                            "(build_federated returns (data, info): pass the first)")
    with pytest.raises(OptionError, match=r"^run: data.y is None: the dataset has no labels"):
        runner.run(cfg, data=dataclasses.replace(data, y=None), log=quiet)
    with pytest.raises(OptionError, match=r"^run: data.y has dtype float32; labels are integer"):
        runner.run(cfg, data=dataclasses.replace(data, y=data.y.astype(np.float32)), log=quiet)
