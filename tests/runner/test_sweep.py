"""Sweeps: a vmapped group of runs equals the same runs one at a time; the sweep tool's table."""

import json
import os
import subprocess
import sys
import textwrap

import helpers
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


@pytest.mark.slow
def test_a_sweep_of_lora_adapters_trains_over_one_frozen_base_like_separate_runs():
    """--peft lora in a sweep: the runs' model is the adapted one (`sweep_model`, as the
    runner's), so a run of the common seed equals runner.run; a run of another seed trains over
    the same base (drawn from the common --seed) from its own adapters."""
    data = make_data([7, 23, 12, 9], feature_dim=6)
    hp = {"batch_size": 4, "participation": 0.5}
    lora = dict(peft="lora", lora_targets="all", lora_rank=2)
    runs = [sweep.RunSpec(seed, (("lr", lr),)) for lr in (0.005, 0.02) for seed in (0, 3)]
    cfg = runner.RunConfig(algo="fedavg", rounds=3, hparams=hp, progress=False,
                           memory_check=False, model="mlp", **lora)
    model = sweep.sweep_model(cfg, data)
    assert model.frozen is not None and model.name.endswith("+lora")
    summaries = sweep.run_group(cfg, runs, data=data, data_info={}, out=None, progress=False)
    for spec, got in [(runs[0], summaries[0]), (runs[2], summaries[2])]:     # seed 0, both lrs
        single = runner.RunConfig(algo="fedavg", rounds=3, seed=0, model="mlp", progress=False,
                                  hparams={**hp, **dict(spec.traced)}, memory_check=False, **lora)
        ref = runner.run(single, data=data, data_info={}, log=lambda *_: None)
        for key in ("acc_mean", "loss", "train_loss"):
            np.testing.assert_allclose(got["last"][key], ref["last"][key], rtol=2e-4, err_msg=key)
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
@pytest.mark.slow
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


SWEEP_PLACEMENTS = textwrap.dedent('''
    import sys
    sys.path.insert(0, "tests/support")
    import fedjax_pfl
    fedjax_pfl.use_cpu_cores()
    import jax, numpy as np
    from helpers import make_data
    from fedjax_pfl import runner, sweep

    algo, devices = sys.argv[1], len(jax.devices())
    data = make_data([7, 23, 12, 9, 5, 14], feature_dim=6)
    hp = {"batch_size": 4, "participation": 0.5, "local_steps": 2}
    runs = [sweep.RunSpec(seed, (("lr", lr),)) for seed in (0, 3) for lr in (0.05, 0.02)]
    out = {}
    for data_at, state_at, per_call in (("device", "device", 1), ("host", "device", 1),
                                        ("device", "host", 1), ("host", "host", 2)):
        cfg = runner.RunConfig(algo=algo, rounds=4, hparams=hp, progress=False,
                               memory_check=False, model="logreg", data_placement=data_at,
                               state_placement=state_at, rounds_per_call=per_call,
                               eval_every=2)
        out[data_at, state_at] = sweep.run_group(cfg, runs, data=data, data_info={}, out=None,
                                                 progress=False)
    rows = lambda s: [{k: v for k, v in r.items() if "time" not in k} for r in s["rows"]]
    ref = out["device", "device"]
    for placements, summaries in out.items():           # placements: bit for bit
        for a, b in zip(ref, summaries, strict=True):
            assert rows(a) == rows(b), (placements, rows(a)[-1], rows(b)[-1])
    for spec, got in zip(runs, ref):                     # each run: a separate run's
        single = runner.RunConfig(algo=algo, rounds=4, seed=spec.seed, model="logreg",
                                  hparams={**hp, **dict(spec.traced)}, progress=False,
                                  memory_check=False, eval_every=2)
        want = runner.run(single, data=data, data_info={}, log=lambda *_: None)
        for key in ("acc_mean", "loss", "train_loss"):
            np.testing.assert_allclose(got["last"][key], want["last"][key], rtol=2e-4)
    # On several devices each holds whole runs: its block of every per-client leaf is the
    # rows of V/D runs (clients v·N … v·N + N − 1 of runs v it holds).
    program = sweep.VectorProgram(algo, __import__("fedjax_pfl").models.get(
        "logreg", data.input_shape, data.num_classes), data, hp, runs)
    state = program.init()
    per_device = program.padded // devices * program.clients
    starts = lambda leaf: sorted(index[0].start or 0 for index in
                                 leaf.sharding.devices_indices_map(leaf.shape).values())
    for leaf in state.rows + state.device_rows:
        assert starts(leaf) == [d * per_device for d in range(devices)], (starts(leaf), per_device)
    for leaf in state.shared + list(state.hp.values()):     # one run's global model each
        assert starts(leaf) == [d * program.padded // devices for d in range(devices)]
    print("OK", devices)
''')


@pytest.mark.slow
@pytest.mark.parametrize("devices", [pytest.param(1, marks=pytest.mark.extended), 2])
def test_a_sweep_runs_with_every_placement_and_equals_separate_runs(devices):
    """Host data, host client state (each run's rows apart, each from its own initial rows) and
    two rounds per call give a sweep's runs bit for bit what device placement gives, and each
    run what `runner.run` gives with its seed and values; on two devices each device holds
    whole runs (ditto: personal models per client, a global model per run)."""
    env = {**os.environ, "FEDJAX_PFL_CPU_DEVICES": str(devices)}
    env["XLA_FLAGS"] = helpers.without_device_count(env.get("XLA_FLAGS", ""))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", SWEEP_PLACEMENTS, "ditto"], capture_output=True,
                          text=True, env=env, cwd=root, timeout=900)
    assert proc.returncode == 0 and proc.stdout.split()[-2:] == ["OK", str(devices)], \
        proc.stderr[-3000:]
