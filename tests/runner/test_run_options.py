"""A whole run from a notebook is the command line's run: `RunConfig.from_options` with the
options by name gives the RunConfig that run.py builds from the same flags (the dataset rules
and defaults, the data options, presets, hyperparameters), and the library's defaults are the
flags' defaults."""

import json

import pytest
import run as cli  # noqa: E402  (experiments/run.py)

from fedjax_pfl import runner  # noqa: E402
from fedjax_pfl.errors import OptionError  # noqa: E402
from fedjax_pfl.runner import options  # noqa: E402

CASES = [
    # (run.py flags, the same run from a notebook)
    ([], {}),
    (["--dataset", "femnist", "--data-dir", "/data/leaf/femnist", "--max-clients", "50",
      "--min-samples", "10", "--format", "leaf", "--token-accuracy", "all", "--quantise", "refuse"],
     dict(dataset="femnist", data_dir="/data/leaf/femnist", max_clients=50, min_samples=10,
          format="leaf", token_accuracy="all", quantise="refuse")),
    (["--dataset", "shakespeare", "--data-dir", "/d", "--model-options", "hidden=64,layers=1",
      "--cache-dir", "/c"],
     dict(dataset="shakespeare", data_dir="/d", model_options={"hidden": 64, "layers": 1},
          cache_dir="/c")),
    (["--dataset", "synthetic", "--synthetic-clients", "12", "--synthetic-alpha", "0.5",
      "--algo", "ditto", "--ditto-lam", "0.3"],
     dict(dataset="synthetic", synthetic_clients=12, synthetic_alpha=0.5, algo="ditto", lam=0.3)),
    (["--dataset", "emnist", "--emnist-split", "letters", "--partition", "shards",
      "--shards-per-client", "2", "--clients", "100", "--seed", "7"],
     dict(dataset="emnist", emnist_split="letters", partition="shards", shards_per_client=2,
          clients=100, seed=7)),
    (["--algo", "pgfed", "--pgfed-mu", "0.2", "--lr", "0.01", "--batch-size", "5", "--drop-last",
      "--momentum-buffer", "persist", "--rounds", "30", "--eval-every", "3",
      "--rounds-per-call", "3"],
     dict(algo="pgfed", mu=0.2, lr=0.01, batch_size=5, drop_last=True, momentum_buffer="persist",
          rounds=30, eval_every=3, rounds_per_call=3)),
    (["--algo", "feddyn", "--feddyn-alpha", "0.05", "--alpha", "0.3", "--min-size", "5"],
     dict(algo="feddyn", hparams={"alpha": 0.05}, alpha=0.3, min_size=5)),
    (["--preset", "pgfed_paper", "--algo", "pgfedmo", "--clients", "50"],
     dict(algo="pgfedmo", clients=50, partition="dirichlet", alpha=0.3, min_size=40,
          test_fraction=0.25, rounds=300, participation=0.25, local_epochs=5, batch_size=10,
          drop_last=True, lr=0.005, momentum=0.9, momentum_buffer="persist", mu=0.1,
          alpha_lr=0.01)),
    (["--quiet", "--no-memory-check", "--log", "tensorboard,mlflow", "--checkpoint-on-signal",
      "--checkpoint-every", "4", "--conv", "im2col", "--target-acc", "0.8", "--eval-clients", "5",
      "--state-dtype", "bfloat16", "--data-placement", "host", "--model", "logreg"],
     dict(quiet=True, no_memory_check=True, log=["tensorboard", "mlflow"],
          checkpoint_on_signal="USR1", checkpoint_every=4, conv="im2col", target_acc=0.8,
          eval_clients="5", state_dtype="bfloat16", data_placement="host", model="logreg")),
    (["--dp-clip", "1", "--target-epsilon", "4", "--dp-delta", "0.001", "--sampling", "poisson",
      "--dp-accountant", "pld"],
     dict(dp_clip=1.0, target_epsilon=4.0, dp_delta=0.001, sampling="poisson",
          dp_accountant="pld")),
]


@pytest.mark.parametrize("argv,notebook", CASES, ids=[" ".join(a) or "defaults" for a, _ in CASES])
def test_a_notebook_gets_the_configuration_the_command_line_gets(argv, notebook):
    cli_cfg = cli.config_from_args(cli.parse(argv + ["--out", "runs/x"]))
    lib_cfg = runner.RunConfig.from_options(**notebook, out="runs/x")
    assert lib_cfg == cli_cfg
    assert lib_cfg.validate() == cli_cfg.validate()


def test_the_default_output_folder_is_algo_dataset_time():
    cfg = runner.RunConfig.from_options(algo="ditto", dataset="synthetic")
    assert cfg.out.startswith("runs/ditto_synthetic_") and len(cfg.out) == len(
        "runs/ditto_synthetic_20260101-120000")


def test_the_library_defaults_are_the_flags_defaults():
    parser = cli.build_parser()
    defaults = {a.dest: a.default for a in parser._actions}
    for name, value in options.DEFAULTS.items():
        if name in ("algo", "resume"):         # run.py: None (a preset may name it), DIR or None
            continue
        assert defaults[name] == value and type(defaults[name]) is type(value), name
    assert set(options.DEFAULTS) | set(cli.CLI_ONLY) | {"help"} == {
        d for d in defaults if not d.startswith("hp__")}


@pytest.mark.parametrize("notebook,message", [
    (dict(dataset="femnist", clients=5, data_dir="/d"),
     "dataset femnist keeps its own clients: clients does not apply (use max_clients K)"),
    (dict(max_clients=3), "max_clients applies to natural-client datasets (femnist, "),
    (dict(min_samples=2), "min_samples applies to natural-client datasets"),
    (dict(algo="nope"), "algo must be one of ['apfl', "),
    (dict(alpha=float("inf")), "alpha must be finite, got inf"),
    (dict(model_options="hidden"), "model_options takes KEY=VALUE pairs separated by commas"),
    (dict(algo="fedavg", ft_epochs=2), "ft_epochs does not apply to algo fedavg"),
    (dict(algo="fedavg", hparams={"mu": 0.1}), "mu does not apply to algo fedavg"),
    (dict(rouns=5), "unknown option 'rouns': the options are algo, rounds, "),
    (dict(lr=0.1, hparams={"lr": 0.2}), "lr is given twice, as a keyword and in hparams"),
    (dict(log="nope"), "log: unknown sink 'nope'"),
    (dict(checkpoint_on_signal="NOPE"), "checkpoint_on_signal must name a signal"),
])
def test_bad_options_are_option_errors_naming_the_option(notebook, message):
    with pytest.raises(OptionError) as exc:
        runner.RunConfig.from_options(**notebook)
    assert message in str(exc.value)


@pytest.mark.parametrize("argv,message", [
    (["--dataset", "femnist", "--clients", "5"],
     "--dataset femnist keeps its own clients: --clients does not apply (use --max-clients K)"),
    (["--max-clients", "3"], "--max-clients applies to natural-client datasets"),
    (["--model-options", "hidden"], "--model-options takes KEY=VALUE pairs"),
    (["--checkpoint-on-signal", "NOPE"], "--checkpoint-on-signal must name a signal"),
])
def test_the_command_line_says_the_same_errors_with_its_flags(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv + ["--quiet"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"run.py: error: {message}") and err.count("\n") == 1


def test_a_hyperparameter_flag_is_its_type_as_a_notebook_passes_it():
    cfg = cli.config_from_args(cli.parse(["--algo", "pgfed", "--pgfed-mu", "0.2", "--batch-size",
                                          "5", "--lr", "abc"]))
    assert cfg.hparams == {"mu": 0.2, "batch_size": 5, "lr": "abc"}   # abc: validate says why
    with pytest.raises(ValueError, match="lr must be float, got 'abc'"):
        cfg.validate()


def test_the_options_behind_each_argument_an_error_names():
    assert options.option_name("num_clients", "partition") == "clients"
    assert options.option_name("scheme", "partition") == "partition"
    assert options.option_name("fmt", "data") == "format"
    assert options.option_name("model_conv") == "conv"
    assert options.option_name("rounds") == "rounds"
    assert options.option_name("lr", "hparams") is None           # a hyperparameter: its name
    assert options.option_name("max_tries", "partition") is None  # no option sets it
    spell = cli.spelling("pgfed")
    assert [spell(*a) for a in [("num_clients", "partition"), ("model_conv", ""), ("mu", "hparams"),
                                ("memory_check", ""), ("fmt", "data"), ("overwrite", ""),
                                ("max_tries", "partition")]] == [
        "--clients", "--conv", "--pgfed-mu", "--no-memory-check", "--format", "--overwrite", None]


def test_a_preset_file_is_what_its_settings_are_as_options():
    """Every preset shipped: its settings as options and its hyperparameters by name, per
    algorithm that has them, are the command line's configuration with --preset."""
    from fedjax_pfl import algorithms

    for path in sorted(cli.CONFIG_DIR.glob("*.json")):
        preset = json.loads(path.read_text())
        preset.pop("_doc")
        # (a preset's rows, one per server optimiser: its own server_opt's, else sgd's, as run.py)
        rows = preset.pop("rows", {})
        preset.update(rows.get(preset.get("server_opt", "sgd"), {}))
        algo = preset.pop("algo", "pgfed")
        spec = algorithms.spec(algo)
        flags = {flag: hp.name for hp, flag in spec.all_hparams()}
        settings = {k: v for k, v in preset.items() if k in options.DEFAULTS}
        hparams = {flags["--" + k.replace("_", "-")]: v for k, v in preset.items()
                   if k not in options.DEFAULTS and "--" + k.replace("_", "-") in flags}
        lib = runner.RunConfig.from_options(algo=algo, **settings, hparams=hparams, out="o")
        cfg = cli.config_from_args(cli.parse(["--preset", path.stem, "--algo", algo,
                                              "--out", "o"]))
        assert lib == cfg, path.name


def test_the_rules_per_dataset_without_the_command_line():
    """The defaults and data options per dataset, written out here (not through run.py)."""
    P = runner.PartitionConfig
    cfg = runner.RunConfig.from_options(out="o")
    assert cfg.partition == P(scheme="dirichlet", num_clients=20, alpha=0.5, min_size=10)
    assert cfg.data_options == {"data_dir": None, "tfds_dir": None, "download": False}
    assert (cfg.algo, cfg.dataset, cfg.rounds, cfg.model, cfg.hparams, cfg.log) == (
        "fedavg", "digits", 50, None, {}, ())
    syn = runner.RunConfig.from_options(dataset="synthetic", synthetic_clients=12, seed=4, out="o")
    assert syn.partition == P(scheme="natural", num_clients=12, seed=4)
    assert syn.data_options == {"data_dir": None, "tfds_dir": None, "download": False,
                                "synthetic_alpha": 1.0, "synthetic_beta": 1.0,
                                "synthetic_clients": 12}
    nat = runner.RunConfig.from_options(dataset="shakespeare", data_dir="/d", out="o")
    assert nat.partition.scheme == "natural" and nat.natural
    assert nat.data_options == {"data_dir": "/d", "fmt": None, "max_clients": None,
                                "min_samples": 0, "max_client_samples": None, "cache_dir": None,
                                "token_accuracy": "default", "quantise": "round"}
    assert runner.RunConfig.from_options(dataset="emnist", out="o").data_options[
        "emnist_split"] == "balanced"
    assert runner.RunConfig.from_options(model="char_lstm",
                                         model_options="hidden=64,tanh=true,name=x,r=0.5",
                                         out="o").model_options == {
        "hidden": 64, "tanh": True, "name": "x", "r": 0.5}


@pytest.mark.parametrize("common,own", [
    ("--clients 6 --rounds 2", "--algo pgfed --pgfed-mu 0.2 --rounds 3"),
    ("--preset pgfed_paper --algo pgfed", "--clients 8"),
    ("--preset pgfed_paper --algo pgfed --rounds 5", "--preset pfedsop_paper --algo pfedsop"),
    ("--clients 6", "--preset fedpc_clustered --algo fedavg --lr 0.2"),
    ("--lr 0.1 --quiet", "--lr 0.2 --log tensorboard"),
])
def test_a_runs_flags_on_top_of_common_flags_are_the_joined_command_line(common, own):
    """compare.py parses --common once and each run's flags on top (`parse_on_top`): the same
    configuration as the two joined into one command line (the last --preset counts, explicit
    flags win over any preset)."""
    import shlex

    joined = cli.config_from_args(cli.parse(shlex.split(common) + shlex.split(own)
                                            + ["--out", "o"]))
    on_top = cli.config_from_args(cli.parse_on_top(shlex.split(own) + ["--out", "o"],
                                                   cli.parse(shlex.split(common))))
    assert on_top == joined


def test_an_option_the_run_does_not_use_is_refused_by_the_library_too():
    with pytest.raises(OptionError) as exc:
        runner.RunConfig.from_options(partition="iid", alpha=0.3)
    assert str(exc.value) == "alpha applies to partition dirichlet / dirichlet_client only, not partition iid"
    assert exc.value.arguments[0] == ("alpha", "")
    with pytest.raises(OptionError, match="^dp_noise_multiplier needs dp_clip "):
        runner.RunConfig.from_options(dp_noise_multiplier=1.0)
    with pytest.raises(OptionError, match="^synthetic_clients applies to dataset synthetic only"):
        runner.RunConfig.from_options(synthetic_clients=5)
    # where they apply they are taken
    assert runner.RunConfig.from_options(partition="shards", shards_per_client=2, out="o"
                                         ).partition.shards_per_client == 2
    assert runner.RunConfig.from_options(dp_clip=1.0, dp_noise_multiplier=1.0, out="o"
                                         ).hparams["dp_noise_multiplier"] == 1.0


def test_a_presets_or_a_harmless_option_is_left_out_with_a_warning_and_a_saved_one_kept():
    from fedjax_pfl.errors import OptionWarning

    with pytest.warns(OptionWarning, match="^download applies to dataset mnist / "):
        cfg = runner.RunConfig.from_options(download=True, out="o")
    assert cfg.data_options["download"] is False
    with pytest.warns(OptionWarning, match="the preset's value left out"):
        cfg = runner.RunConfig.from_options(partition="iid", alpha=0.3, preset={("alpha", "")},
                                            out="o")
    assert cfg.partition.alpha == 0.5
    # check_only: a resume checks only what its caller gives; the saved run's fields stay
    cfg = runner.RunConfig.from_options(partition="iid", alpha=0.3, check_only=set(), out="o")
    assert cfg.partition.alpha == 0.3


def test_quantise_is_a_natural_data_option_checked_before_loading():
    cfg = runner.RunConfig.from_options(dataset="femnist", data_dir="/nonexistent", out="o",
                                        quantise="refuse")
    assert cfg.data_options["quantise"] == "refuse"
    bad = runner.RunConfig.from_options(dataset="femnist", data_dir="/nonexistent", out="o",
                                        quantise="floor")
    with pytest.raises(OptionError, match=r"^quantise must be one of \['round', 'refuse'\], got 'floor'$"):
        bad.validate()                                    # no file is read: /nonexistent
    with pytest.raises(OptionError, match=r"^quantise applies to natural-client datasets"):
        runner.RunConfig.from_options(dataset="digits", quantise="round", out="o")
