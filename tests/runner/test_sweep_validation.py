"""experiments/sweep.py checks everything before the first run and before any folder exists: bad
input exits with status 2 and one line naming the flag, the config field or the file; no folder is
created and the files of an earlier sweep stay as they were. A sweep that fails while running
leaves no empty folders behind."""

import json
import os

import pytest
import sweep as tool  # noqa: E402  (experiments/sweep.py)
from helpers import snapshot  # noqa: E402

from fedjax_pfl import runner, sweep  # noqa: E402


@pytest.fixture
def no_compute(monkeypatch):
    """Fails the test if the sweep gets past validation (data, a vmapped group or a single run)."""
    def forbidden(*a, **k):
        raise AssertionError("the sweep went past validation")
    for module, name in ((runner, "load_data"), (runner, "run"), (sweep, "run_group")):
        monkeypatch.setattr(module, name, forbidden)


@pytest.fixture
def earlier(tmp_path):
    """The folder of an earlier sweep, with a finished run."""
    out = tmp_path / "earlier"
    run = out / "digits" / "fedavg" / "default" / "seed=0"
    run.mkdir(parents=True)
    (out / "results.md").write_text("# Sweep\n")
    (run / "summary.json").write_text('{"best": {}, "last": {}}')
    (run / "metrics.jsonl").write_text('{"round": 1}\n')
    return out


def _config(tmp_path, content) -> str:
    path = tmp_path / "sweep.json"
    path.write_bytes(content if isinstance(content, bytes) else
                     (content if isinstance(content, str) else json.dumps(content)).encode())
    return str(path)


def _fails(argv, capsys, code=2) -> str:
    with pytest.raises(SystemExit) as exc:
        tool.main(argv)
    assert exc.value.code == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("sweep.py: error: "), err
    return err


BAD = [
    # (flags, or a function of tmp_path giving them; the message)
    (lambda t: ["--config", str(t / "missing.json")], "--config {t}/missing.json: no such file"),
    (lambda t: ["--config", str(t)], "is a directory, not a JSON file"),
    (lambda t: ["--config", _config(t, '{"algos": ["fedavg"],')],
     "sweep.json: not valid JSON (Expecting property name enclosed in double quotes: line 1"),
    (lambda t: ["--config", _config(t, b"\xff")], "sweep.json: not valid JSON ("),
    (lambda t: ["--config", _config(t, ["fedavg"])], "must hold a JSON object with the fields "
                                                     "algos, datasets, seeds, grid, common; got a JSON array"),
    (lambda t: ["--config", _config(t, {"algo": ["fedavg"]})], "unknown field 'algo'"),
    (lambda t: ["--config", _config(t, {"algos": "fedavg"})],
     "field 'algos' must be a non-empty list of names, got \"fedavg\""),
    (lambda t: ["--config", _config(t, {"datasets": []})], "field 'datasets' must be a non-empty list"),
    (lambda t: ["--config", _config(t, {"seeds": ["0"]})],
     "field 'seeds' must be a non-empty list of integers, got [\"0\"]"),
    (lambda t: ["--config", _config(t, {"seeds": [True]})], "field 'seeds' must be a non-empty list"),
    (lambda t: ["--config", _config(t, {"grid": ["lr", 0.1]})], "field 'grid' must be an object"),
    (lambda t: ["--config", _config(t, {"grid": {"lr": 0.1}})],
     "field 'grid.lr' must be a non-empty list of numbers, strings or booleans, got 0.1"),
    (lambda t: ["--config", _config(t, {"grid": {"lr": [[0.1]]}})], "field 'grid.lr' must be"),
    (lambda t: ["--config", _config(t, {"common": ["--rounds", "2"]})],
     "field 'common' must be a string of run.py flags"),
    (lambda t: ["--config", _config(t, {"seeds": [1, 1]})],
     "field 'seeds' lists seed 1 more than once"),
    (lambda t: ["--config", _config(t, {"algos": ["fedavg", "pgfed"], "grid": {"mu": [-1]}})],
     "--grid mu=-1: pgfed on digits: --pgfed-mu must be >= 0, got -1.0"),
    (lambda t: ["--config", _config(t, '{"grid": {"lr": [NaN]}}')],
     "--grid lr=nan: fedavg on digits: --lr must be > 0, got nan"),
    (lambda t: ["--config", _config(t, {"grid": {"batch_size": [2.5]}})],
     "--grid batch_size=2.5: fedavg on digits: --batch-size must be int, got '2.5'"),
    (["--grid", "lr=abc"], "--grid lr=abc: fedavg on digits: --lr must be float, got 'abc'"),
    (["--grid", "lr=nan"], "--grid lr=nan: fedavg on digits: --lr must be > 0, got nan"),
    (["--grid", "lr=inf"], "--grid lr=inf: fedavg on digits: --lr must be finite, got inf"),
    (["--grid", "batch_size=1.5"], "--batch-size must be int, got '1.5'"),
    (["--grid", "drop_last=maybe"], "--drop-last must be true or false, got 'maybe'"),
    (["--grid", "backend=fast"], "--grid backend=fast: fedavg on digits: --backend must be one of"),
    # Every run is validated first: FedAvg (first) is fine, PGFed's μ is not.
    (["--algos", "fedavg", "pgfed", "--grid", "mu=-1"],
     "--grid mu=-1: pgfed on digits: --pgfed-mu must be >= 0, got -1.0"),
    (["--algos", "fedavg", "pgfed", "--grid", "mu=0.1,-1"], "--pgfed-mu must be >= 0, got -1.0"),
    (["--algos", "fedavg", "pgfed", "--datasets", "digits", "synthetic", "--grid", "lr=0.1,-0.1"],
     "--grid lr=-0.1: fedavg on digits: --lr must be > 0, got -0.1"),
    (["--grid", "nosuchparam=1"], "--grid nosuchparam: no chosen algorithm (fedavg) has a "
                                  "hyperparameter 'nosuchparam'; they take participation, "),
    (["--algos", "fedavg", "pgfed", "--grid", "lam=1"],
     "no chosen algorithm (fedavg, pgfed) has a hyperparameter 'lam'; they take participation, "
     "local_epochs, local_steps, batch_size, lr, momentum, momentum_buffer, drop_last, backend, "
     "chunk_size, eval_batch_size, dp_clip, dp_noise_multiplier, dp_clip_quantile, dp_clip_lr, "
     "dp_count_noise, sampling, server_opt, server_opt_lr, server_opt_momentum, server_opt_b1, "
     "server_opt_b2, server_opt_eps, server_opt_bias_correction, aggregator, aggregator_beta, "
     "aggregator_f, aggregator_m, aggregator_iters, aggregator_nu, aggregator_tau, "
     "aggregator_radius, attack, attack_fraction, attack_redraw, attack_scale, attack_std, "
     "attack_z, attack_eps, attack_target, attack_poison_fraction, attack_trigger_size (all) "
     "and their own (fedavg: "
     "(none); pgfed: mu, alpha_lr)"),
    (["--grid", "rounds=3"], "--grid rounds: --rounds is a run setting, not an algorithm "
                             "hyperparameter; set it in --common"),
    (["--grid", "lr=0.1", "--grid", "lr=0.2"], "--grid lr is given twice"),
    (["--grid", "lr="], "--grid wants NAME=V1,V2,…, got 'lr='"),
    (["--grid", "lr=0.1,,0.2"], "--grid lr=0.1,,0.2: empty value"),
    (["--grid", "lr=0.1,0.10"], "--grid lr lists the value 0.1 more than once ('0.1' and '0.10')"),
    (["--grid", "lr=0.1234567,0.1234568"],
     "the runs 'fedavg on digits lr=0.1234567 seed=0' and 'fedavg on digits lr=0.1234568 seed=0' "
     "would share the folder"),
    (["--seeds", "0", "0"], "--seeds lists seed 0 more than once"),
    (["--seeds", "-1"], "--seeds must be in [0, 2**32), got -1"),
    (["--seeds", "x"], "argument --seeds: invalid int value: 'x'"),
    (["--algos", "fedavg", "fedavg"], "--algos lists algorithm 'fedavg' more than once"),
    (["--algos", "nope"], "--algos: unknown algorithm 'nope'; expected one of ['apfl', "),
    (["--datasets", "nope"], "--datasets: unknown dataset 'nope'; expected one of ['digits', "),
    (["--common", "--algo pgfed"], "--common: --algo is set by the sweep itself (use --algos)"),
    (["--common", "--seeds 1 2"], "--common: --seeds is set by the sweep itself (use --seeds)"),
    (["--common", "--num-processes 2"],
     "--common: --num-processes is not a per-run flag (use sweep.py's own --num-processes)"),
    (["--num-processes", "2"], "--num-processes 2 needs --coordinator HOST:PORT"),
    (["--common", "--rounds x"], "--common: argument --rounds: invalid int value: 'x'"),
    (["--common=--no-such-flag"], "--common: unrecognized arguments: --no-such-flag"),
    (["--common", "--rounds \"3"], "--common: cannot split '--rounds \"3' into flags (No closing"),
    (["--common", "--rounds 0"], "fedavg on digits: --rounds must be >= 1, got 0"),
    (["--common", "--partition iid --alpha 0.3"],
     "fedavg on digits: --alpha applies to --partition dirichlet / dirichlet_client only, not "
     "--partition iid"),
    (["--common", "--local-epochs 2 --local-steps 2"],
     "fedavg on digits: --local-epochs and --local-steps 2 both set the local work"),
    (["--algos", "fedavg", "pgfed", "--common", "--pgfed-mu 0.1"],
     "fedavg on digits: --pgfed-mu does not apply to --algo fedavg (a hyperparameter that only "
     "some algorithms have goes in --grid NAME=VALUE"),
]


@pytest.mark.parametrize("argv,message", BAD)
def test_bad_input_is_one_line_before_any_folder(argv, message, tmp_path, capsys, no_compute,
                                                 earlier):
    argv = argv(tmp_path) if callable(argv) else argv
    message = message.replace("{t}", str(tmp_path))
    before, listing = snapshot(earlier), sorted(os.listdir(tmp_path))
    new = tmp_path / "new" / "sweep"
    assert message in _fails(["--out", str(new)] + argv, capsys)
    assert sorted(os.listdir(tmp_path)) == listing                  # no folder was created
    # The same input on top of an earlier sweep (--resume) changes none of its files.
    assert message in _fails(["--out", str(earlier), "--resume"] + argv, capsys)
    assert snapshot(earlier) == before


def test_out_that_is_a_file_or_holds_files(tmp_path, capsys, no_compute, earlier):
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    assert f"--out {afile} is an existing file, not a directory" in _fails(
        ["--out", str(afile)], capsys)
    assert afile.read_text() == "keep me"
    before = snapshot(earlier)
    err = _fails(["--out", str(earlier)], capsys)                  # no --resume
    assert f"--out {earlier} already holds files (digits, results.md); pass --resume" in err
    assert snapshot(earlier) == before


def test_missing_dataset_stops_the_sweep_before_its_first_run(tmp_path, capsys, monkeypatch,
                                                              earlier):
    """The second dataset's files are absent: the sweep stops before digits runs."""
    def forbidden(*a, **k):
        raise AssertionError("a run started before every dataset was found")
    monkeypatch.setattr(runner, "run", forbidden)
    monkeypatch.setattr(sweep, "run_group", forbidden)
    monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path / "no_tfds"))
    empty = tmp_path / "empty"
    empty.mkdir()
    new = tmp_path / "new"
    err = _fails(["--out", str(new), "--datasets", "digits", "mnist",
                  "--common", f"--data-dir {empty}"], capsys)
    assert "--datasets mnist: " in err and "train-images-idx3-ubyte.gz" in err
    assert not new.exists()


def test_algorithm_checks_run_for_every_run_before_the_first(tmp_path, capsys, monkeypatch, earlier):
    """A check that the algorithm's factory makes (pFedSOP's probe is plain SGD: momentum 0) for a
    combination later in the sweep stops it before FedAvg, first, runs."""
    def forbidden(*a, **k):
        raise AssertionError("a run started before every run's algorithm was checked")
    monkeypatch.setattr(runner, "run", forbidden)
    monkeypatch.setattr(sweep, "run_group", forbidden)
    new = tmp_path / "new"
    err = _fails(["--out", str(new), "--algos", "fedavg", "pfedsop", "--grid", "momentum=0,0.9",
                  "--grid", "lr=0.1"], capsys)
    assert ("pfedsop on digits (momentum=0.9 lr=0.1): pfedsop's local probe is plain SGD "
            "(Algorithm 2): --momentum must be 0, got 0.9") in err
    assert not new.exists()
    before = snapshot(earlier)
    _fails(["--out", str(earlier), "--resume", "--algos", "fedavg", "pfedsop",
            "--common", "--momentum 0.5"], capsys)
    assert snapshot(earlier) == before


def test_plan_validates_and_groups_every_run(capsys):
    """The plan of a grid, against the combinations enumerated here: FedAvg has no μ (skipped, said
    once), PGFed varies lr × μ inside one program per batch size (lr and μ are traceable), and
    switches (drop_last) are static, each value its own group."""
    args = tool.build_parser().parse_args([
        "--out", "unused", "--algos", "fedavg", "pgfed", "--seeds", "3", "1",
        "--grid", "mu=0.1,0.2", "--grid", "lr=0.05", "--grid", "batch_size=5,10",
        "--grid", "drop_last=true,false", "--common", "--rounds 2"])
    the_plan = tool.plan(args)
    assert "fedavg: no hyperparameter ['mu']; not varied for it" in capsys.readouterr().out
    assert not os.path.exists("unused")
    got = {(g.algo, tuple(sorted(g.static.items()))): (g.traced, [(r.seed, r.traced) for r in g.runs])
           for g in the_plan.groups}
    expected = {}
    for algo, traced in (("fedavg", [{"lr": 0.05}]),
                         ("pgfed", [{"lr": 0.05, "mu": 0.1}, {"lr": 0.05, "mu": 0.2}])):
        for bs in (5, 10):
            for drop in (True, False):
                runs = [(seed, tuple(sorted(tc.items()))) for tc in traced for seed in (3, 1)]
                expected[(algo, (("batch_size", bs), ("drop_last", drop)))] = (traced, runs)
    assert got == expected
    for g in the_plan.groups:
        assert g.cfg.rounds == 2 and g.cfg.hparams["batch_size"] in (5, 10)
        assert g.directory.startswith(os.path.join("unused", "digits", g.algo, "batch_size="))


@pytest.mark.parametrize("error,code,message", [
    (ValueError("boom: a check that needs the data"), 2, "boom: a check that needs the data"),
    (runner.NonFiniteError("round 1: clients [0] have NaN/Inf"), 1, "round 1: clients [0] have"),
])
def test_failed_sweep_leaves_no_empty_folders(error, code, message, tmp_path, capsys, monkeypatch,
                                              earlier):
    """A run that fails after the folders were made (here: at once) takes its empty folders with
    it; the earlier sweep's folders and files stay."""
    def group_fails(cfg, runs, *, out, **kwargs):
        os.makedirs(os.path.join(out, "lr=0.1_seed=0"))
        raise error

    def run_fails(cfg, **kwargs):        # the fallback for a group that is not vectorisable
        os.makedirs(cfg.out, exist_ok=True)
        raise error
    monkeypatch.setattr(sweep, "run_group", group_fails)
    monkeypatch.setattr(runner, "run", run_fails)
    new = tmp_path / "new" / "sweep"
    assert message in _fails(["--out", str(new), "--grid", "lr=0.1", "--common", "--rounds 1"],
                             capsys, code=code)
    assert not (tmp_path / "new").exists()
    before = snapshot(earlier)
    assert message in _fails(["--out", str(earlier), "--resume", "--grid", "lr=0.1",
                              "--common", "--rounds 1"], capsys, code=code)
    assert snapshot(earlier) == before


def test_checks_that_need_the_data_run_for_every_run_before_the_first(tmp_path, capsys,
                                                                      monkeypatch, earlier):
    """--eval-clients more than the dataset's clients is only known once the data is loaded
    (`runner.check_with_data`, shared with run.py's `prepare`): it stops the sweep before its
    first run all the same."""
    def forbidden(*a, **k):
        raise AssertionError("a run started before every run was checked against its data")
    monkeypatch.setattr(runner, "run", forbidden)
    monkeypatch.setattr(sweep, "run_group", forbidden)
    new = tmp_path / "new"
    err = _fails(["--out", str(new), "--common", "--clients 6 --eval-clients 7"], capsys)
    assert "fedavg on digits: --eval-clients 7 is more than the 6 clients" in err
    assert not new.exists()


@pytest.mark.parametrize("bad_at", [1, 3])
def test_a_vmapped_group_refuses_an_invalid_later_run_before_anything_runs(bad_at, tmp_path):
    """`sweep.run_group`'s runs are checked one by one, not only the first: with run `bad_at`
    (the second, or the last of four) at lr = −0.5, the group is refused naming that run's seed
    and value, before a folder is made (no program is built: nothing is traced or compiled)."""
    from helpers import make_data

    data = make_data([7, 23, 12, 9])
    cfg = runner.RunConfig(algo="fedavg", rounds=2, hparams={"batch_size": 4}, progress=False,
                           memory_check=False, model="logreg")
    runs = [sweep.RunSpec(seed, (("lr", 0.1),)) for seed in (0, 1, 2, 3)]
    runs[bad_at] = sweep.RunSpec(7, (("lr", -0.5),))
    out = tmp_path / "group"
    with pytest.raises(ValueError) as e:
        sweep.run_group(cfg, runs, data=data, data_info={}, out=str(out), progress=False)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("run lr=-0.5 seed=7 of fedavg: ") and "got -0.5" in message, message
    assert not out.exists()
