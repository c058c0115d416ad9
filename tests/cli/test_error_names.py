"""The library's errors name its own arguments (a notebook user reads "rounds must be >= 1, got
0"); the command lines say the same errors with their flags ("run.py: error: --rounds must be >= 1,
got 0"): one message, two spellings (fedjax_pfl.errors)."""

import ast
import inspect
import math
import pathlib

import pytest
import run as cli  # noqa: E402  (experiments/run.py)

from fedjax_pfl import runner  # noqa: E402
from fedjax_pfl.errors import OptionError  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _digits_with(**options):
    return runner.load_data(runner.RunConfig.from_options(**options))


CASES = [
    # (the library call, what it says, the same input on the command line, what run.py says)
    (lambda: runner.RunConfig(rounds=0).validate(), "rounds must be >= 1, got 0",
     ["--rounds", "0"], "--rounds must be >= 1, got 0"),
    (lambda: runner.RunConfig(eval_every=3, rounds_per_call=2).validate(),
     "eval_every 3 must be a multiple of rounds_per_call 2",
     ["--eval-every", "3", "--rounds-per-call", "2"],
     "--eval-every 3 must be a multiple of --rounds-per-call 2"),
    (lambda: runner.RunConfig(model_conv="fft").validate(), "model_conv must be one of",
     None, None),
    (lambda: runner.RunConfig(hparams={"lr": math.inf}).validate(), "lr must be finite, got inf",
     ["--lr", "inf"], "--lr must be finite, got inf"),
    (lambda: runner.RunConfig(algo="pgfed", hparams={"mu": math.inf}).validate(),
     "mu must be finite, got inf", ["--algo", "pgfed", "--pgfed-mu", "inf"],
     "--pgfed-mu must be finite, got inf"),
    (lambda: runner.PartitionConfig(num_clients=0).validate(), "num_clients must be >= 1, got 0",
     ["--clients", "0"], "--clients must be >= 1, got 0"),
    (lambda: runner.PartitionConfig(scheme="shards").validate(),
     "scheme shards needs exactly one of shards_per_client or shard_size",
     ["--partition", "shards"],
     "--partition shards needs exactly one of --shards-per-client or --shard-size"),
    (lambda: _digits_with(clients=5000), "num_clients 5000 is more than the 1797 samples of digits",
     ["--clients", "5000"], "--clients 5000 is more than the 1797 samples of digits"),
    (lambda: _digits_with(clients=200, min_size=10),
     "min_size 10 × num_clients 200 exceeds the 1797 samples: use at most num_clients 179",
     ["--clients", "200", "--min-size", "10"],
     "--min-size 10 × --clients 200 exceeds the 1797 samples: use at most --clients 179"),
    (lambda: runner.prepare(runner.RunConfig(target_epsilon=4.0)),
     "target_epsilon needs dp_clip (client-level DP of the uplink)",
     ["--target-epsilon", "4"], "--target-epsilon needs --dp-clip (client-level DP of the uplink)"),
    (lambda: runner.RunConfig.from_options(dataset="femnist", data_dir="/d", partition="iid")
     .validate(),
     "dataset femnist keeps its own clients: scheme iid does not apply (use max_clients / "
     "min_samples)", ["--dataset", "femnist", "--data-dir", "/d", "--partition", "iid"],
     "--dataset femnist keeps its own clients: --partition iid does not apply (use --max-clients "
     "/ --min-samples)"),
    (lambda: runner.RunConfig(log=("csv",)).validate(), "log: unknown sink 'csv'",
     ["--log", "csv"], "--log: unknown sink 'csv'"),
    (lambda: runner.RunConfig(checkpoint_on_signal="NOPE").validate(),
     "checkpoint_on_signal must name a signal", ["--checkpoint-on-signal", "NOPE"],
     "--checkpoint-on-signal must name a signal"),
]


@pytest.mark.parametrize("call,said,argv,flagged", CASES, ids=[c[1][:40] for c in CASES])
def test_a_library_error_names_the_argument_and_run_py_its_flag(call, said, argv, flagged, capsys,
                                                                 tmp_path, monkeypatch):
    with pytest.raises(OptionError) as exc:
        call()
    assert str(exc.value).startswith(said), str(exc.value)
    if argv is None:
        return
    monkeypatch.setattr(runner, "run", lambda *a, **k: pytest.fail("validation let it through"))
    with pytest.raises(SystemExit) as stop:
        cli.main(argv + ["--quiet", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1
    assert err.startswith(f"run.py: error: {flagged}"), err


def test_an_output_folder_error_names_out_and_resume(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(OptionError, match=f"^out {afile} is an existing file"):
        runner.check_out(str(afile))
    with pytest.raises(OptionError, match=f"^resume: {tmp_path} holds no run to resume"):
        runner.check_out(str(tmp_path), resume=True)
    with pytest.raises(SystemExit):
        cli.main(["--out", str(afile), "--quiet"])
    assert capsys.readouterr().err.startswith(f"run.py: error: --out {afile} is an existing file")


# The modules whose errors name the library's arguments (fedjax_pfl/core and fedjax_pfl/algorithms
# are converted separately).
CONVERTED = ["fedjax_pfl/runner", "fedjax_pfl/data", "fedjax_pfl/sinks", "fedjax_pfl/interrupts.py",
             "fedjax_pfl/sweep", "fedjax_pfl/__init__.py", "fedjax_pfl/errors.py"]
LEFT: set = set()


def _raised_texts(path: pathlib.Path):
    """Every string constant inside a `raise` statement of the module (f-string parts too)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and node.exc is not None:
            for sub in ast.walk(node.exc):
                if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                    yield sub.value


def test_no_converted_module_raises_a_message_that_names_a_flag():
    import re

    flag = re.compile(r"(?<![\w-])--[a-z]")
    found = []
    for entry in CONVERTED:
        paths = [ROOT / entry] if entry.endswith(".py") else sorted((ROOT / entry).rglob("*.py"))
        for path in paths:
            rel = str(path.relative_to(ROOT))
            found += [(rel, text) for text in _raised_texts(path) if flag.search(text)
                      and (rel, text) not in LEFT]
    assert not found, found


def test_spelling_covers_every_option_and_hyperparameter():
    """Every option of RunConfig.from_options and every hyperparameter of every algorithm has a
    flag in run.py's spelling: no library name is ever printed bare by the command line."""
    from fedjax_pfl import algorithms
    from fedjax_pfl.runner import options

    spell = cli.spelling("fedavg")
    assert all(spell(name, "") for name in options.DEFAULTS)
    assert spell("model_conv", "") == "--conv" and spell("progress", "") == "--quiet"
    for algo in algorithms.names():
        spell = cli.spelling(algo)
        for hp, flag in algorithms.spec(algo).all_hparams():
            assert spell(hp.name, "hparams") == flag
    assert inspect.signature(cli.spelling).parameters["algo"].default is None
