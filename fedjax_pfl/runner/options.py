"""A whole run's configuration from its options, by the rules the command line applies.

    from fedjax_pfl.runner import RunConfig
    cfg = RunConfig.from_options(algo="pgfed", dataset="cifar10", clients=50, rounds=100,
                                 lr=0.01, mu=0.1, out="runs/pgfed50")
    cfg = RunConfig.from_options(dataset="femnist", data_dir="~/leaf/femnist", max_clients=100)
    cfg = runner.resume_config("runs/pgfed50", rounds=200)          # continue it to round 200

`python experiments/run.py --FLAG VALUE …` builds its configuration with this same call, so a
notebook gets what the command line gets:

* Each option is a run.py flag's name with `_` for `-` (`--min-size` → `min_size`,
  `--no-memory-check` → `no_memory_check`, `--quiet` → `quiet`, `--conv` → `conv`, `--format`
  → `format`), with the flag's default (`DEFAULTS`); `resume` is True or False (the directory is
  `out`), `model_options` a dict or the flag's "KEY=VALUE,…" text, `log` the sink names as a
  list or the flag's comma-separated text.
* The algorithm's hyperparameters go by their own names (`HParam.name`: `lr`, `mu`, `lam`, not
  the flags `--pgfed-mu`, `--ditto-lam`), as keywords or in `hparams=`. A name that is also an
  option (`alpha`: the Dirichlet α of the partition, and FedDyn's / APFL's α) is the option as a
  keyword; the hyperparameter goes in `hparams={"alpha": …}`.
* The dataset's rules: a natural-client dataset (`formats.NATURAL_DATASETS`: LEAF, TFF or
  FedJAX files) keeps its own clients (`clients` is refused; `max_clients`, `min_samples` take a
  subset) and is the only kind that takes `format`, `max_clients`, `min_samples`, `cache_dir`,
  `token_accuracy` and `quantise`; the partition defaults to `natural` for those and for `synthetic`,
  `dirichlet` otherwise; the client count to `synthetic_clients` for `synthetic`, 20 otherwise;
  each dataset gets the data options its loader takes (`RunConfig.data_options`).
* `out` defaults to runs/ALGO_DATASET_TIME.

Errors are `fedjax_pfl.errors.OptionError`s naming these options, raised before anything is
loaded: `str(e)` says "clients does not apply (use max_clients K)", run.py says the same with
its flags. What needs the configuration as a whole (`RunConfig.validate`) or the data
(`runner.prepare`) is checked there, as for any RunConfig.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any, Mapping

from fedjax_pfl import algorithms
from fedjax_pfl.data.build import PartitionConfig
from fedjax_pfl.errors import OptionError, arg

# Every option and its default, in run.py's order of the flags.
DEFAULTS: dict[str, Any] = {
    "algo": "fedavg", "rounds": 50, "seed": 0, "eval_every": 1, "target_acc": None,
    "dp_delta": None, "target_epsilon": None, "dp_accountant": "rdp", "eval_clients": "all",
    "rounds_per_call": 1, "state_dtype": "float32", "data_placement": "auto",
    "state_placement": "auto", "no_memory_check": False, "out": None, "checkpoint_every": None,
    "resume": False, "checkpoint_on_signal": None, "log": "", "quiet": False, "model": None,
    "model_options": None, "model_cr": 2.0, "conv": "auto",
    "dataset": "digits", "data_dir": None, "format": None, "max_clients": None, "min_samples": 0,
    "token_accuracy": None, "quantise": None, "cache_dir": None, "tfds_dir": None,
    "download": False,
    "emnist_split": "balanced", "synthetic_alpha": 1.0, "synthetic_beta": 1.0,
    "synthetic_clients": 30,
    "partition": None, "clients": None, "alpha": 0.5, "min_size": 10, "classes_per_client": 2,
    "shards_per_client": None, "shard_size": None, "clusters": 4, "test_fraction": 0.25,
}
# The options that apply to natural-client datasets only.
NATURAL_ONLY = ("format", "max_clients", "cache_dir", "token_accuracy", "min_samples", "quantise")

# The option that sets an argument the library's errors name (`errors.arg(name, space)`) where
# the two names differ: RunConfig's fields (""), PartitionConfig's ("partition") and the keys
# of RunConfig.data_options ("data").
_OPTION_OF = {"": {"model_conv": "conv", "memory_check": "no_memory_check", "progress": "quiet"},
              "partition": {"scheme": "partition", "num_clients": "clients"},
              "data": {"fmt": "format"}}


def option_name(name: str, space: str = "") -> str | None:
    """The option of `from_options` that sets the argument an error names (`errors.arg(name,
    space)`): "clients" for ("num_clients", "partition"), "conv" for ("model_conv", ""), the name
    itself for an option; None for a hyperparameter (its name is its keyword) and for an
    argument that no option sets. A front end spells errors with it (run.py: option → flag)."""
    if space == "hparams":
        return None
    option = _OPTION_OF.get(space, {}).get(name, name)
    return option if option in DEFAULTS else None


def check_algo(algo: str) -> str:
    """`algo`, a registered algorithm (OptionError naming `algo` otherwise)."""
    if algo not in algorithms.names():
        raise OptionError(f"{arg('algo')} must be one of {algorithms.names()}, got {algo!r}")
    return algo


def check_finite(options: Mapping[str, Any]) -> None:
    """Every float option is finite (OptionError naming the first that is not)."""
    for key, value in options.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise OptionError(f"{arg(key)} must be finite, got {value}")


def parse_model_options(options: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """A dict as it is; 'hidden=64,output_tanh=true' -> {"hidden": 64, "output_tanh": True}
    (ints, floats, booleans and words)."""
    if isinstance(options, Mapping):
        return dict(options)
    out: dict[str, Any] = {}
    for item in (options or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise OptionError(f"{arg('model_options')} takes KEY=VALUE pairs separated by "
                              f"commas, got {item!r}")
        if value.lower() in ("true", "false"):
            out[key] = value.lower() == "true"
            continue
        for cast in (int, float):
            try:
                out[key] = cast(value)
                break
            except ValueError:
                pass
        else:
            out[key] = value
    return out


def _hyperparameters(algo: str, hparams: Mapping[str, Any] | None,
                     keywords: Mapping[str, Any]) -> dict[str, Any]:
    """The algorithm's hyperparameters from `hparams=` and the keywords that are no option;
    every name one of the algorithm's (OptionError naming it otherwise)."""
    given = dict(hparams or {})
    for name, value in keywords.items():
        if name in given:
            raise OptionError(f"{arg(name, 'hparams')} is given twice, as a keyword and in "
                              f"{arg('hparams')}")
        given[name] = value
    mine = {hp.name for hp, _ in algorithms.spec(algo).all_hparams()}
    for name in given:
        if name in mine:
            continue
        if any(name in {hp.name for hp, _ in algorithms.spec(a).all_hparams()}
               for a in algorithms.names()):
            raise OptionError(f"{arg(name, 'hparams')} does not apply to {arg('algo')} {algo}")
        raise OptionError(f"unknown option {name!r}: the options are {', '.join(DEFAULTS)}, and "
                          f"{algo}'s hyperparameters {', '.join(sorted(mine))}")
    return given


def run_fields(*, hparams: Mapping[str, Any] | None = None, **options: Any) -> dict[str, Any]:
    """The fields of the RunConfig of a run given by its options (the module docstring says which
    and their rules): what `python experiments/run.py` builds from the same flags
    (`RunConfig.from_options` is `RunConfig(**run_fields(...))`).

    Args:
      hparams: the algorithm's hyperparameters by name (also accepted as keywords).
      **options: any of `DEFAULTS` (the others keep their defaults) and hyperparameters.

    Raises OptionError naming the option (or hyperparameter) at fault.
    """
    from fedjax_pfl import sinks
    from fedjax_pfl.data.formats import NATURAL_DATASETS
    from fedjax_pfl.interrupts import parse_signal

    keywords = {k: v for k, v in options.items() if k not in DEFAULTS}
    o = {**DEFAULTS, **{k: v for k, v in options.items() if k in DEFAULTS}}
    algo = check_algo(o["algo"] if o["algo"] is not None else "fedavg")
    check_finite(o)
    hparams = _hyperparameters(algo, hparams, keywords)
    dataset = o["dataset"]
    synthetic = dataset == "synthetic"
    natural = dataset in NATURAL_DATASETS
    if natural and o["clients"] is not None:
        raise OptionError(f"{arg('dataset')} {dataset} keeps its own clients: {arg('clients')} "
                          f"does not apply (use {arg('max_clients')} K)")
    if not natural:
        for key in NATURAL_ONLY:
            value = o[key] if key != "min_samples" else (o[key] or None)
            if value is not None:
                raise OptionError(f"{arg(key)} applies to natural-client datasets "
                                  f"({', '.join(NATURAL_DATASETS)}), not {arg('dataset')} "
                                  f"{dataset}")
    scheme = o["partition"] or ("natural" if synthetic or natural else "dirichlet")
    if o["clients"] is not None:
        clients = o["clients"]
    else:
        clients = o["synthetic_clients"] if synthetic else 20
    partition = PartitionConfig(
        scheme=scheme, num_clients=clients, alpha=o["alpha"], min_size=o["min_size"],
        classes_per_client=o["classes_per_client"], shards_per_client=o["shards_per_client"],
        shard_size=o["shard_size"], clusters=o["clusters"], test_fraction=o["test_fraction"],
        seed=o["seed"],
    )
    data_options = {"data_dir": o["data_dir"], "tfds_dir": o["tfds_dir"], "download": o["download"]}
    if natural:
        data_options = {"data_dir": o["data_dir"], "fmt": o["format"],
                        "max_clients": o["max_clients"], "min_samples": o["min_samples"],
                        "cache_dir": o["cache_dir"],
                        "token_accuracy": o["token_accuracy"] or "default",
                        "quantise": o["quantise"] or "round"}
    if dataset == "emnist":
        data_options["emnist_split"] = o["emnist_split"]
    if synthetic:
        data_options.update(synthetic_alpha=o["synthetic_alpha"],
                            synthetic_beta=o["synthetic_beta"],
                            synthetic_clients=o["synthetic_clients"])
    out = o["out"] or os.path.join("runs", f"{algo}_{dataset}_{time.strftime('%Y%m%d-%H%M%S')}")
    log = o["log"]
    log = sinks.parse_log_flag(log if log is None or isinstance(log, str) else ",".join(log))
    if o["checkpoint_on_signal"] is not None:
        parse_signal(o["checkpoint_on_signal"])
    return dict(algo=algo, dataset=dataset, model=o["model"],
                model_options=parse_model_options(o["model_options"]),
                model_cr=o["model_cr"], model_conv=o["conv"], partition=partition,
                rounds=o["rounds"], seed=o["seed"], eval_every=o["eval_every"],
                eval_clients=o["eval_clients"], rounds_per_call=o["rounds_per_call"],
                state_dtype=o["state_dtype"], data_placement=o["data_placement"],
                state_placement=o["state_placement"],
                memory_check=not o["no_memory_check"], out=out,
                hparams=hparams, data_options=data_options, progress=not o["quiet"],
                checkpoint_every=o["checkpoint_every"], resume=bool(o["resume"]),
                target_acc=o["target_acc"], log=log,
                checkpoint_on_signal=o["checkpoint_on_signal"], dp_delta=o["dp_delta"],
                target_epsilon=o["target_epsilon"], dp_accountant=o["dp_accountant"])
