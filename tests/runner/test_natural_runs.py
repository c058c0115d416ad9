"""End to end on natural-client files written in their real layouts (tests/support/natural_files.py):
each task trains with FedAvg and with a personalised algorithm (its loss falls), the clients keep
their ids and their own held-out data, and every registered algorithm runs on a per-token and on
a multi-label task."""

import json
import os
import subprocess
import sys
from pathlib import Path

import natural_files as nf
import numpy as np
import pytest

from fedjax_pfl import runner

jax_get = __import__("jax").device_get
from fedjax_pfl.data.build import PartitionConfig

ROOT = Path(__file__).resolve().parents[2]
# experiments/run.py drawing no figures (tests/support/run_no_figures.py): no test here reads them.
NO_FIGURES = str(ROOT / "tests" / "support" / "run_no_figures.py")
# The command line's subprocesses import this checkout's fedjax_pfl whatever is installed.
_ENV = {**os.environ, "PYTHONPATH": str(ROOT)}

# dataset -> (writer, file format, small model options, learning rate, rounds)
# FEMNIST's CNN is the one task whose rounds, not its compile, are its cost (~1.5 s of CPU a round
# at the suite's -O0, tests/conftest.py): 4 rounds, in which both losses already fall by a wide
# margin (FedAvg: train 3.85 -> 2.75, evaluated 4.02 -> 1.50; FedPer: 3.85 -> 1.73, 4.02 -> 0.77).
TASKS = {
    "femnist": (nf.leaf_femnist, "leaf", {}, 0.1, 4),
    "shakespeare_leaf": (nf.leaf_shakespeare, "leaf", {"hidden": 32, "layers": 1}, 1.0, 6),
    "sent140": (nf.leaf_sent140, "leaf", {"embed": 16, "hidden": 16, "layers": 1, "fc": 16}, 0.5, 6),
    "shakespeare_tff": (nf.tff_shakespeare, "tff", {"hidden": 32, "layers": 1}, 1.0, 6),
    "stackoverflow_nwp": (nf.tff_stackoverflow, "tff", {"embed": 16, "hidden": 32}, 1.0, 6),
    "stackoverflow_tp": (nf.tff_stackoverflow, "tff", {}, 0.5, 6),
}


def _files(tmp_path_factory, key):
    writer = TASKS[key][0]
    root = tmp_path_factory.mktemp(key)
    ids = writer(root)
    return root, sorted(ids)


def _config(key, root, algo, out=None, rounds=None, **hparams):
    _, fmt, options, lr, default_rounds = TASKS[key]
    dataset = key.rsplit("_", 1)[0] if key.startswith("shakespeare") else key
    return runner.RunConfig(
        algo=algo, dataset=dataset, model_options=dict(options), rounds=rounds or default_rounds,
        partition=PartitionConfig(scheme="natural"), out=out, progress=False,
        hparams={"lr": lr, "batch_size": 4, "local_epochs": 1, "participation": 1.0, **hparams},
        data_options={"data_dir": str(root), "fmt": fmt, "max_clients": None, "min_samples": 0,
                      "cache_dir": None})


def _losses(out):
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    train = [r["train_loss"] for r in rows]
    evaluated = [r["loss"] for r in rows if "loss" in r]
    return train, evaluated


# FedAvg on every task; FedPer (a split model: its head kept per client) on the LSTM of LEAF's
# Shakespeare, every task with `--extended`.
@pytest.mark.slow     # (the full suite: the readers and tasks have their own quick tests)
@pytest.mark.parametrize("key, algo", [
    pytest.param(key, algo, id=f"{key}-{algo}",
                 marks=pytest.mark.extended if algo == "fedper" and key != "shakespeare_leaf" else ())
    for algo in ("fedavg", "fedper") for key in TASKS])
def test_each_task_trains_and_keeps_its_clients(tmp_path_factory, key, algo):
    root, ids = _files(tmp_path_factory, key)
    out = tmp_path_factory.mktemp("run")
    summary = runner.run(_config(key, root, algo, out=str(out)), log=lambda *_: None)
    train, evaluated = _losses(out)
    assert np.isfinite(train).all() and np.isfinite(evaluated).all()
    assert train[-1] < train[0] and evaluated[-1] < evaluated[0], (train, evaluated)
    metrics = np.load(out / "client_metrics.npz")
    assert list(metrics["client_ids"]) == ids              # natural ids, by row
    assert metrics["accuracy"].shape == (summary["rounds"], len(ids))
    record = json.loads((out / "config.json").read_text())
    assert "client_ids" not in record["data"] and record["data"]["num_clients"] == len(ids)


def test_a_subset_of_clients_with_enough_samples(tmp_path_factory):
    """--max-clients K --min-samples S: K of the clients with ≥ S training samples (LEAF's
    sampling); the ids recorded are those clients'."""
    root, ids = _files(tmp_path_factory, "femnist")
    cfg = _config("femnist", root, "fedavg", rounds=1)
    cfg.data_options.update(max_clients=2, min_samples=1)
    data, info = runner.load_data(cfg)
    assert data.num_clients == 2 and set(info["client_ids"]) <= set(ids)
    assert list(info["client_ids"]) == sorted(info["client_ids"])
    cfg.data_options.update(max_clients=None, min_samples=10_000)
    with pytest.raises(ValueError, match="^min_samples 10000: no client has that many"):
        runner.load_data(cfg)


def test_each_client_keeps_its_first_training_samples_up_to_the_cap(tmp_path_factory):
    """--max-client-samples K (Reddi et al.'s Stack Overflow: at most 1,000 a client, TFF's
    `max_elements_per_user`): each client's first K training samples in the files' order, read
    back here from the LEAF JSON the test wrote; its test split whole."""
    root, ids = _files(tmp_path_factory, "femnist")
    cfg = _config("femnist", root, "fedavg", rounds=1)
    cfg.data_options.update(max_client_samples=5)
    data, info = runner.load_data(cfg)
    by_user = {}
    for split in ("train", "test"):
        for f in sorted((root / split).glob("*.json")):
            for u, d in json.loads(f.read_text())["user_data"].items():
                by_user.setdefault(u, {})[split] = d["y"]
    clients = jax_get(data.clients)
    y = np.asarray(data.y)
    for k, u in enumerate(info["client_ids"]):
        start, count = int(clients.train_start[k]), int(clients.train_count[k])
        assert count == 5 and y[start:start + 5].tolist() == by_user[u]["train"][:5]
        assert int(clients.test_count[k]) == len(by_user[u]["test"])
        t = int(clients.test_start[k])
        assert y[t:t + len(by_user[u]["test"])].tolist() == by_user[u]["test"]
    assert info["train_size"]["max"] == 5
    cfg.data_options.update(max_client_samples=0)
    with pytest.raises(ValueError, match="max_client_samples must be an integer >= 1"):
        cfg.validate()


@pytest.mark.slow
def test_the_command_line_runs_a_natural_dataset_with_its_published_model(tmp_path_factory):
    """`--dataset sent140 --data-dir DIR` alone picks the format and the dataset's model."""
    root, _ = _files(tmp_path_factory, "sent140")
    out = tmp_path_factory.mktemp("cli")
    p = subprocess.run([sys.executable, NO_FIGURES, "--dataset",
                        "sent140", "--data-dir", str(root), "--rounds", "1", "--out", str(out),
                        "--overwrite", "--quiet", "--model-options", "embed=8,hidden=8,fc=8"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300, env=_ENV)
    assert p.returncode == 0, p.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"] == "sent_lstm" and summary["clients"] == 4
    bad = subprocess.run([sys.executable, NO_FIGURES, "--dataset",
                          "sent140", "--data-dir", str(out / "nothing"), "--rounds", "1"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120, env=_ENV)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr


@pytest.mark.slow
def test_token_accuracy_rule_chooses_the_scored_targets(tmp_path_factory):
    """--token-accuracy: the evaluated count of every client is its real targets minus the
    excluded specials, counted here from the cache's arrays with the vocabulary's names."""
    from fedjax_pfl.data import cache, formats

    root, _ = _files(tmp_path_factory, "shakespeare_tff")
    cfg = _config("shakespeare_tff", root, "fedavg", rounds=1)
    nc = cache.load(formats.open_reader("shakespeare", str(root), "tff"),
                    str(root / ".fedjax_pfl_cache"), log=lambda *_: None)
    eos, oov = nc.source.vocab.index("<eos>"), nc.source.vocab.index("<oov>")
    y = np.asarray(nc.test_y)
    assert (y == oov).any() and (y == eos).any()           # the fixture has both kinds
    for rule, excluded in (("default", {eos}), ("all", set()), ("no_oov", {eos, oov})):
        cfg.data_options["token_accuracy"] = rule
        data, info = runner.load_data(cfg)
        assert set(data.task.metric_excluded) == excluded
        prep = runner.prepare(cfg, data, info)
        state = prep.program.init(prep.root)
        count = np.asarray(prep.program.evaluate(state)["client"].count)
        want = [int(((b != 0) & ~np.isin(b, list(excluded))).sum())
                for b in np.split(y, nc.test_offsets[1:-1])]
        np.testing.assert_array_equal(count, want)
    cfg.data_options["token_accuracy"] = "sometimes"
    with pytest.raises(ValueError, match="^token_accuracy must be one of"):
        runner.load_data(cfg)


def test_every_reader_dataset_is_reachable_by_name():
    """formats.NATURAL_DATASETS lists, for each dataset, exactly the formats whose reader module
    reads it (a dataset a reader supports but the table omits cannot be chosen)."""
    from fedjax_pfl.data import fedjax_sqlite, formats, jsonl, leaf, tff

    readers = {"leaf": set(leaf.LEAF_DATASETS), "tff": set(tff.DATASETS),
               "fedjax": set(fedjax_sqlite.DATASETS), "jsonl": set(jsonl.DATASETS)}
    for name, fmts in formats.NATURAL_DATASETS.items():
        assert set(fmts) == {f for f, names in readers.items() if name in names}, name
    assert set().union(*readers.values()) == set(formats.NATURAL_DATASETS)
