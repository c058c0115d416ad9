"""The published setups as presets (experiments/configs/*.json, docs/presets.md): each parses and
names only flags that exist, its settings reach the run's configuration with explicit flags
winning, Reddi et al.'s rows are picked by --server-opt, a preset whose dataset's files are
missing stops in one line, and the docs page lists every preset.

Expected values are the sources' own numbers, written here as the sources give them (the
base-10 logarithms of google-research/federated's optimization/docs/hyperparameters.md), not
read back from the JSON."""

import json
import re
from pathlib import Path

import pytest
import run as cli  # noqa: E402  (experiments/run.py)

from fedjax_pfl import algorithms

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "experiments" / "configs"
PRESETS = sorted(p.stem for p in CONFIGS.glob("*.json"))
REDDI = [p for p in PRESETS if p.startswith("reddi2021_")]

# google-research/federated optimization/docs/hyperparameters.md, "Best hyperparameters", in
# log10: (client lr, server lr, tau) per server optimiser; tau only for the adaptive ones.
PUBLISHED = {
    "reddi2021_cifar100": {"adagrad": (-1, -1, -2), "adam": (-1.5, 0, -1), "yogi": (-1.5, 0, -1),
                           "momentum": (-1.5, 0, None), "sgd": (-1, 0.5, None)},
    "reddi2021_emnist": {"adagrad": (-1.5, -1, -2), "adam": (-1.5, -2.5, -4),
                         "yogi": (-1.5, -2.5, -4), "momentum": (-1.5, -0.5, None),
                         "sgd": (-1, 0, None)},
    "reddi2021_shakespeare": {"adagrad": (0, -0.5, -1), "adam": (0, -2, -3), "yogi": (0, -2, -3),
                              "momentum": (0, -0.5, None), "sgd": (0, 0, None)},
    "reddi2021_stackoverflow_nwp": {"adagrad": (-0.5, -1.5, -4), "adam": (-0.5, -2, -5),
                                    "yogi": (-0.5, -2, -5), "momentum": (-0.5, 0, None),
                                    "sgd": (-0.5, 0, None)},
    "reddi2021_stackoverflow_tp": {"adagrad": (2, 1, -2), "adam": (2, -0.5, -5),
                                   "yogi": (2, -0.5, -5), "momentum": (2, 0, None),
                                   "sgd": (2, 0, None)},
}
# Clients a round M and the natural client count N of each Reddi task (TFF's training splits),
# and the batch size: the hyperparameters.md "Default values" table.
CLIENTS = {"reddi2021_cifar100": (10, 500, 20), "reddi2021_emnist": (10, 3400, 20),
           "reddi2021_shakespeare": (10, 715, 4), "reddi2021_stackoverflow_nwp": (50, 342477, 16),
           "reddi2021_stackoverflow_tp": (10, 342477, 100)}


def _config(argv):
    return cli.config_from_args(cli.parse(argv))


def _close(a, b):
    return abs(a - b) <= 1e-5 * abs(b)


def test_the_issues_presets_exist():
    assert set(PUBLISHED) | {"pfllib_fmnist_dir01", "pfllib_fmnist_pat",
                             "pflbench_femnist"} <= set(PRESETS)


@pytest.mark.parametrize("name", PRESETS)
def test_each_preset_parses_and_names_only_flags_that_exist(name):
    """Every key (and every row's key) is the dest of a flag of run.py, or of a hyperparameter
    flag (`hp__…`); the flags listed here from the parser, not from the preset loader."""
    preset = json.loads((CONFIGS / f"{name}.json").read_text(encoding="utf-8"))
    dests = {a.dest for a in cli.build_parser()._actions}
    keys = [k for k in preset if k not in ("_doc", "rows", "algos")]
    for row in [*preset.get("rows", {}).values(), *preset.get("algos", {}).values()]:
        keys += [k for k in row if k != "_doc"]
    assert set(preset.get("algos", {})) <= set(algorithms.names()), f"{name}: an algos key names no --algo"
    unknown = [k for k in keys if k not in dests and "hp__" + k not in dests]
    assert not unknown, f"{name}: no flag for {unknown}"
    assert isinstance(preset.get("_doc"), str) and preset["_doc"]     # its source, said
    _config(["--preset", name, "--algo", "fedavg"])                 # and it loads


@pytest.mark.parametrize("name", REDDI)
@pytest.mark.parametrize("opt", ["sgd", "momentum", "adagrad", "adam", "yogi"])
def test_the_row_picked_by_server_opt_has_the_published_rates(name, opt):
    argv = ["--preset", name] + ([] if opt == "sgd" else ["--server-opt", opt])
    cfg = _config(argv)                       # (the preset names fedavg: no --algo needed)
    assert cfg.algo == "fedavg"
    client, server, tau = PUBLISHED[name][opt]
    hp = cfg.hparams
    assert _close(hp["lr"], 10.0 ** client) and _close(hp["server_opt_lr"], 10.0 ** server)
    if tau is not None:
        assert _close(hp["server_opt_eps"], 10.0 ** tau)
    # Keras' Adagrad (the repository's FedAdagrad) keeps no first moment; Keras' Adam and the
    # repository's Yogi use beta1 0.9, beta2 0.999 (hyperparameters.md: left at Keras' defaults)
    expected = {"adagrad": {"server_opt_b1": 0.0},
                "adam": {"server_opt_b1": 0.9, "server_opt_b2": 0.999},
                "yogi": {"server_opt_b1": 0.9, "server_opt_b2": 0.999},
                "momentum": {"server_opt_momentum": 0.9}, "sgd": {}}[opt]
    assert {k: hp[k] for k in expected} == expected
    assert hp.get("server_opt", "sgd") == opt


@pytest.mark.parametrize("name", REDDI)
def test_reddi_presets_sample_the_published_clients_a_round(name):
    """M = floor(N * participation) (the engine's rule) is the table's clients a round, on the
    task's natural client count; B and E = 1 as published."""
    m, n, b = CLIENTS[name]
    hp = _config(["--preset", name]).hparams
    assert int(n * hp["participation"]) == m
    assert hp["batch_size"] == b and hp["local_epochs"] == 1


def test_explicit_flags_win_over_the_preset_and_its_row():
    cfg = _config(["--preset", "reddi2021_emnist", "--server-opt", "adam", "--server-lr", "0.5",
                   "--lr", "0.2", "--batch-size", "7", "--rounds", "3"])
    assert cfg.hparams["server_opt_lr"] == 0.5 and cfg.hparams["lr"] == 0.2      # the flags
    assert cfg.hparams["batch_size"] == 7 and cfg.rounds == 3
    assert _close(cfg.hparams["server_opt_eps"], 1e-4)             # the row's, not overridden
    # a flag before --preset wins as well (argparse: the preset's values are only defaults)
    cfg = _config(["--lr", "0.3", "--preset", "pfllib_fmnist_dir01", "--algo", "fedprox"])
    assert cfg.hparams["lr"] == 0.3 and cfg.partition.alpha == 0.1
    # --algo wins over the preset's fedavg
    assert _config(["--preset", "reddi2021_emnist", "--algo", "fedprox"]).algo == "fedprox"


def test_a_row_the_preset_does_not_have_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.parse(["--preset", "reddi2021_emnist", "--server-opt", "nesterov"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err == ("run.py: error: preset reddi2021_emnist has no row for --server-opt nesterov: "
                   "its rows are ['adagrad', 'adam', 'momentum', 'sgd', 'yogi']\n")


def test_rows_of_another_shape_are_refused(tmp_path, monkeypatch, capsys):
    (tmp_path / "bad.json").write_text(json.dumps({"rows": {"sgd": 0.1}}))
    monkeypatch.setattr(cli, "CONFIG_DIR", tmp_path)
    with pytest.raises(SystemExit):
        cli.parse(["--preset", "bad"])
    assert "\"rows\" must map each --server-opt" in capsys.readouterr().err


def test_pfllib_presets_are_pfllibs_protocol():
    """PFLlib: 20 clients, all sampled, 75/25 per client, B = 10, E = 1, lr 0.005; Dir(0.1) with
    PFLlib's least_samples = B / (1 - 0.75) = 40, or 2 classes a client; its FedAvgCNN."""
    for name, scheme in (("pfllib_fmnist_dir01", "dirichlet"), ("pfllib_fmnist_pat",
                                                                "pathological")):
        cfg = _config(["--preset", name, "--algo", "ditto"])
        assert (cfg.dataset, cfg.model, cfg.partition.scheme) == ("fashion_mnist", "cnn", scheme)
        assert cfg.partition.num_clients == 20 and cfg.partition.test_fraction == 0.25
        hp = cfg.hparams
        assert (hp["participation"], hp["batch_size"], hp["local_epochs"], hp["lr"]) == (
            1.0, 10, 1, 0.005)
    assert _config(["--preset", "pfllib_fmnist_dir01", "--algo", "fedavg"]).partition.min_size \
        == 10 / (1 - 0.75)
    assert _config(["--preset", "pfllib_fmnist_pat", "--algo", "fedavg"]
                   ).partition.classes_per_client == 2


def test_pfllib_presets_give_fedrep_pfllibs_head_and_body_epochs():
    """PFLlib's FedRep: 1 head epoch (plocal_epochs), then 1 body epoch: our --local-epochs 2
    with --fedrep-head-epochs 1 (the head epochs are part of the local ones); the other
    algorithms keep E = 1, and a flag given wins."""
    for name in ("pfllib_fmnist_dir01", "pfllib_fmnist_pat"):
        hp = _config(["--preset", name, "--algo", "fedrep"]).hparams
        assert (hp["local_epochs"], hp["head_epochs"]) == (2, 1)
        assert _config(["--preset", name, "--algo", "fedper"]).hparams["local_epochs"] == 1
        hp = _config(["--preset", name, "--algo", "fedrep", "--local-epochs", "3"]).hparams
        assert (hp["local_epochs"], hp["head_epochs"]) == (3, 1)


def test_pflbench_preset_and_its_algorithm_settings():
    """FEMNIST-s02: 200 writers, 20 % a round, B = 32; Ditto's lambda applies to ditto only."""
    cfg = _config(["--preset", "pflbench_femnist", "--algo", "ditto"])
    assert cfg.dataset == "femnist" and cfg.data_options["max_clients"] == 200
    assert int(200 * cfg.hparams["participation"]) == 40 and cfg.hparams["batch_size"] == 32
    assert cfg.hparams["lam"] == 0.2 and cfg.hparams["local_epochs"] == 3
    assert "lam" not in _config(["--preset", "pflbench_femnist", "--algo", "fedavg"]).hparams


def test_the_preset_settings_are_recorded_in_config_json(tmp_path):
    """config.json's record (runner.config.config_record, what the run writes) holds the row's
    settings and the flags that won."""
    from fedjax_pfl.runner import config as config_lib

    cfg = _config(["--preset", "reddi2021_cifar100", "--server-opt", "yogi", "--rounds", "2",
                   "--data-dir", str(tmp_path)])
    record = config_lib.config_record(cfg, cfg.validate(), "resnet18", {})
    assert record["rounds"] == 2 and record["dataset"] == "cifar100_fl"
    hp = record["hparams"]
    assert hp["server_opt"] == "yogi" and _close(hp["server_opt_eps"], 0.1)
    assert _close(hp["lr"], 10 ** -1.5) and hp["server_opt_lr"] == 1.0


@pytest.mark.parametrize("argv,files", [
    (["--preset", "reddi2021_emnist"], "fed_emnist_train.h5, fed_emnist_test.h5 not found"),
    (["--preset", "reddi2021_cifar100"], "fed_cifar100_train.h5, fed_cifar100_test.h5 not found"),
    (["--preset", "pflbench_femnist", "--algo", "ditto"], "no train and test JSON shards found"),
])
def test_a_preset_on_missing_files_stops_in_one_line(argv, files, tmp_path, capsys):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        cli.main([*argv, "--data-dir", str(tmp_path), "--out", str(out)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("run.py: error: --dataset ") and files in err
    assert not out.exists()


def test_the_docs_page_lists_every_preset():
    """docs/presets.md has a section (`## name`) for each experiments/configs/*.json, no more."""
    text = (ROOT / "docs" / "presets.md").read_text(encoding="utf-8")
    listed = sorted(re.findall(r"^## `([a-z0-9_]+)`", text, flags=re.M))
    assert listed == PRESETS
    assert "presets" in (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
