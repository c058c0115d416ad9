"""Resuming a saved run: its config.json record as options, and the configuration that continues
it (`resume_config`: the saved options with what a resume may change on top, conflicts refused).
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from fedjax_pfl import algorithms
from fedjax_pfl.errors import OptionError, arg
from fedjax_pfl.runner import checkpoints, rundir
from fedjax_pfl.runner.checkpoints import ResumeError
from fedjax_pfl.runner.config import RunConfig, model_name_of, read_config, resume_conflicts
from fedjax_pfl.runner.options import DEFAULTS


def record_options(record: Mapping[str, Any]) -> dict[str, Any]:
    """The options that reproduce a run's config.json record, its hyperparameters (of its
    algorithm, by name) under "hparams". The settings a resume may change and that start afresh
    (`target_acc`, `data_placement`, `state_placement`, and `quiet`, `no_memory_check`) are not
    taken from the record, nor are `dp_delta`, `target_epsilon` and `dp_accountant` (a resume
    gives them again: they must agree with the record). A run saved before `conv` existed
    computed its convolutions by im2col."""
    from fedjax_pfl.data.formats import NATURAL_DATASETS

    part = record["partition"]
    out = {key: record[key] for key in ("algo", "dataset", "model", "model_cr", "rounds", "seed",
                                        "eval_every", "eval_clients", "rounds_per_call",
                                        "state_dtype") if key in record}
    out.update(partition=part["scheme"], clients=part["num_clients"], alpha=part["alpha"],
               min_size=part["min_size"], classes_per_client=part["classes_per_client"],
               shards_per_client=part["shards_per_client"], shard_size=part["shard_size"],
               clusters=part["clusters"], test_fraction=part["test_fraction"])
    out.update({("format" if k == "fmt" else k): v
                for k, v in record.get("data_options", {}).items()})
    if record.get("model_options"):
        out["model_options"] = dict(record["model_options"])
    if record.get("dataset") in NATURAL_DATASETS:
        out["clients"] = None                 # a natural dataset keeps its own clients
    if "checkpoint_every" in record:
        out["checkpoint_every"] = record["checkpoint_every"]
    if record.get("log"):
        out["log"] = ",".join(record["log"])
    if record.get("checkpoint_on_signal"):
        out["checkpoint_on_signal"] = record["checkpoint_on_signal"]
    out["conv"] = record.get("model_conv", "im2col")
    saved = record.get("hparams", {})
    out["hparams"] = {hp.name: saved[hp.name]
                      for hp, _ in algorithms.spec(record["algo"]).all_hparams()
                      if saved.get(hp.name) is not None}
    return out


def _saved_record(out: str) -> dict[str, Any]:
    """The config.json record of the run in `out`, once `out` holds a run with a checkpoint to
    continue from (OptionError / ResumeError otherwise, before anything is loaded)."""
    rundir.check_out(out, resume=True)
    checkpoints.require_checkpoint(out)
    record = read_config(out)
    checkpoints.check_saved_config(out, record)
    return record


def saved_options(out: str) -> dict[str, Any]:
    """`record_options` of the run in `out` (checked as `resume_config` checks it)."""
    return record_options(_saved_record(out))


def _carried_hparams(record: Mapping[str, Any], algo: str) -> dict[str, Any]:
    """The saved run's hyperparameters that `algo` has too: the same hyperparameter (the same
    flag: the common ones, and an algorithm's own where `algo` shares them, as fedprox_ft does
    fedprox's μ); all of them when `algo` is the saved run's."""
    saved = record.get("hparams", {})
    by_flag = {flag: saved[hp.name] for hp, flag in algorithms.spec(record["algo"]).all_hparams()
               if saved.get(hp.name) is not None}
    return {hp.name: by_flag[flag] for hp, flag in algorithms.spec(algo).all_hparams()
            if flag in by_flag}


def resume_config(out: str, /, *, hparams: Mapping[str, Any] | None = None, **overrides: Any):
    """The RunConfig that continues the run in `out` from its last checkpoint (what
    `python experiments/run.py --resume OUT` runs): the saved configuration (`record_options`)
    with `overrides` (options and hyperparameters, as `from_options` takes them) on top.

    Only what a resume may change may differ from the saved run (`RESUMABLE_CHANGES`: rounds, to
    extend the run, checkpoint_every, target_acc, conv, log, checkpoint_on_signal, the
    placements, quiet and no_memory_check); anything else that differs is refused
    (`resume_conflicts`), as is a directory with no run or no checkpoint to continue from
    (`require_checkpoint`), before anything is loaded. Raises OptionError / ResumeError.
    """
    record = _saved_record(out)
    given = dict(overrides)
    if given.get("out") is not None and os.path.abspath(given["out"]) != os.path.abspath(out):
        raise OptionError(f"{arg('out')} {given['out']} is not the directory of the run to "
                          f"resume, {out}")
    given.pop("out", None)
    given.pop("resume", None)
    options = {k: v for k, v in record_options(record).items() if k != "hparams"}
    options.update({k: v for k, v in given.items() if k in DEFAULTS})
    keywords = {k: v for k, v in given.items() if k not in DEFAULTS}
    algo = options.get("algo")
    carried = _carried_hparams(record, algo) if algo in algorithms.names() else {}
    mine = {**carried, **(hparams or {})}
    for name in keywords:                          # (a keyword overrides the saved value)
        mine.pop(name, None)
    # Only what the caller gives is checked for applying to the run: the saved settings are the
    # run's own (a record keeps every partition field, whatever the scheme).
    check_only = ({(k, "") for k in given if k in DEFAULTS} | {(k, "hparams") for k in keywords}
                  | {(k, "hparams") for k in (hparams or {})})
    cfg = RunConfig.from_options(**options, **keywords, hparams=mine, out=out, resume=True,
                                 check_only=check_only)
    conflict = resume_conflicts(cfg, cfg.validate(), model_name_of(cfg), record)
    if conflict:
        raise ResumeError(conflict)
    return cfg
