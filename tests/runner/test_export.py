"""Exported models (issue 57, item 5; fedjax_pfl.export): --export writes OUT/final/ with the
final server and personal models as safetensors files named by the parameter tree's paths and a
model.json; `export.load` reads them back into the model's tree.

Expectations are derived here, not by the code under test: the accuracies are recomputed in
the test from the loaded tensors (each client's test samples through the model, argmax against
the label, the mean per client and over clients, FedAvg on the global model, Ditto and pFedSOP
on row i of the personal models: their evaluation rules, docs/algorithms/*.md) and compared
with what the run itself reported; the tensor names, shapes and dtypes are read from the files'
own safetensors headers (8-byte length, JSON), parsed in the test; the MLP's paths and shapes
(Dense_0: 64 → 100, Dense_1: 100 → 10 on 8×8 digits) are written out by hand."""

import json
import os
import struct

import jax
import numpy as np
import pytest

from fedjax_pfl import __version__, algorithms, export, runner
from fedjax_pfl.errors import OptionError

MLP_SHAPES = {"Dense_0/kernel": (64, 100), "Dense_0/bias": (100,),
              "Dense_1/kernel": (100, 10), "Dense_1/bias": (10,)}
CLIENTS = 6


def _header(path) -> dict:
    """A safetensors file's header: u64 little-endian length, then that many bytes of JSON."""
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    head = json.loads(raw[8:8 + n])
    head.pop("__metadata__", None)
    return head


def _run(tmp_path, algo, **options):
    cfg = runner.RunConfig.from_options(algo=algo, dataset="digits", clients=CLIENTS, rounds=2,
                                        out=str(tmp_path / algo), quiet=True, **options)
    cfg.export, cfg.checkpoint_every = True, 0
    summary = runner.run(cfg, log=lambda *_: None)
    data, _ = runner.load_data(cfg)
    return cfg, summary, data


def _accuracies(model, data, params_of) -> np.ndarray:
    """Each real client's test accuracy with the model params_of(i) (float32, as the engine
    computes: bfloat16 rows upcast)."""
    apply = jax.jit(model.apply)
    out = []
    for i in range(data.num_real_clients):
        s, n = int(data.clients.test_start[i]), int(data.clients.test_count[i])
        rows = np.arange(s, s + n)
        params = jax.tree.map(lambda a: np.asarray(a, np.float32), params_of(i))
        pred = np.argmax(np.asarray(apply(params, data.inputs(rows))), axis=-1)
        out.append(np.mean(pred == np.asarray(data.y)[rows]))
    return np.asarray(out)


@pytest.fixture(scope="module")
def fedavg_run(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("export"), "fedavg")


@pytest.mark.slow
def test_fedavg_export_loads_to_the_run_final_accuracy(fedavg_run):
    cfg, summary, data = fedavg_run
    final = f"{cfg.out}/final"
    model, global_params, personal = export.load(final)
    assert personal is None                                  # FedAvg keeps no personal models
    acc = _accuracies(model, data, lambda i: global_params)
    assert acc.mean() == summary["last"]["acc_mean"]
    # ... and client by client, the run's last evaluation (client_metrics.npz).
    recorded = np.load(f"{cfg.out}/client_metrics.npz")["accuracy"][-1]
    np.testing.assert_array_equal(acc, recorded)


@pytest.mark.slow
def test_fedavg_export_names_shapes_and_json(fedavg_run):
    cfg, _, _ = fedavg_run
    final = f"{cfg.out}/final"
    head = _header(f"{final}/global.safetensors")
    assert {k: tuple(v["shape"]) for k, v in head.items()} == MLP_SHAPES
    assert {v["dtype"] for v in head.values()} == {"F32"}
    assert not os.path.exists(f"{final}/personal.safetensors")
    record = json.load(open(f"{final}/model.json"))
    assert record["algorithm"] == "fedavg" and record["library_version"] == __version__
    assert record["model"]["name"] == "mlp" and record["model"]["input_shape"] == [8, 8, 1]
    assert record["model"]["num_classes"] == 10
    assert record["client_model"] == "global" and record["num_clients"] is None
    assert sorted(record["global_tensors"]) == sorted(MLP_SHAPES)
    assert record["personal_tensors"] == []
    assert record["dtypes"] == {"global.safetensors": ["float32"]}
    assert record["hparams"]["lr"] == json.load(open(f"{cfg.out}/config.json"))["hparams"]["lr"]


@pytest.mark.slow
def test_ditto_exports_both_models_each_by_its_rule(tmp_path):
    cfg, summary, data = _run(tmp_path, "ditto")
    model, global_params, personal = export.load(f"{cfg.out}/final")
    mine = _accuracies(model, data, lambda i: jax.tree.map(lambda a: a[i], personal))
    assert mine.mean() == summary["last"]["acc_mean"]                # "client": v_i
    glob = _accuracies(model, data, lambda i: global_params)
    assert glob.mean() == summary["last"]["global_acc_mean"]         # "global": w
    head = _header(f"{cfg.out}/final/personal.safetensors")
    assert {k: tuple(v["shape"]) for k, v in head.items()} == {
        k: (CLIENTS, *s) for k, s in MLP_SHAPES.items()}


@pytest.mark.slow
def test_pfedsop_host_placement_bfloat16_rows_export_as_bf16(tmp_path):
    """pFedSOP keeps no global model; its rows, under --state-placement host, come from the host
    store, kept in bfloat16: BF16 tensors whose float32 values give the run's accuracy."""
    cfg, summary, data = _run(tmp_path, "pfedsop", state_placement="host",
                              state_dtype="bfloat16")
    final = f"{cfg.out}/final"
    head = _header(f"{final}/personal.safetensors")
    assert {v["dtype"] for v in head.values()} == {"BF16"}
    assert {k: tuple(v["shape"]) for k, v in head.items()} == {
        k: (CLIENTS, *s) for k, s in MLP_SHAPES.items()}
    model, global_params, personal = export.load(final)
    assert global_params is None
    assert {str(a.dtype) for a in jax.tree.leaves(personal)} == {"bfloat16"}
    acc = _accuracies(model, data, lambda i: jax.tree.map(lambda a: a[i], personal))
    assert acc.mean() == summary["last"]["acc_mean"]
    # Some rounds sampled some clients only: the rows differ between clients.
    kernel = np.asarray(personal["Dense_1"]["kernel"], np.float32)
    assert len({kernel[i].tobytes() for i in range(CLIENTS)}) > 1


# -- the format, on a hand-made state (no run) ----------------------------------------------------


def _saved(tmp_path):
    from fedjax_pfl import models
    from fedjax_pfl.algorithms.ditto import State

    spec = export.ModelSpec("mlp", (8, 8, 1), 10)
    model = models.get("mlp", (8, 8, 1), 10)
    key = jax.random.key(3)
    w = model.init(key)
    rows = jax.tree.map(lambda a: np.stack([np.asarray(a) + i for i in range(4)]),
                        model.init(jax.random.key(4)))
    # Ditto's state: global w, four personal rows (the fourth a padding client's), no
    # optimizer states.
    state = State(w, rows, None, None, (), np.zeros((), np.int32))
    directory = tmp_path / "final"
    record = export.save(str(directory), "ditto", state, spec, num_clients=3)
    return directory, record, w, rows


def test_save_names_tensors_by_tree_path_and_cuts_padding_rows(tmp_path):
    directory, record, w, rows = _saved(tmp_path)
    head = _header(directory / "personal.safetensors")
    assert {k: tuple(v["shape"]) for k, v in head.items()} == {
        k: (3, *s) for k, s in MLP_SHAPES.items()}                  # 4 rows, 3 real clients
    assert record["num_clients"] == 3 and record["client_model"] == "personal"
    _, g, p = export.load(str(directory))
    np.testing.assert_array_equal(g["Dense_0"]["kernel"], np.asarray(w["Dense_0"]["kernel"]))
    np.testing.assert_array_equal(p["Dense_1"]["bias"], np.asarray(rows["Dense_1"]["bias"])[:3])


def test_a_missing_or_corrupt_file_is_one_error_naming_it(tmp_path):
    directory, _, _, _ = _saved(tmp_path)
    personal = directory / "personal.safetensors"
    data = personal.read_bytes()
    personal.unlink()
    with pytest.raises(export.ExportError, match=r"personal\.safetensors: missing") as e:
        export.load(str(directory))
    assert "\n" not in str(e.value)
    personal.write_bytes(data[:len(data) // 2])                     # truncated
    with pytest.raises(export.ExportError, match=r"personal\.safetensors: not a readable") as e:
        export.load(str(directory))
    assert "\n" not in str(e.value)
    (directory / "model.json").write_text("{not json")
    with pytest.raises(export.ExportError, match=r"model\.json: not readable JSON"):
        export.load(str(directory))
    (directory / "model.json").unlink()
    with pytest.raises(export.ExportError, match=r"model\.json: missing"):
        export.load(str(directory))


def test_a_tensor_of_the_wrong_shape_is_refused_naming_it(tmp_path):
    from safetensors.numpy import save_file

    directory, _, _, _ = _saved(tmp_path)
    save_file({k: np.zeros(s, np.float32) for k, s in
               {**MLP_SHAPES, "Dense_1/bias": (11,)}.items()}, str(directory / "global.safetensors"))
    with pytest.raises(export.ExportError, match=r"global\.safetensors: tensor Dense_1/bias has "
                                                 r"shape \(11,\), the model's is \(10,\)"):
        export.load(str(directory))


def test_every_registered_algorithm_declares_its_export():
    assert set(algorithms.names()) == set(export.RULES)


def test_export_without_out_is_refused_in_one_line():
    with pytest.raises(OptionError, match=r"needs .*out") as e:
        runner.RunConfig(export=True, out=None).validate()
    assert "\n" not in str(e.value)


def test_run_py_export_without_out_is_refused_in_one_line(capsys, monkeypatch):
    import run as cli  # experiments/run.py

    def forbidden(*a, **k):
        raise AssertionError("the CLI went past validation")
    monkeypatch.setattr(runner, "load_data", forbidden)
    with pytest.raises(SystemExit) as exc:
        cli.main(["--export", "--quiet"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err == "run.py: error: --export writes OUT/final/: it needs --out DIR\n", err


@pytest.mark.slow
def test_a_finished_run_resumed_with_export_writes_its_final_models(tmp_path):
    """The documented way to export a run that did not (a multi-process one): resume its last
    checkpoint with export on; the rounds are done, so nothing trains, and the export's
    accuracy is the run's."""
    cfg = runner.RunConfig.from_options(algo="fedavg", dataset="digits", clients=CLIENTS,
                                        rounds=2, out=str(tmp_path / "run"), quiet=True)
    summary = runner.run(cfg, log=lambda *_: None)
    assert not os.path.exists(f"{cfg.out}/final")
    again = runner.resume_config(cfg.out)
    again.export = True                    # (a resume may turn it on: RESUMABLE_CHANGES)
    runner.run(again, log=lambda *_: None)
    data, _ = runner.load_data(cfg)
    model, global_params, _ = export.load(f"{cfg.out}/final")
    assert _accuracies(model, data, lambda i: global_params).mean() == summary["last"]["acc_mean"]


def test_a_multi_process_run_refuses_export_in_one_line(monkeypatch, tmp_path):
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(OptionError, match="multi-process run") as e:
        runner.RunConfig(export=True, out=str(tmp_path)).validate()
    assert "\n" not in str(e.value)


def test_a_fresh_start_removes_an_earlier_runs_exported_models(tmp_path):
    """OUT/final/ is a run file: a new run in the same --out (with --overwrite) never leaves
    another run's models beside its own results; files of the user's stay."""
    from fedjax_pfl.runner import rundir

    (tmp_path / export.FINAL_DIR).mkdir()
    (tmp_path / export.FINAL_DIR / "global.safetensors").write_bytes(b"another run's")
    (tmp_path / "notes.txt").write_text("mine")
    rundir.clear_out(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
