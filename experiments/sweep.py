#!/usr/bin/env python
"""A grid of runs: algorithms × hyperparameters × seeds × datasets, into one table and one figure.

    python experiments/sweep.py --out runs/sweep --algos fedavg pgfedmo --seeds 0 1 2 \\
        --grid lr=0.01,0.05 --grid mu=0.01,0.1 --common "--rounds 30 --clients 20"
    python experiments/sweep.py --out runs/sweep --config sweep.json     # the same from a file
    python experiments/sweep.py --out runs/sweep --config sweep.json --resume

A config file holds {"algos": [...], "datasets": [...], "seeds": [...], "grid": {name: [values]},
"common": "run.py flags"} (every field optional); flags given on the command line win, and a
--grid NAME replaces the file's NAME. Grid names are hyperparameter names (`lr`, `mu`, `lam`,
`batch_size`, …; see run.py --help): a name an algorithm does not have is skipped for it, and a
name that none of the chosen algorithms has is an error.

Everything is checked before the first run starts and before any folder is created, with the
checks run.py makes (`RunConfig.from_options`, `RunConfig.validate`, the algorithms' `resolve`):
the config file's fields, every run's configuration (each grid value for each algorithm that
has it, every combination), the seeds (no seed twice), --out (not a file; a folder that already
holds files only with --resume), then every dataset's files and every run's algorithm built for
its dataset's model (the checks its factory makes), nothing initialised or compiled. Bad input exits with status 2 and
one line naming the flag or field. A sweep that fails while running leaves no empty folders.

Runs of one algorithm on one dataset that differ only in seed and in scalar hyperparameters the
algorithm uses only in arithmetic (its `traceable` list: lr, μ, λ, β, …) run as ONE vmapped,
compiled program (fedjax_pfl.sweep); other hyperparameters (batch size, epochs, choices) make
separate programs, run one after another, and so do algorithms whose initialisation needs
concrete data (FedPC's graph). Seeds vary the model initialisation and client sampling; the
partition comes from --seed in --common (so all seeds see the same clients), and so does the
frozen base of a zoo model under --peft lora (a pretrained --model hf:PATH is its own).

OUT/results.md: one row per (dataset, algorithm, hyperparameters): mean ± std over seeds of the
best-round and last-round mean client accuracy, the last worst-10 % and global accuracy.
With --dp-clip (in --common, or a dp_clip grid) a row also has ε after the last round at δ
(--dp-delta), from its runs' noise multiplier (a dp_noise_multiplier grid varies it inside one
program; --target-epsilon gives every run the one it calls for); each run's metrics.jsonl has
ε after every round, as run.py's.
OUT/curves.png: mean accuracy per round (± std over seeds). Every run keeps its own
metrics.jsonl / summary.json under OUT/<dataset>/<algo>/<hyperparameters>/<seed>/; --resume
reuses the runs whose summary.json is there.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run as cli  # noqa: E402

CONFIG_FIELDS = ("algos", "datasets", "seeds", "grid", "common")
# run.py flags a sweep sets itself (per run) or cannot honour: refused in --common.
SWEEP_OWNED = {"algo": "--algos", "dataset": "--datasets", "seeds": "--seeds", "out": "--out",
               "resume": "--resume", "overwrite": "a new --out",
               "coordinator": "sweep.py's own --coordinator",
               "num_processes": "sweep.py's own --num-processes",
               "process_id": "sweep.py's own --process-id",
               "distributed": "sweep.py's own --distributed",
               "coordinator_timeout": "sweep.py's own --coordinator-timeout",
               "peer_timeout": "sweep.py's own --peer-timeout",
               "no_compile_cache": "sweep.py's own --no-compile-cache"}


class SweepError(ValueError):
    """Bad sweep input; the message is one line naming the flag, the config field or the file."""


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (no usage block), exit status 2."""

    def error(self, message: str):
        _fail(f"{message} (see --help)")


def _fail(message: str, code: int = 2) -> None:
    print(f"sweep.py: error: {' '.join(str(message).split())}", file=sys.stderr)
    raise SystemExit(code)


# -- the sweep's input: flags and the config file ---------------------------------------------


def _text(value: Any) -> str:
    """A grid value as run.py would receive it on the command line."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return value if isinstance(value, str) else repr(value)


def parse_grid(items: list[str]) -> dict[str, list[str]]:
    """--grid NAME=V1,V2,… (repeatable) -> {name: [texts]}; the values are checked per algorithm."""
    grid: dict[str, list[str]] = {}
    for item in items:
        name, sep, values = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or not name or not values:
            raise SweepError(f"--grid wants NAME=V1,V2,…, got {item!r}")
        texts = [v.strip() for v in values.split(",")]
        if "" in texts:
            raise SweepError(f"--grid {item}: empty value (values are separated by single commas)")
        if name in grid:
            raise SweepError(f"--grid {name} is given twice; list its values once: "
                             f"--grid {name}=V1,V2,…")
        grid[name] = texts
    return grid


def load_config(path: str) -> dict[str, Any]:
    """The --config file, each field checked (SweepError naming the file and the field)."""
    where = f"--config {path}"
    if not os.path.exists(path):
        raise SweepError(f"{where}: no such file")
    if os.path.isdir(path):
        raise SweepError(f"{where}: is a directory, not a JSON file")
    try:
        with open(path, "rb") as f:
            config = json.loads(f.read().decode("utf-8"))
    except OSError as e:
        raise SweepError(f"{where}: cannot be read ({e.strerror})") from None
    except ValueError as e:                          # JSONDecodeError, UnicodeDecodeError
        raise SweepError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise SweepError(f"{where}: must hold a JSON object with the fields "
                         f"{', '.join(CONFIG_FIELDS)}; got a JSON {_json_type(config)}")
    unknown = sorted(set(config) - set(CONFIG_FIELDS))
    if unknown:
        raise SweepError(f"{where}: unknown field {unknown[0]!r} (the fields are "
                         f"{', '.join(CONFIG_FIELDS)})")
    for key in ("algos", "datasets"):
        if key in config and not (isinstance(config[key], list) and config[key] and all(
                isinstance(v, str) and v for v in config[key])):
            raise SweepError(f"{where}: field {key!r} must be a non-empty list of names, got "
                             f"{_short(config[key])}")
    if "seeds" in config and not (isinstance(config["seeds"], list) and config["seeds"] and all(
            isinstance(v, int) and not isinstance(v, bool) for v in config["seeds"])):
        raise SweepError(f"{where}: field 'seeds' must be a non-empty list of integers, got "
                         f"{_short(config['seeds'])}")
    if "common" in config and not isinstance(config["common"], str):
        raise SweepError(f"{where}: field 'common' must be a string of run.py flags, got "
                         f"{_short(config['common'])}")
    if "grid" in config:
        grid = config["grid"]
        if not isinstance(grid, dict):
            raise SweepError(f"{where}: field 'grid' must be an object {{name: [values]}}, got "
                             f"{_short(grid)}")
        for name, values in grid.items():
            if not (isinstance(values, list) and values and all(
                    isinstance(v, (str, int, float)) for v in values)):
                raise SweepError(f"{where}: field 'grid.{name}' must be a non-empty list of "
                                 f"numbers, strings or booleans, got {_short(values)}")
    return config


def _json_type(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "number",
            float: "number", type(None): "null"}.get(type(value), type(value).__name__)


def _short(value: Any) -> str:
    text = json.dumps(value)
    return f"{text[:60]}…" if len(text) > 60 else text


def _unique(values: list, where: str, what: str) -> None:
    seen = set()
    for v in values:
        if v in seen:
            raise SweepError(f"{where} lists {what} {v!r} more than once")
        seen.add(v)


# -- the plan: every run, validated, before anything runs ---------------------------------------


def _message(e: BaseException, algo: str | None = None) -> str:
    """A library error as sweep.py says it: run.py's flags (with `algo`'s hyperparameter flags),
    the sweep's --grid, and the runs' base configuration as --common."""
    from fedjax_pfl.errors import spelled

    spell = cli.spelling(algo)
    own = {("grid", ""): "--grid", ("base", ""): "--common"}
    return " ".join(spelled(e, lambda name, space: own.get((name, space)) or spell(name, space)
                            ).split())


def plan(args: argparse.Namespace):
    """Checks everything the sweep will run and lays out its groups (`fedjax_pfl.sweep.Plan`);
    creates nothing. Each (dataset, algorithm)'s configuration is built once from the --common
    flags (`RunConfig.from_options`), its groups by `fedjax_pfl.sweep.plan_groups`.

    Raises SweepError (ValueError) with one line naming the flag, the config field or the file.
    """
    config = load_config(args.config) if args.config else {}
    source = lambda key, flag: flag if getattr(args, key) is not None else (
        f"--config {args.config}: field {key!r}")
    algos = args.algos or config.get("algos") or ["fedavg"]
    datasets = args.datasets or config.get("datasets") or ["digits"]
    seeds = args.seeds or config.get("seeds") or [0]
    common = args.common if args.common is not None else config.get("common", "")
    grid = {k.replace("-", "_"): [_text(v) for v in values]
            for k, values in config.get("grid", {}).items()}
    grid.update(parse_grid(args.grid))

    from fedjax_pfl import algorithms, runner, sweep
    from fedjax_pfl.data import sources

    for name in algos:
        if name not in algorithms.names():
            raise SweepError(f"{source('algos', '--algos')}: unknown algorithm {name!r}; expected "
                             f"one of {algorithms.names()}")
    _unique(algos, source("algos", "--algos"), "algorithm")
    from fedjax_pfl.data.formats import NATURAL_DATASETS

    known = [*sources.DATASETS, *NATURAL_DATASETS]
    for name in datasets:
        if name not in known:
            raise SweepError(f"{source('datasets', '--datasets')}: unknown dataset {name!r}; "
                             f"expected one of {known}")
    _unique(datasets, source("datasets", "--datasets"), "dataset")
    try:
        sweep.check_seeds(seeds)
    except ValueError as e:
        raise SweepError(e.render(lambda name, space: source("seeds", "--seeds")
                                  if (name, space) == ("seeds", "") else None)) from None
    try:
        runner.check_out(args.out, overwrite=True)     # a file, or a path that cannot be created
    except ValueError as e:
        raise SweepError(_message(e)) from None
    if os.path.isdir(args.out) and os.listdir(args.out) and not args.resume:
        found = sorted(os.listdir(args.out))
        shown = ", ".join(found[:4]) + (", …" if len(found) > 4 else "")
        raise SweepError(f"--out {args.out} already holds files ({shown}); pass --resume to reuse "
                         "its finished runs and run the rest, or choose a new --out")

    where_common = source("common", "--common")
    try:
        common_argv = shlex.split(common)
    except ValueError as e:
        raise SweepError(f"{where_common}: cannot split {common!r} into flags ({e})") from None
    try:
        common_args = cli.parse_flags(common_argv + ["--quiet"])
    except cli.UsageError as e:
        raise SweepError(f"{where_common}: {e}") from None
    given = common_args.explicit
    for dest, instead in SWEEP_OWNED.items():
        if dest in given:
            flag = "--" + dest.replace("_", "-")
            raise SweepError(f"{where_common}: {flag} is set by the sweep itself (use {instead})"
                             if instead.startswith("-") else
                             f"{where_common}: {flag} is not a per-run flag (use {instead})"
                             if instead.startswith("sweep.py") else
                             f"{where_common}: {flag} is not a sweep setting (use {instead})")
    try:
        sweep.check_grid_names(grid, algos, settings=set(vars(common_args)))
    except ValueError as e:
        raise SweepError(_message(e)) from None

    groups = []
    folders: dict[str, str] = {}
    for dataset in datasets:
        for algo in algos:
            what = f"{algo} on {dataset}"
            try:
                base = cli.config_from_args(common_args, prog=f"sweep.py: {what}",
                                            say_harmless=len(datasets) == 1,
                                            dataset=dataset, algo=algo)
            except ValueError as e:
                text = _message(e, algo)
                hint = (" (a hyperparameter that only some algorithms have goes in --grid "
                        "NAME=VALUE, which applies to the algorithms that have NAME)"
                        if "does not apply to --algo" in text else "")
                raise SweepError(f"{what}: {text}{hint}") from None
            base.progress = False
            base.compile_cache = not getattr(args, "no_compile_cache", False)
            try:
                base.validate()
            except ValueError as e:
                raise SweepError(f"{what}: {_message(e, algo)}") from None
            try:
                groups += sweep.plan_groups(base, grid, seeds, args.out, folders=folders)
            except ValueError as e:
                raise SweepError(_message(e, algo)) from None
    return sweep.Plan(args.out, groups, datasets)


def check_algorithms(the_plan, data: dict[str, tuple]) -> None:
    """Builds every run's algorithm for its dataset's model, as the runner's `prepare` does
    (`models.get`, `algorithms.get`): the checks a factory makes (pFedSOP's plain-SGD probe, a
    split model's head) stop the sweep before its first run. Nothing is initialised or compiled."""
    from fedjax_pfl import algorithms, runner, sweep

    for group in the_plan.groups:
        cfg, (fed, _) = group.cfg, data[group.dataset]
        where = f"{group.algo} on {group.dataset}"
        try:
            runner.check_with_data(cfg, fed)
        except ValueError as e:
            raise SweepError(f"{where}: {_message(e, group.algo)}") from None
        try:
            model = sweep.sweep_model(cfg, fed)
        except ValueError as e:
            raise SweepError(f"{where}: {_message(e, group.algo)}") from None
        for combo, hparams in zip(group.traced, group.resolved):
            try:
                algorithms.get(group.algo, model=model, **hparams)
            except ValueError as e:
                label = group.label(combo)
                raise SweepError(f"{where}" + (f" ({label})" if label else "")
                                 + f": {_message(e, group.algo)}") from None


def _load_all_data(the_plan) -> dict[str, tuple]:
    """Each dataset's federated split (the partition comes from --common), loaded before any run
    so that a missing dataset stops the sweep before its first run."""
    from fedjax_pfl import runner
    from fedjax_pfl.data.sources import DatasetNotFoundError
    from fedjax_pfl.errors import spelled

    data = {}
    for group in the_plan.groups:
        if group.dataset in data:
            continue
        try:
            data[group.dataset] = runner.load_data(group.cfg)
        except DatasetNotFoundError as e:
            text = spelled(e, cli.spelling(group.algo))
            lines = [line.strip() for line in text.splitlines() if line.strip()]
            raise SweepError(f"--datasets {group.dataset}: {lines[0]} " + "; ".join(lines[1:])
                             ) from None
        except ValueError as e:
            raise SweepError(f"--datasets {group.dataset}: {_message(e, group.algo)}") from None
    return data


# -- running ------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="sweep.py", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True,
                   help="output folder: new or empty, or one of an earlier sweep with --resume")
    p.add_argument("--config", default=None, help="JSON file with algos/datasets/seeds/grid/common")
    p.add_argument("--algos", nargs="+", default=None)
    p.add_argument("--datasets", nargs="+", default=None)
    p.add_argument("--seeds", nargs="+", type=int, default=None)
    p.add_argument("--grid", action="append", default=[], help="NAME=V1,V2,… (repeatable)")
    p.add_argument("--common", default=None, help="run.py flags shared by every run")
    p.add_argument("--resume", action="store_true", help="reuse runs that already have a summary")
    p.add_argument("--sequential", action="store_true",
                   help="run every run on its own (no vmapped groups): the reference")
    p.add_argument("--no-compile-cache", action="store_true",
                   help="do not use JAX's persistent compilation cache (as run.py)")
    g = p.add_argument_group("several processes (as run.py: every process runs the whole sweep "
                             "with the same flags; process 0 alone writes and prints)")
    g.add_argument("--coordinator", default=None, help="HOST:PORT of process 0")
    g.add_argument("--num-processes", type=int, default=1)
    g.add_argument("--process-id", type=int, default=0)
    g.add_argument("--distributed", default=None, choices=("auto",),
                   help="'auto': the process layout from the launcher (SLURM, Open MPI, …)")
    g.add_argument("--coordinator-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="how long the processes wait for each other at start (as run.py)")
    g.add_argument("--peer-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="a process silent this long is lost; the others stop and exit 75 (as run.py)")
    return p


def main(argv: list[str] | None = None) -> int:
    """The sweep; returns 0, or raises SystemExit(2) with one line on bad input (nothing run,
    no folder created), SystemExit(1) when a run diverges."""
    args = build_parser().parse_args(argv)
    import fedjax_pfl

    try:
        cli.check_processes(args)                 # before jax.distributed starts
    except ValueError as e:
        _fail(str(e))
    multi = bool(args.coordinator or args.distributed)
    if multi:
        cli.start_processes(args, "sweep.py")     # they agree, or one line and exit 2
    else:
        fedjax_pfl.use_cpu_cores()                # before JAX starts (validation computes nothing)
    from fedjax_pfl import runner, sweep
    from fedjax_pfl.interrupts import exit_status, stop_signals

    try:
        with cli.said_warnings("sweep.py"):            # said once every run's checks passed
            the_plan = plan(args)
            # Each run's compile_cache (set in `plan`), as runner.prepare and sweep.run_group
            # set it, already for the data's own programs.
            fedjax_pfl.use_compile_cache(not args.no_compile_cache)
            if args.resume:
                check_resume(the_plan)
            data = _load_all_data(the_plan)
            check_algorithms(the_plan, data)
    except SweepError as e:
        _fail(str(e))
    import jax

    primary = jax.process_index() == 0
    if multi:      # every process has checked --out before any of them writes into it
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("fedjax_pfl sweep: plan checked")
    created = _missing_dirs(args.out)
    os.makedirs(args.out, exist_ok=True)
    group = None
    try:
        with stop_signals():                    # SIGTERM ends the sweep as Ctrl-C does
            rows, curves = [], {}
            for group in the_plan.groups:
                runs_data, info = data[group.dataset]
                summaries = _run_or_resume(group, runs_data, info, args)
                group_rows, group_curves = sweep.group_results(group, summaries)
                rows += group_rows
                curves.update(group_curves)
            if primary:
                sweep.write_results(args.out, rows, curves)
    except BaseException as e:
        if primary:
            _remove_empty_dirs(args.out, created)
        if isinstance(e, runner.NonFiniteError):
            _fail(_message(e, getattr(group, "algo", None)), code=1)
        if isinstance(e, KeyboardInterrupt):
            print(f"sweep.py: interrupted; the finished runs are in {args.out} (continue with "
                  "--resume)", file=sys.stderr)
            raise SystemExit(exit_status(e)) from None
        if isinstance(e, ValueError):
            _fail(_message(e, getattr(group, "algo", None)))
        raise
    print(f"wrote {os.path.join(args.out, 'results.md')}")
    return 0


def _missing_dirs(path: str) -> list[str]:
    """`path` and those of its ancestors that do not exist yet (what makedirs will create)."""
    out, path = [], os.path.abspath(path)
    while not os.path.exists(path):
        out.append(path)
        path = os.path.dirname(path)
    return out


def _remove_empty_dirs(out: str, created: list[str]) -> None:
    """After a failed sweep: every empty folder under `out` (deepest first), and `out` and the
    ancestors the sweep created if they are empty then. Folders holding any file stay."""
    if not os.path.isdir(out):
        return
    for root, _, _ in sorted(os.walk(out), key=lambda w: -w[0].count(os.sep)):
        if os.path.abspath(root) != os.path.abspath(out):
            try:
                os.rmdir(root)                      # only succeeds when empty
            except OSError:
                pass
    for path in created:                            # deepest first
        try:
            os.rmdir(path)
        except OSError:
            break


def check_resume(the_plan) -> None:
    """--resume: every run folder that holds a run was made with that run's configuration
    (`runner.reuse_conflicts`: the --common flags, the grid values, the seed), checked before
    anything runs. A sweep whose configuration changed stops here (SweepError naming the run
    and the flag) instead of reporting another configuration's numbers or replacing its runs."""
    from fedjax_pfl import runner
    from fedjax_pfl.errors import render

    for group in the_plan.groups:
        for r in group.runs:
            run_cfg = group.run_config(r)
            record = os.path.join(run_cfg.out, "config.json")
            if not os.path.isdir(run_cfg.out) or not os.listdir(run_cfg.out):
                continue
            try:
                saved = runner.read_config(run_cfg.out)
            except (OSError, ValueError):
                raise SweepError(f"--resume: {run_cfg.out} holds files but no readable "
                                 f"{os.path.basename(record)}: not a run of this sweep; move it "
                                 "away or use a new --out") from None
            conflict = runner.reuse_conflicts(run_cfg, run_cfg.validate(),
                                              runner.model_name_of(run_cfg), saved)
            if conflict:
                conflict = render(conflict, cli.spelling(run_cfg.algo))
                raise SweepError(f"--resume: {run_cfg.out} holds a run made with {conflict}: "
                                 "this sweep's configuration differs from the one that made "
                                 "it; use a new --out")


def _finished(path: str) -> dict | None:
    """The saved summary of a run that ran to its end (not an interrupted one), or None."""
    try:
        with open(path) as f:
            summary = json.load(f)
    except (OSError, ValueError):
        return None
    return None if summary.get("interrupted", False) else summary


def _run_or_resume(group, data, info, args) -> list[dict]:
    """The group's summaries: reused (--resume: every run finished, and of this configuration,
    `check_resume`), vmapped, or one run after another."""
    from fedjax_pfl import runner, sweep

    cfg, runs, group_dir = group.cfg, group.runs, group.directory
    paths = [os.path.join(group_dir, sweep.slug(r.label), "summary.json") for r in runs]
    saved = [_finished(p) for p in paths] if args.resume else []
    if args.resume and all(s is not None for s in saved):
        out = []
        for p, summary, r in zip(paths, saved, runs):
            with open(os.path.join(os.path.dirname(p), "metrics.jsonl")) as f:
                summary["rows"] = [json.loads(line) for line in f]
            # (a run made one at a time, --sequential, saved no "traced": it is the run's own)
            summary["traced"] = dict(r.traced)
            out.append(summary)
        print(f"== {cfg.algo} {group_dir}: reused {len(runs)} runs")
        return out
    print(f"== {cfg.algo} {group_dir}: {len(runs)} runs", flush=True)
    vectorised = not args.sequential and cfg.validate()["backend"] != "loop"
    if vectorised:
        try:
            return sweep.run_group(cfg, runs, data=data, data_info=info, out=group_dir,
                                   progress=False)
        except (ValueError, TypeError) as e:            # e.g. FedPC's host-side init
            print(f"   not vectorisable ({_message(e, cfg.algo)[:120]}): one run at a time")
    out = []
    for r in runs:
        run_cfg = group.run_config(r)
        summary = runner.run(run_cfg, data=data, data_info=info, log=lambda *_: None)
        summary["traced"] = dict(r.traced)
        with open(os.path.join(run_cfg.out, "metrics.jsonl")) as f:
            summary["rows"] = [json.loads(line) for line in f]
        out.append(summary)
    return out


if __name__ == "__main__":
    cli.leave(main())          # (as run.py: no teardown after a signal or a lost process)
