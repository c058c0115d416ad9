"""The command line: one-line errors with exit status 2 before any computation, and a real run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))
import run as cli  # noqa: E402

from fedjax_pfl import runner  # noqa: E402


@pytest.fixture
def no_compute(monkeypatch):
    """Fails the test if the CLI gets as far as running rounds."""
    def forbidden(*a, **k):
        raise AssertionError("runner.run was called: validation should have failed first")
    monkeypatch.setattr(runner, "run", forbidden)


@pytest.mark.parametrize("argv,message", [
    (["--algo", "nope"], "--algo must be one of ['fedavg', "),
    (["--alpha", "0"], "--alpha must be > 0, got 0.0"),
    (["--alpha", "0", "--partition", "iid"], "--alpha must be > 0, got 0.0"),
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
])
def test_bad_input_is_one_line_exit_2(argv, message, capsys, no_compute):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv + ["--quiet"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("run.py: error: ")
    assert message in err


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
    assert summary["last"]["acc_mean"] == rows[2]["acc_mean"]
    assert summary["clients_per_round"] == 2 and summary["compile_time_s"] > 0
    config = json.loads((out / "config.json").read_text())
    assert config["hparams"]["ft_epochs"] == 1 and config["partition"]["num_clients"] == 8
    npz = np.load(out / "client_metrics.npz")
    assert npz["sampled"].shape == (3, 2) and npz["accuracy"].shape == (2, 8)


def test_divergence_names_round_and_clients(tmp_path):
    cfg = runner.RunConfig(algo="fedavg", rounds=2, progress=False,
                           hparams={"lr": 1e12, "participation": 0.5},
                           partition=runner.PartitionConfig(num_clients=4))
    with pytest.raises(runner.NonFiniteError, match=r"round 1: clients \[.*\] have a non-finite"):
        runner.run(cfg)
