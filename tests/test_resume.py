"""Checkpoint and exact resume: a run stopped at round k and resumed from its checkpoint writes
the same metrics and ends in the same state, bit for bit, as a run that was never stopped."""

import json

import jax
import numpy as np
import pytest

import helpers
import run as cli        # experiments/run.py (on the tests' pythonpath)
from fedjax_pfl import algorithms, checkpoint, runner

ROUNDS, STOP = 4, 2


def _config(algo, out, rounds, *flags, checkpoint_every=STOP):
    """The command line's default configuration of `algo` (digits, 20 clients), whose prepared and
    compiled program is `helpers.default_prepared(algo)`, with these rounds and checkpoints."""
    return cli.config_from_args(cli.parse(["--algo", algo, "--quiet", "--out", str(out), "--rounds",
                                           str(rounds), "--checkpoint-every", str(checkpoint_every),
                                           *flags]))


def _rows(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        row.pop("round_time")                    # wall-clock, the only field that may differ
    return rows


def _final_state(out, like):
    return checkpoint.restore(str(out / "checkpoints" / f"round_{ROUNDS:06d}"), like=like)


def _host(leaf):
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        leaf = jax.random.key_data(leaf)
    return np.asarray(leaf)


@pytest.fixture
def no_figures(monkeypatch):
    """Runs that write no PNGs: drawing them (~0.8 s per run directory) was two thirds of the
    per-algorithm resume tests' time, and what they show is not what resume must reproduce
    (test_interrupted_run_records_what_finished_and_resumes, tests/test_cli.py and
    tests/test_interrupts.py check that runs write them)."""
    monkeypatch.setattr(runner, "plot_label_distribution", lambda *args, **kwargs: None)
    monkeypatch.setattr(runner, "plot_learning_curves", lambda *args, **kwargs: None)


FAST = ("fedavg",)     # the quick suite's; the full suite runs every algorithm


@pytest.mark.usefixtures("no_figures")
@pytest.mark.parametrize("algo", [a if a in FAST else pytest.param(a, marks=pytest.mark.slow)
                                  for a in algorithms.names()])
def test_resume_at_round_k_equals_uninterrupted(algo, tmp_path):
    cfg = _config(algo, tmp_path / "full", ROUNDS)
    prep = helpers.default_prepared(algo)           # the same configuration, compiled once
    quiet = lambda *_: None
    full = runner.run(cfg, prepared=prep, log=quiet)

    stopped = _config(algo, tmp_path / "resumed", STOP)
    runner.run(stopped, prepared=prep, log=quiet)
    assert runner.latest_checkpoint(str(tmp_path / "resumed")).endswith(f"round_{STOP:06d}")
    resumed = runner.run(_config(algo, tmp_path / "resumed", ROUNDS, "--resume"), prepared=prep,
                         log=quiet)

    assert _rows(tmp_path / "resumed") == _rows(tmp_path / "full")
    assert resumed["best"] == full["best"] and resumed["last"]["acc_mean"] == full["last"]["acc_mean"]
    like = prep.program.init(jax.random.fold_in(prep.root, 0))    # (FedPC: shapes from its graph)
    a, b = _final_state(tmp_path / "full", like), _final_state(tmp_path / "resumed", like)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(_host(x), _host(y))
    npz_full = np.load(tmp_path / "full" / "client_metrics.npz")
    npz_res = np.load(tmp_path / "resumed" / "client_metrics.npz")
    for key in ("sampled", "eval_rounds", "accuracy"):
        np.testing.assert_array_equal(npz_full[key], npz_res[key])


def test_interrupted_run_records_what_finished_and_resumes(tmp_path, monkeypatch):
    """Ctrl-C after round 3 (KeyboardInterrupt where the runner waits): summary.json says so,
    metrics.jsonl and the learning curve hold rounds 1–3, the last checkpoint is round 3 (every
    3), and resuming ends exactly like an uninterrupted run."""
    full_cfg = _config("fedavg", tmp_path / "full", 5, checkpoint_every=3)
    prep = helpers.default_prepared("fedavg")
    quiet = lambda *_: None
    runner.run(full_cfg, prepared=prep, log=quiet)

    def ctrl_c_after_round_3(r):
        if r == 4:
            raise KeyboardInterrupt
    monkeypatch.setattr(runner, "_test_pause", ctrl_c_after_round_3)
    out = tmp_path / "stopped"
    with pytest.raises(runner.Interrupted) as exc:
        runner.run(_config("fedavg", out, 5, checkpoint_every=3), prepared=prep, log=quiet)
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


@pytest.mark.usefixtures("no_figures")
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
