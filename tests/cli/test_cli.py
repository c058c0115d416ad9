"""The command line: one-line errors with exit status 2 before any computation, and a real run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
import run as cli  # noqa: E402  (experiments/run.py)

from fedjax_pfl import runner  # noqa: E402


@pytest.fixture
def no_compute(monkeypatch):
    """Fails the test if the CLI gets as far as running rounds."""
    def forbidden(*a, **k):
        raise AssertionError("runner.run was called: validation should have failed first")
    monkeypatch.setattr(runner, "run", forbidden)


@pytest.mark.parametrize("argv,message", [
    (["--algo", "nope"], "--algo must be one of ['apfl', 'ditto', "),
    (["--alpha", "0"], "--alpha must be > 0, got 0.0"),
    (["--alpha", "0", "--partition", "iid"],
     "--alpha applies to --partition dirichlet / dirichlet_client only, not --partition iid"),
    (["--alpha", "-1"], "--alpha must be > 0"),
    (["--participation", "0"], "--participation must be in (0, 1], got 0.0"),
    (["--participation", "1.5"], "--participation must be in (0, 1]"),
    (["--clients", "5000"], "--clients 5000 is more than the 1797 samples of digits"),
    (["--lr", "-1"], "--lr must be > 0"),
    (["--rounds", "0"], "--rounds must be >= 1"),
    (["--partition", "random"], "--partition must be one of"),
    (["--momentum-buffer", "keep"], "--momentum-buffer must be one of"),
    (["--ft-epochs", "2"], "--ft-epochs does not apply to --algo fedavg"),
    (["--batch-size", "ten"], "--batch-size must be int, got 'ten'"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--preset", "nope"], "--preset 'nope' not found"),
    (["--lr", "inf"], "--lr must be finite, got inf"),
    (["--lr", "nan"], "--lr must be > 0, got nan"),
    (["--alpha", "inf"], "--alpha must be finite, got inf"),
    (["--seed", "-1"], "--seed must be in [0, 2**32), got -1"),
    (["--seeds", "1", "-2"], "--seeds must be in [0, 2**32), got -2"),
    (["--model", "cnn"], "--model cnn needs images of at least 16x16"),
    (["--model", "resnet18"], "--model resnet18 needs images of at least 16x16"),
    (["--algo", "pfedsop", "--momentum", "0.9"], "--momentum must be 0, got 0.9"),
    (["--preset", "pgfed_paper"], "--preset pgfed_paper is a protocol shared by several algorithms"),
    (["--clients", "200", "--min-size", "10"], "use at most --clients 179"),
    (["--checkpoint-every", "3", "--rounds-per-call", "2", "--eval-every", "2"],
     "--checkpoint-every 3 must be a multiple of --rounds-per-call 2"),
    (["--checkpoint-every", "-1"], "--checkpoint-every must be >= 0"),
    (["--resume"], "--resume needs the run's directory"),
    (["--dataset", "nope"], "--dataset must be one of ['digits', 'synthetic', "),
    (["--partition", "natural"], "--partition natural keeps a dataset's own clients: synthetic's "
                                 "or a natural-client dataset's, not --dataset digits's"),
])
def test_bad_input_is_one_line_exit_2(argv, message, capsys, no_compute):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv + ["--quiet"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("run.py: error: ")
    assert message in err


# Flags the run would not use: each refused in one line naming the flag and why, exit 2,
# before anything is written (the rule table: fedjax_pfl.runner.options.applies_table).
UNUSED = [
    (["--partition", "iid", "--shards-per-client", "3"],
     "--shards-per-client applies to --partition shards only, not --partition iid"),
    (["--partition", "iid", "--min-size", "5"],
     "--min-size applies to --partition dirichlet only, not --partition iid"),
    (["--clusters", "3"], "--clusters applies to --partition clustered only, not --partition "
                          "dirichlet"),
    (["--classes-per-client", "3"], "--classes-per-client applies to --partition pathological"),
    (["--synthetic-alpha", "0.5"],
     "--synthetic-alpha applies to --dataset synthetic only, not --dataset digits"),
    (["--synthetic-alpha", "1.0"],          # (the default value, given: still not used)
     "--synthetic-alpha applies to --dataset synthetic only, not --dataset digits"),
    (["--emnist-split", "letters"], "--emnist-split applies to --dataset emnist only, not "
                                    "--dataset digits"),
    (["--model-cr", "3"], "--model-cr applies to --model cp_mlp / cp_vgg8 only, not --model mlp"),
    (["--model-options", "hidden=8"], "--model-options applies to --model char_lstm / "),
    (["--dp-noise-multiplier", "1"],
     "--dp-noise-multiplier needs --dp-clip (client-level DP of the uplink): without it nothing "
     "uses it"),
    (["--dp-accountant", "pld"], "--dp-accountant needs --dp-clip"),
    (["--dp-delta", "0.001"], "--dp-delta needs --dp-clip"),
    (["--dp-clip", "1", "--dp-clip-lr", "0.3"],
     "--dp-clip-lr needs --dp-clip-quantile (adaptive clipping)"),
    (["--dp-clip-quantile", "0.5"], "--dp-clip-quantile needs --dp-clip (the initial clip norm"),
    (["--local-epochs", "2", "--local-steps", "3"],
     "--local-epochs and --local-steps 3 both set the local work: give one (--local-steps, when "
     "set, replaces the epochs)"),
    (["--algo", "tdpfed", "--local-epochs", "2"],
     "--local-epochs does not apply: --algo tdpfed runs --local-steps 23 by default"),
    (["--preset", "fedpc_clustered", "--algo", "fedavg", "--local-epochs", "2"],
     "--local-epochs and --local-steps 10 both set the local work"),
]


@pytest.mark.parametrize("argv,message", UNUSED, ids=[" ".join(a) for a, _ in UNUSED])
def test_a_flag_the_run_does_not_use_is_refused_in_one_line(argv, message, tmp_path, capsys,
                                                            no_compute):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        cli.main(argv + ["--out", str(out), "--quiet"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"run.py: error: {message}"), err
    assert not out.exists()


@pytest.mark.parametrize("argv,flag,field,left", [
    (["--download"], "--download", "download", False),
    (["--tfds-dir", "/nowhere"], "--tfds-dir", "tfds_dir", None),
    (["--data-dir", "/nowhere"], "--data-dir", "data_dir", None),
])
def test_a_harmless_flag_the_run_does_not_use_is_said_once_and_left_out(argv, flag, field, left,
                                                                        capsys):
    cfg = cli.config_from_args(cli.parse(argv + ["--out", "o"]))
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"run.py: warning: {flag} ")
    assert "--dataset digits" in err and "left out" in err
    assert cfg.data_options[field] is left            # what config.json records: not the flag


def test_the_librarys_warnings_are_one_line_each_in_flags_once_the_step_succeeds(capsys):
    import warnings

    from fedjax_pfl.errors import OptionWarning, arg

    with cli.said_warnings("run.py", "fedavg"):
        warnings.warn(OptionWarning(f"{arg('target_epsilon')} 1e-06 calls for "
                                    f"{arg('dp_noise_multiplier', 'hparams')} 118: too noisy"))
    assert capsys.readouterr().err == ("run.py: warning: --target-epsilon 1e-06 calls for "
                                       "--dp-noise-multiplier 118: too noisy\n")
    with pytest.raises(ValueError), cli.said_warnings():     # an error: it is the one line
        warnings.warn(OptionWarning("x"))
        raise ValueError("bad")
    assert capsys.readouterr().err == ""


def test_a_presets_setting_the_run_does_not_use_is_left_out_with_a_warning(capsys):
    """pgfed_paper's Dir(0.3) settings and E = 5 under --partition iid --local-steps 2: the
    explicit flags win, the preset's α, min size and epochs are said and left at the defaults."""
    cfg = cli.config_from_args(cli.parse(["--preset", "pgfed_paper", "--algo", "pgfed",
                                          "--partition", "iid", "--local-steps", "2"]))
    lines = capsys.readouterr().err.splitlines()
    assert [line.split()[2] for line in lines] == ["--alpha", "--min-size", "--local-epochs"]
    assert all(line.startswith("run.py: warning: ") and "the preset's value left out" in line
               for line in lines)
    assert (cfg.partition.alpha, cfg.partition.min_size) == (0.5, 10)   # PartitionConfig's
    assert "local_epochs" not in cfg.hparams and cfg.hparams["local_steps"] == 2
    assert cfg.hparams["lr"] == 0.005 and cfg.partition.num_clients == 25   # the rest applies


@pytest.mark.parametrize("options,message", [
    ("--model char_lstm --model-options hidden=abc",
     "--model-options hidden must be an integer >= 1, got 'abc'"),
    ("--model char_lstm --model-options hidden=1.5",
     "--model-options hidden must be an integer >= 1, got 1.5"),
    ("--model char_lstm --model-options layers=0",
     "--model-options layers must be an integer >= 1, got 0"),
    ("--model char_lstm --model-options output_tanh=2",
     "--model-options output_tanh must be true or false, got 2"),
    ("--model femnist_cnn --model-options conv=fast",
     "--model-options conv must be one of ['auto', 'im2col', 'winograd'], got 'fast'"),
    ("--model transformer --model-options width=10",
     "--model-options width 10 must be a multiple of heads 4"),
    ("--model char_lstm --model-options hiden=3",
     "--model-options hiden: --model char_lstm has no such option; it takes embed, hidden, "
     "layers, output_tanh"),
])
def test_a_bad_model_option_is_one_line_naming_it_before_the_data(options, message, tmp_path,
                                                                  capsys, no_compute, monkeypatch):
    def no_data(*a, **k):
        raise AssertionError("the data were loaded: the model options are checked first")
    monkeypatch.setattr(runner, "load_data", no_data)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        cli.main(options.split() + ["--out", str(out), "--quiet"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err == f"run.py: error: {message}\n"
    assert not out.exists()


def test_missing_dataset_names_the_files_and_fails_fast(tmp_path, capsys, monkeypatch, no_compute):
    monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path / "tfds"))
    with pytest.raises(SystemExit) as exc:
        cli.main(["--dataset", "mnist", "--data-dir", str(tmp_path), "--quiet"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--dataset mnist" in err
    assert "train-images-idx3-ubyte.gz" in err and "--download" in err and str(tmp_path) in err


def _env():
    """The subprocess imports this checkout's package (not an installed copy)."""
    return {**os.environ, "PYTHONPATH": str(ROOT)}


@pytest.mark.slow
def test_exit_status_of_the_real_script():
    proc = subprocess.run([sys.executable, str(ROOT / "experiments" / "run.py"), "--alpha", "0"],
                          capture_output=True, text=True, env=_env())
    assert proc.returncode == 2
    assert proc.stderr.strip() == "run.py: error: --alpha must be > 0, got 0.0"


def test_help_lists_every_algorithm_flag():
    text = cli.build_parser().format_help()
    for flag in ("--participation", "--local-epochs", "--momentum-buffer", "--pgfed-momentum-buffer",
                 "--ft-epochs", "--backend", "--chunk-size"):
        assert flag in text


def test_every_flag_is_spelled_with_hyphens():
    # (an algorithm whose name has an underscore once gave --ffa_lora-frozen)
    flags = [f for action in cli.build_parser()._actions for f in action.option_strings]
    assert "--ffa-lora-frozen" in flags and "--lg-fedavg-head" in flags
    assert [f for f in flags if "_" in f] == []


@pytest.mark.slow
@pytest.mark.figures
def test_a_short_run_writes_every_output_file(tmp_path):
    out = tmp_path / "run"
    code = cli.main(["--algo", "fedavg_ft", "--rounds", "3", "--clients", "8", "--eval-every", "2",
                     "--out", str(out), "--quiet", "--seed", "3"])
    assert code == 0
    for name in ("config.json", "metrics.jsonl", "summary.json", "learning_curve.png",
                 "label_distribution.png", "client_metrics.npz"):
        assert (out / name).exists(), name
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert "acc_mean" in rows[1] and "acc_mean" not in rows[0]          # evaluated at 2 and 3
    assert "global_acc_mean" in rows[2]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["best"]["acc_mean"] == max(rows[1]["acc_mean"], rows[2]["acc_mean"])
    best_round = 2 if rows[1]["acc_mean"] >= rows[2]["acc_mean"] else 3
    assert summary["best_round"]["acc_mean"] == best_round
    # "best" is for accuracies only: a best round time or step count means nothing.
    assert not {"round_time", "client_steps", "train_loss", "acc_std"} & set(summary["best"])
    assert summary["last"]["client_steps"] == rows[2]["client_steps"]
    assert summary["interrupted"] is False and summary["last_completed_round"] == 3
    assert sorted(os.listdir(out / "checkpoints")) == ["round_000003"]    # the end, at least
    assert summary["last"]["acc_mean"] == rows[2]["acc_mean"]
    assert summary["clients_per_round"] == 2 and summary["compile_time_s"] > 0
    config = json.loads((out / "config.json").read_text())
    assert config["hparams"]["ft_epochs"] == 1 and config["partition"]["num_clients"] == 8
    npz = np.load(out / "client_metrics.npz")
    assert npz["sampled"].shape == (3, 2) and npz["accuracy"].shape == (2, 8)


@pytest.mark.slow
def test_divergence_names_round_and_clients(tmp_path):
    cfg = runner.RunConfig(algo="fedavg", rounds=2, progress=False,
                           hparams={"lr": 1e12, "participation": 0.5},
                           partition=runner.PartitionConfig(num_clients=4))
    with pytest.raises(runner.NonFiniteError, match=r"round 1: clients \[.*\] have a non-finite"):
        runner.run(cfg)


def test_a_non_finite_evaluation_stops_the_run_naming_the_round_model_and_clients():
    """An evaluated client whose test loss is NaN or inf makes the run stop (its accuracy would
    be an argmax of NaN outputs); clients without test data, whose loss is no one's, do not."""
    from fedjax_pfl import core
    from fedjax_pfl.runner.records import record_evaluation

    def ev(loss):
        return core.ClientEval(correct=np.array([1.0, 2.0, 0.0]), loss_sum=np.array(loss),
                               count=np.array([3, 3, 0]))

    row = {"round": 4}
    ids = np.array([4, 7, 9])
    history = core.History(10)
    with pytest.raises(runner.NonFiniteError,
                       match=r"round 4: the evaluation of the clients' own models .* clients \[7\]"):
        record_evaluation(dict(row), {"client": ev([1.0, np.nan, 0.0])}, ids, 10, history, ids)
    with pytest.raises(runner.NonFiniteError, match=r"round 4: .* the global model .* \[4\]"):
        record_evaluation(dict(row), {"client": ev([1.0, 2.0, 0.0]), "global": ev([np.inf, 2.0, 0.0])},
                          ids, 10, history, ids)
    fine = dict(row)
    record_evaluation(fine, {"client": ev([1.0, 2.0, np.nan])}, ids, 10, history, ids)
    assert fine["acc_mean"] == pytest.approx(np.mean([1 / 3, 2 / 3]))


@pytest.mark.slow
def test_a_run_whose_evaluation_diverges_exits_1(tmp_path, capsys):
    """Ditto with λ = 1e12: its personal models blow up while the training loss (the global
    model's) stays finite; the run used to print the argmax-of-NaN accuracy and exit 0."""
    with pytest.raises(SystemExit) as exc:
        cli.main(["--algo", "ditto", "--ditto-lam", "1e12", "--rounds", "2", "--quiet",
                  "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 1
    assert err[-1].startswith("run.py: error: round 1: the evaluation of the clients' own models "
                              "gives a non-finite loss")


def test_help_states_each_default_once():
    text = " ".join(cli.build_parser().format_help().split())
    text = text[text.index("show this help message"):]              # the flags, not the usage
    assert "(default: None)" not in text
    for flag, following in [("--lr FLOAT", "--momentum FLOAT"), ("--rounds ROUNDS", "--seed SEED"),
                            ("--seed SEED", "--seeds SEEDS"), ("--out OUT", "--overwrite")]:
        part = text[text.index(flag):text.index(following)]
        assert part.count("default") == 1, part


def _short(out, *more):
    return ["--rounds", "2", "--clients", "4", "--participation", "0.5", "--local-steps", "1",
            "--out", str(out), "--quiet", *more]


@pytest.mark.slow
@pytest.mark.figures          # the figures are run files, rewritten with the rest
def test_out_holding_another_run_is_refused_unless_overwrite(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(_short(out, "--seed", "1")) == 0
    (out / "notes.txt").write_text("mine")                    # not a run file: kept
    (out / "seed_3").mkdir()                                  # a stale --seeds run: removed
    before = (out / "metrics.jsonl").read_text()
    with pytest.raises(SystemExit) as exc:
        cli.main(_short(out, "--seed", "2"))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--out {out} already holds files" in err and "--overwrite" in err
    assert (out / "metrics.jsonl").read_text() == before      # untouched
    assert cli.main(_short(out, "--seed", "2", "--overwrite", "--rounds", "1")) == 0
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1
    assert sorted(os.listdir(out)) == sorted(["config.json", "metrics.jsonl", "summary.json",
                                              "client_metrics.npz", "learning_curve.png",
                                              "label_distribution.png", "client_accuracy.png",
                                              "checkpoints", "notes.txt"])
    assert json.loads((out / "config.json").read_text())["seed"] == 2


@pytest.mark.parametrize("make,message", [
    (lambda p: (p.write_text("x"), p)[1], "is an existing file, not a directory"),
    (lambda p: (p.write_text("x"), p / "sub")[1], "cannot be created"),
])
def test_out_that_cannot_be_a_directory_fails_first(tmp_path, capsys, no_compute, make, message):
    out = make(tmp_path / "f")
    with pytest.raises(SystemExit) as exc:
        cli.main(["--out", str(out), "--quiet"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"run.py: error: --out {out}") and message in err


def test_out_that_is_not_writable_fails_first(tmp_path, capsys, no_compute):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running as root: permissions are not enforced")
        with pytest.raises(SystemExit) as exc:
            cli.main(["--out", str(locked / "run"), "--quiet"])
        assert exc.value.code == 2 and "is not writable" in capsys.readouterr().err
    finally:
        locked.chmod(0o700)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_out_where_no_file_can_be_made_fails_before_the_data_even_as_root(capsys, monkeypatch,
                                                                          no_compute):
    """/proc takes no new files whatever the permission bits say (root's os.access says yes):
    refused before the data load, not by the first write after it."""
    def no_data(*a, **k):
        raise AssertionError("the data were loaded before --out was found unwritable")
    monkeypatch.setattr(runner, "load_data", no_data)
    for out in ("/proc/fedjax_pfl_no_such/run", "/proc/fedjax_pfl_run"):
        with pytest.raises(SystemExit) as exc:
            cli.main(["--out", out, "--quiet"])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(
            f"run.py: error: --out {out} is not writable (no file can be made in /proc: ")
        assert not os.path.exists(out)


@pytest.mark.slow
def test_resume_refuses_incompatible_flags_and_extends_rounds(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(_short(out, "--algo", "pfedsop", "--pfedsop-rho", "2")) == 0
    for flags, named in [(["--pfedsop-rho", "3"], "--pfedsop-rho 2.0"),
                         (["--algo", "fedavg"], "--algo 'pfedsop'"),
                         (["--seed", "5"], "--seed 0"),
                         (["--clients", "6"], "--clients 4")]:
        with pytest.raises(SystemExit) as exc:
            cli.main(_short(out, "--resume", *flags))
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and named in err, (flags, err)
    with pytest.raises(SystemExit):
        cli.main(["--resume", str(tmp_path / "nothing")])
    assert "holds no run to resume" in capsys.readouterr().err
    # The same flags again, or none at all: it continues (here: two more rounds).
    assert cli.main(_short(out, "--algo", "pfedsop", "--pfedsop-rho", "2", "--resume",
                           "--rounds", "3")) == 0
    assert cli.main(["--resume", str(out), "--rounds", "4", "--quiet"]) == 0
    # --conv changes float rounding only, so it may change on resume; a resume without the flag
    # keeps the saved one.
    assert cli.main(["--resume", str(out), "--rounds", "5", "--conv", "im2col", "--quiet"]) == 0
    assert json.loads((out / "config.json").read_text())["model_conv"] == "im2col"
    assert cli.main(["--resume", str(out), "--rounds", "6", "--quiet"]) == 0
    assert json.loads((out / "config.json").read_text())["model_conv"] == "im2col"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert "resuming from" in capsys.readouterr().out


@pytest.mark.slow
def test_header_pluralises_clients(tmp_path, capsys):
    assert cli.main(_short(tmp_path / "run")) == 0
    assert "fedavg on digits: 4 clients (" in capsys.readouterr().out


def test_conv_flag_reaches_the_config_and_is_checked():
    assert cli.config_from_args(cli.parse(["--conv", "im2col"])).model_conv == "im2col"
    assert cli.config_from_args(cli.parse([])).model_conv == "auto"
    with pytest.raises(ValueError, match="^model_conv must be one of") as exc:
        runner.RunConfig(model_conv="fft").validate()
    assert cli.message(exc.value).startswith("--conv must be one of")     # the flag that sets it


def test_preset_naming_its_algorithm_or_with_algo_runs(no_compute, capsys):
    args = cli.parse(["--preset", "pgfed_paper", "--algo", "pgfed"])
    cfg = cli.config_from_args(args)
    assert cfg.algo == "pgfed" and cfg.hparams["mu"] == 0.1 and cfg.rounds == 300
    assert cli.config_from_args(cli.parse([])).algo == "fedavg"        # no preset: the default


def test_the_closing_summary_says_epsilon_delta_and_the_noise():
    """privacy_line of a record as runner.privacy writes it (a target ε, fixed sampling) and of
    an unbounded one (z = 0: ε = inf)."""
    record = {"dp_epsilon": 2.99871, "delta": 0.0370370, "noise_multiplier": 1.68712, "clip": 1.0,
              "accountant": "rdp", "sampling": "fixed", "target_epsilon": 3.0}
    assert cli.privacy_line(record) == (
        "privacy                ε = 2.999 at δ = 0.037 (noise multiplier z = 1.687, clip C = 1, "
        "RDP accountant, fixed sampling, for --target-epsilon 3)")
    unbounded = {**record, "dp_epsilon": None, "noise_multiplier": 0.0, "target_epsilon": None,
                 "sampling": "poisson", "clip": 0.5}
    assert cli.privacy_line(unbounded) == (
        "privacy                ε = unbounded at δ = 0.037 (noise multiplier z = 0, clip C = 0.5, "
        "RDP accountant, poisson sampling)")
