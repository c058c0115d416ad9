"""Sweeps: a vmapped group of runs equals the same runs one at a time; the sweep tool's table."""

import json
import os

import numpy as np
import pytest
from helpers import make_data

from fedjax_pfl import models, runner, sweep


@pytest.mark.slow
@pytest.mark.parametrize("algo,traced", [
    ("pgfedmo", {"lr": (0.05, 0.02), "mu": (0.1, 0.01)}),
    pytest.param("tdpfed", {"lam": (5.0, 12.0)}, marks=pytest.mark.slow),
])
def test_vmapped_runs_equal_separate_runs(algo, traced):
    """Seeds and traceable hyperparameters vmapped in one program give each run's own metrics:
    the same as runner.run with that seed and those values (same keys, same data)."""
    data = make_data([7, 23, 12, 9], feature_dim=6)
    hp = {"batch_size": 4, "participation": 0.5}
    if algo == "tdpfed":
        hp.update(local_steps=2, personal_steps=1, factor_steps=2)
    names = sorted(traced)
    combos = list(zip(*[traced[n] for n in names]))
    runs = [sweep.RunSpec(seed, tuple(zip(names, combo))) for combo in combos for seed in (0, 3)]
    cfg = runner.RunConfig(algo=algo, rounds=3, hparams=hp, progress=False, memory_check=False,
                           model="logreg")
    summaries = sweep.run_group(cfg, runs, data=data, data_info={}, out=None, progress=False)
    for spec, got in [(runs[0], summaries[0]), (runs[-1], summaries[-1])]:   # two of the four
        single = runner.RunConfig(algo=algo, rounds=3, seed=spec.seed, model="logreg",
                                  hparams={**hp, **dict(spec.traced)}, progress=False,
                                  memory_check=False)
        ref = runner.run(single, data=data, data_info={}, log=lambda *_: None)
        for key in ("acc_mean", "loss", "train_loss"):
            np.testing.assert_allclose(got["last"][key], ref["last"][key], rtol=2e-4, err_msg=key)
    # The runs differ from one another (seeds and values really reach the program).
    assert len({round(s["last"]["train_loss"], 6) for s in summaries}) == len(runs)


def test_untraceable_hyperparameters_are_refused_in_one_program():
    data = make_data([7, 23])
    model = models.get("logreg", data.input_shape, data.num_classes)
    with pytest.raises(ValueError, match="cannot vary \\['batch_size'\\] inside one program"):
        sweep.VectorProgram("fedavg", model, data, {}, [sweep.RunSpec(0, (("batch_size", 4),))])


@pytest.mark.slow
def test_sweep_tool_writes_a_table_and_resumes(tmp_path, capsys):
    import sweep as tool

    argv = ["--out", str(tmp_path), "--algos", "fedavg", "local", "--seeds", "0", "1",
            "--grid", "lr=0.05,0.1", "--common", "--rounds 2 --clients 6 --quiet"]
    assert tool.main(argv) == 0
    capsys.readouterr()
    table = (tmp_path / "results.md").read_text()
    for algo in ("fedavg", "local"):
        for lr in ("0.05", "0.1"):
            assert f"| digits | {algo} | lr={lr} | 2 |" in table
    rows = json.loads((tmp_path / "results.json").read_text())
    assert len(rows) == 4 and all("±" in r["last"] for r in rows)
    assert (tmp_path / "curves.png").exists()
    summary = json.loads((tmp_path / "digits/fedavg/default/lr=0.05_seed=1/summary.json").read_text())
    assert summary["seed"] == 1 and summary["traced"] == {"lr": 0.05}
    assert tool.main(argv + ["--resume"]) == 0
    assert "reused 4 runs" in capsys.readouterr().out


def _tree(root) -> dict[str, bytes]:
    return {os.path.relpath(os.path.join(d, f), root): open(os.path.join(d, f), "rb").read()
            for d, _, fs in os.walk(root) for f in fs}


@pytest.mark.parametrize("sequential", [False, True])
def test_sweep_resume_reuses_only_finished_runs_of_the_same_configuration(tmp_path, capsys,
                                                                           sequential):
    """--resume reuses a run only when it finished and its config.json is this run's: a changed
    --common flag (one the plan does not name, a hyperparameter) is refused in one line before
    anything runs, leaving every file; an interrupted run is run again, not reported."""
    import sweep as tool

    base = ["--out", str(tmp_path), "--algos", "fedavg", "--seeds", "0"]
    more = ["--sequential"] if sequential else []
    argv = base + ["--common", "--rounds 1 --clients 4 --quiet"] + more
    assert tool.main(argv) == 0
    capsys.readouterr()
    assert tool.main(argv + ["--resume"]) == 0          # (--sequential: no KeyError 'traced')
    assert "reused 1 runs" in capsys.readouterr().out
    before = _tree(tmp_path)
    for common, message in (("--rounds 1 --clients 4 --quiet --local-epochs 2",
                             "--local-epochs 1, not 2"),
                            ("--rounds 2 --clients 4 --quiet", "--rounds 1, not 2")):
        changed = base + ["--common", common] + more + ["--resume"]
        with pytest.raises(SystemExit) as exc:
            tool.main(changed)
        err = capsys.readouterr().err.strip().splitlines()
        assert exc.value.code == 2 and len(err) == 1 and message in err[0], err
        assert _tree(tmp_path) == before
    # A run stopped before its end is not reused: its summary says interrupted.
    summary_path = tmp_path / "digits/fedavg/default/seed=0/summary.json"
    summary = json.loads(summary_path.read_text())
    summary.update(interrupted=True, last={"acc_mean": -1.0})
    summary_path.write_text(json.dumps(summary))
    assert tool.main(argv + ["--resume"]) == 0
    assert "reused" not in capsys.readouterr().out
    assert json.loads(summary_path.read_text())["last"]["acc_mean"] >= 0
