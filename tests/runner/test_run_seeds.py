"""fedjax_pfl.sweep.run_seeds: several seeds of one configuration as one vmapped program, each
seed's run in OUT/seed_S/ and their mean ± std in OUT/summary.json: what `run.py --seeds` runs and
prints, from a notebook."""

import json

import numpy as np
import pytest
import run as cli  # noqa: E402  (experiments/run.py)
from helpers import make_data  # noqa: E402

from fedjax_pfl import runner, sweep  # noqa: E402
from fedjax_pfl.errors import OptionError  # noqa: E402

SEEDS = [0, 3, 5]


@pytest.fixture(scope="module")
def seeds_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("seeds") / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("stale\n")             # a previous run's file: replaced
    data = make_data([7, 23, 12, 9], feature_dim=6)
    cfg = runner.RunConfig(algo="fedavg", rounds=3, eval_every=2, model="logreg", out=str(out),
                           progress=False, memory_check=False,
                           hparams={"batch_size": 4, "participation": 0.5})
    aggregate, summaries = sweep.run_seeds(cfg, SEEDS, data=data, data_info={})
    return out, aggregate, summaries


@pytest.mark.slow
def test_the_aggregate_is_numpys_mean_and_std_of_the_seeds_summaries(seeds_run):
    out, aggregate, summaries = seeds_run
    assert json.loads((out / "summary.json").read_text()) == aggregate
    assert not (out / "metrics.jsonl").exists()
    per_seed = [json.loads((out / f"seed={s}" / "summary.json").read_text()) for s in SEEDS]
    assert [s["seed"] for s in per_seed] == SEEDS == aggregate["seeds"] == aggregate["runs"]
    checked = 0
    for kind in ("best", "last"):
        for key in ("acc_mean", "acc_weighted", "acc_worst10"):
            values = np.array([s[kind][key] for s in per_seed])
            got = aggregate[f"{kind}_{key}"]
            assert got["values"] == values.tolist()
            assert got["mean"] == pytest.approx(float(values.mean()), rel=1e-12)
            assert got["std"] == pytest.approx(float(np.sqrt(((values - values.mean()) ** 2).mean())),
                                               rel=1e-12, abs=1e-15)
            checked += 1
    assert checked == 6 and "best_global_acc_mean" not in aggregate     # fedavg's global: none
    assert len({s["last"]["train_loss"] for s in summaries}) == len(SEEDS)  # seeds really differ


def test_the_table_prints_each_metric_last_and_best_as_mean_and_std(seeds_run):
    _, aggregate, _ = seeds_run
    lines = sweep.seeds_table(aggregate)
    assert len(lines) == 3
    last, best = aggregate["last_acc_mean"], aggregate["best_acc_mean"]
    assert lines[0] == (f"  {'acc_mean':<22} last {last['mean']:.4f} ± {last['std']:.4f}   "
                        f"best {best['mean']:.4f} ± {best['std']:.4f}")


def test_seeds_summary_of_hand_made_summaries():
    summaries = [{"seed": 1, "best": {"acc_mean": 0.5, "global_acc_mean": 0.2},
                  "last": {"acc_mean": 0.4}},
                 {"seed": 2, "best": {"acc_mean": 0.7}, "last": {"acc_mean": 0.6}}]
    got = sweep.seeds_summary([1, 2], summaries)
    assert got["best_acc_mean"] == {"mean": 0.6, "std": pytest.approx(0.1), "values": [0.5, 0.7]}
    assert got["last_acc_mean"]["mean"] == pytest.approx(0.5)
    assert got["best_global_acc_mean"] == {"mean": 0.2, "std": 0.0, "values": [0.2]}  # who has it
    assert "last_global_acc_mean" not in got


@pytest.mark.parametrize("seeds,target,said,flagged", [
    ([1, 1], None, "seeds lists seed 1 more than once", "--seeds lists seed 1 more than once"),
    ([1, -2], None, "seeds must be in [0, 2**32), got -2", "--seeds must be in [0, 2**32), got -2"),
    ([1, 2], 0.5, "target_acc stops one run; seeds runs several as one program (run the seeds one "
     "by one with seed to stop", "--target-acc stops one run; --seeds runs several as one program "
     "(run the seeds one by one with --seed to stop"),
])
def test_bad_seeds_are_refused_before_anything_runs(seeds, target, said, flagged, capsys):
    cfg = runner.RunConfig(target_acc=target, progress=False)
    with pytest.raises(OptionError) as exc:
        sweep.run_seeds(cfg, seeds, data=object())
    assert str(exc.value).startswith(said)
    argv = ["--seeds", *map(str, seeds)] + (["--target-acc", str(target)] if target else [])
    with pytest.raises(SystemExit):
        cli.main(argv + ["--quiet"])
    assert capsys.readouterr().err.startswith(f"run.py: error: {flagged}")


@pytest.mark.slow
def test_run_py_seeds_prints_the_librarys_aggregate(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(["--seeds", "0", "1", "--rounds", "2", "--clients", "6", "--participation",
                     "0.5", "--local-steps", "1", "--out", str(out), "--quiet"]) == 0
    aggregate = json.loads((out / "summary.json").read_text())
    printed = capsys.readouterr().out.splitlines()
    table = sweep.seeds_table(aggregate)
    assert printed[-len(table):] == table and printed[-len(table) - 1].startswith("2 seeds in one")
