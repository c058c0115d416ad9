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
checks run.py makes (`run.config_from_args`, `RunConfig.validate`, the algorithms' `resolve`):
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
partition comes from --seed in --common (so all seeds see the same clients).

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
import copy
import dataclasses
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
               "distributed": "sweep.py's own --distributed"}


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


@dataclasses.dataclass
class Group:
    """Runs of one algorithm on one dataset with the same static hyperparameters: one vmapped
    program when possible. `traced` lists the traced combinations (each run is one of them with
    one seed)."""

    dataset: str
    algo: str
    cfg: Any                          # runner.RunConfig with the static hyperparameters set
    static: dict[str, Any]
    traced: list[dict[str, Any]]
    runs: list                        # fedjax_pfl.sweep.RunSpec
    directory: str
    resolved: list[dict[str, Any]]    # every hyperparameter of each traced combination


@dataclasses.dataclass
class Plan:
    out: str
    groups: list[Group]
    datasets: list[str]


def plan(args: argparse.Namespace) -> Plan:
    """Checks everything the sweep will run and lays out its groups; creates nothing.

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
        raise SweepError(str(e)) from None
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

    specs = {a: algorithms.spec(a) for a in algos}
    _check_grid_names(grid, specs, set(vars(common_args)))

    groups: list[Group] = []
    folders: dict[str, str] = {}
    for dataset in datasets:
        for algo in algos:
            what = f"{algo} on {dataset}"
            try:
                base = runner.RunConfig.from_options(
                    **cli.run_options(common_args, dataset=dataset, algo=algo))
            except ValueError as e:
                text = cli.message(e, algo)
                hint = (" (a hyperparameter that only some algorithms have goes in --grid "
                        "NAME=VALUE, which applies to the algorithms that have NAME)"
                        if "does not apply to --algo" in text else "")
                raise SweepError(f"{what}: {text}{hint}") from None
            base.progress = False
            try:
                base.validate()
            except ValueError as e:
                raise SweepError(f"{what}: {cli.message(e, algo)}") from None
            groups += _algo_groups(args.out, dataset, algo, specs[algo], base, grid, seeds,
                                   folders, sweep)
    return Plan(args.out, groups, datasets)


def _check_grid_names(grid: dict, specs: dict, run_dests: set[str]) -> None:
    """Every grid name is a hyperparameter of at least one chosen algorithm."""
    from fedjax_pfl.algorithms.base import COMMON_HPARAMS

    common_names = [hp.name for hp in COMMON_HPARAMS]
    for name in grid:
        if any(name in {hp.name for hp, _ in spec.all_hparams()} for spec in specs.values()):
            continue
        if name in run_dests and not name.startswith("hp__"):
            raise SweepError(f"--grid {name}: --{name.replace('_', '-')} is a run setting, not an "
                             f"algorithm hyperparameter; set it in --common (one value per sweep)")
        own = "; ".join(f"{algo}: {', '.join(hp.name for hp in spec.hparams) or '(none)'}"
                        for algo, spec in specs.items())
        raise SweepError(f"--grid {name}: no chosen algorithm ({', '.join(specs)}) has a "
                         f"hyperparameter {name!r}; they take {', '.join(common_names)} (all) "
                         f"and their own ({own})")


def _algo_groups(out, dataset, algo, spec, base, grid, seeds, folders, sweep) -> list[Group]:
    """The groups of one algorithm on one dataset, every run's configuration validated."""
    table = {hp.name: hp for hp, _ in spec.all_hparams()}
    mine = {k: v for k, v in grid.items() if k in table}
    what = f"{algo} on {dataset}"
    skipped = sorted(set(grid) - set(mine))
    if skipped:
        print(f"{algo}: no hyperparameter {skipped}; not varied for it")

    def validated(hparams: dict, label: str) -> dict:
        cfg = copy.deepcopy(base)
        cfg.hparams = {**base.hparams, **hparams}
        try:
            return cfg.validate()
        except ValueError as e:
            raise SweepError(f"--grid {label}: {what}: {e}") from None

    typed: dict[str, list] = {}
    for name, texts in mine.items():
        values = []
        for text in texts:
            value: Any = text
            if table[name].type is bool:              # run.py's switches: true/false here
                value = {"true": True, "1": True, "yes": True, "false": False, "0": False,
                         "no": False}.get(text.lower(), text)
            values.append(validated({name: value}, f"{name}={text}")[name])
        for i, v in enumerate(values):
            if v in values[:i]:
                raise SweepError(f"--grid {name} lists the value {v!r} more than once "
                                 f"({texts[values.index(v)]!r} and {texts[i]!r})")
        typed[name] = values
    traced_names = {k for k, v in typed.items() if k in spec.traceable and all(
        isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)}
    static_grid = {k: v for k, v in typed.items() if k not in traced_names}
    traced_grid = {k: v for k, v in typed.items() if k in traced_names}
    groups = []
    for static in sweep.grid(static_grid):
        static_label = " ".join(f"{k}={v}" for k, v in static.items())
        traced = sweep.grid(traced_grid)
        resolved = [validated({**static, **combo}, _label({**static, **combo}) or "(none)")
                    for combo in traced]                  # every combination of the sweep
        cfg = copy.deepcopy(base)
        cfg.hparams = {**base.hparams, **static}
        directory = os.path.join(out, dataset, algo,
                                 sweep.slug(static_label) if static_label else "default")
        runs = [sweep.RunSpec(seed, tuple(sorted(tc.items()))) for tc in traced for seed in seeds]
        for r in runs:
            folder = os.path.normpath(os.path.join(directory, sweep.slug(r.label)))
            values = " ".join(f"{k}={v!r}" for k, v in {**static, **dict(r.traced)}.items())
            label = f"{what} {values} seed={r.seed}".replace("  ", " ")
            if folder in folders:
                raise SweepError(f"--grid: the runs {folders[folder]!r} and {label!r} would share "
                                 f"the folder {folder} (folder names keep 6 significant digits "
                                 "of each value); use values that differ in their first 6 significant digits")
            folders[folder] = label
        groups.append(Group(dataset, algo, cfg, static, traced, runs, directory, resolved))
    return groups


def _label(hparams: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in hparams.items())


def check_algorithms(the_plan: Plan, data: dict[str, tuple]) -> None:
    """Builds every run's algorithm for its dataset's model, as the runner's `prepare` does
    (`models.get`, `algorithms.get`): the checks a factory makes (pFedSOP's plain-SGD probe, a
    split model's head) stop the sweep before its first run. Nothing is initialised or compiled."""
    from fedjax_pfl import algorithms, models, runner

    for group in the_plan.groups:
        cfg, (fed, _) = group.cfg, data[group.dataset]
        try:
            runner.check_with_data(cfg, fed)
        except ValueError as e:
            raise SweepError(f"{group.algo} on {group.dataset}: {e}") from None
        try:
            model = models.get(runner.model_name_of(cfg), fed.input_shape, fed.num_classes,
                               cr=cfg.model_cr, conv=cfg.model_conv, task=fed.task,
                               options=cfg.model_options)
        except ValueError as e:
            raise SweepError(f"{group.algo} on {group.dataset}: {e}") from None
        for combo, hparams in zip(group.traced, group.resolved):
            try:
                algorithms.get(group.algo, model=model, **hparams)
            except ValueError as e:
                label = _label({**group.static, **combo})
                where = f"{group.algo} on {group.dataset}" + (f" ({label})" if label else "")
                raise SweepError(f"{where}: {e}") from None


def _load_all_data(the_plan: Plan) -> dict[str, tuple]:
    """Each dataset's federated split (the partition comes from --common), loaded before any run
    so that a missing dataset stops the sweep before its first run."""
    from fedjax_pfl import runner
    from fedjax_pfl.data.sources import DatasetNotFoundError

    data = {}
    for group in the_plan.groups:
        if group.dataset in data:
            continue
        try:
            data[group.dataset] = runner.load_data(group.cfg)
        except DatasetNotFoundError as e:
            lines = [line.strip() for line in str(e).splitlines() if line.strip()]
            raise SweepError(f"--datasets {group.dataset}: {lines[0]} " + "; ".join(lines[1:])
                             ) from None
        except ValueError as e:
            raise SweepError(f"--datasets {group.dataset}: {e}") from None
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
        if args.distributed:
            fedjax_pfl.init_distributed()
        else:
            fedjax_pfl.init_distributed(args.coordinator, args.num_processes, args.process_id)
        import jax

        if jax.process_index() != 0:              # one voice: only process 0 prints
            sys.stdout.flush()
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    else:
        fedjax_pfl.use_cpu_cores()                # before JAX starts (validation computes nothing)
    if args.no_compile_cache:
        import jax

        jax.config.update("jax_enable_compilation_cache", False)
    else:
        fedjax_pfl.use_compile_cache()
    from fedjax_pfl import runner, sweep
    from fedjax_pfl.interrupts import exit_status, stop_signals

    try:
        the_plan = plan(args)
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
    try:
        with stop_signals():                    # SIGTERM ends the sweep as Ctrl-C does
            rows, curves = [], {}
            for group in the_plan.groups:
                runs_data, info = data[group.dataset]
                summaries = _run_or_resume(group.cfg, group.runs, runs_data, info, group.directory,
                                           args, runner, sweep)
                for tc in group.traced:
                    label = " ".join(f"{k}={v}" for k, v in {**group.static, **tc}.items())
                    cell = [s for s in summaries if s["traced"] == tc]
                    rows.append(_row(group.dataset, group.algo, label, cell))
                    name = f"{group.dataset} {group.algo} {label}".strip()
                    curves[name] = [s["rows"] for s in cell]
            if primary:
                _write(args.out, rows, curves)
    except BaseException as e:
        if primary:
            _remove_empty_dirs(args.out, created)
        if isinstance(e, runner.NonFiniteError):
            _fail(str(e), code=1)
        if isinstance(e, KeyboardInterrupt):
            print(f"sweep.py: interrupted; the finished runs are in {args.out} (continue with "
                  "--resume)", file=sys.stderr)
            raise SystemExit(exit_status(e)) from None
        if isinstance(e, ValueError):
            _fail(str(e))
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


def _run_config(cfg, r, group_dir: str, sweep):
    """The RunConfig of one run of a group: its seed and traced values on the group's."""
    run_cfg = copy.deepcopy(cfg)
    run_cfg.seed = r.seed
    run_cfg.hparams = {**run_cfg.hparams, **dict(r.traced)}
    run_cfg.out = os.path.join(group_dir, sweep.slug(r.label))
    run_cfg.progress = False
    run_cfg.partition = cfg.partition               # the group's shared partition seed
    return run_cfg


def check_resume(the_plan: Plan) -> None:
    """--resume: every run folder that holds a run was made with that run's configuration
    (`runner.reuse_conflicts`: the --common flags, the grid values, the seed), checked before
    anything runs. A sweep whose configuration changed stops here (SweepError naming the run
    and the flag) instead of reporting another configuration's numbers or replacing its runs."""
    from fedjax_pfl import runner, sweep

    for group in the_plan.groups:
        for r in group.runs:
            run_cfg = _run_config(group.cfg, r, group.directory, sweep)
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


def _run_or_resume(cfg, runs, data, info, group_dir, args, runner, sweep) -> list[dict]:
    """The group's summaries: reused (--resume: every run finished, and of this configuration,
    `check_resume`), vmapped, or one run after another."""
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
            print(f"   not vectorisable ({' '.join(str(e).split())[:120]}): one run at a time")
    out = []
    for r in runs:
        run_cfg = _run_config(cfg, r, group_dir, sweep)
        summary = runner.run(run_cfg, data=data, data_info=info, log=lambda *_: None)
        summary["traced"] = dict(r.traced)
        with open(os.path.join(run_cfg.out, "metrics.jsonl")) as f:
            summary["rows"] = [json.loads(line) for line in f]
        out.append(summary)
    return out


def _stat(values):
    import numpy as np

    values = [v for v in values if v is not None]
    if not values:
        return "–"
    return f"{100 * np.mean(values):.2f} ± {100 * np.std(values):.2f}"


def _row(dataset, algo, label, summaries) -> dict:
    get = lambda kind, key: [s[kind].get(key) for s in summaries]
    return {"dataset": dataset, "algo": algo, "hparams": label or "defaults",
            "seeds": len(summaries),
            "best": _stat(get("best", "acc_mean")), "last": _stat(get("last", "acc_mean")),
            "worst10": _stat(get("last", "acc_worst10")),
            "global": _stat(get("last", "global_acc_mean")), **_privacy(summaries)}


def _privacy(summaries) -> dict:
    """A private group's ε at δ after its last round (the same for every seed: ε depends on the
    noise multiplier, the clients per round, N, the rounds and δ); None: no noise, no bound."""
    if not any("privacy" in s for s in summaries):
        return {}
    eps = [s["privacy"]["dp_epsilon"] for s in summaries]
    return {"dp_epsilon": None if None in eps else max(eps),
            "dp_delta": summaries[0]["privacy"]["delta"]}


def _write(out, rows, curves) -> None:
    import numpy as np

    private = any("dp_delta" in r for r in rows)
    eps = lambda r: ("—" if "dp_delta" not in r else "∞" if r["dp_epsilon"] is None
                     else f"{r['dp_epsilon']:.3g} (δ = {r['dp_delta']:.2g})")
    lines = ["# Sweep", "", "Mean client accuracy (%) as mean ± std over seeds: best round, last "
             "round, worst 10 % of clients (last), global model (last)"
             + ("; ε of client-level DP after the last round." if private else "."), "",
             "| dataset | algorithm | hyperparameters | seeds | best | last | worst 10% | global |"
             + (" ε |" if private else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|" if private else "")]
    lines += [f"| {r['dataset']} | {r['algo']} | {r['hparams']} | {r['seeds']} | {r['best']} | "
              f"{r['last']} | {r['worst10']} | {r['global']} |" + (f" {eps(r)} |" if private else "")
              for r in rows]
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(rows, f, indent=2)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for label, runs in curves.items():
        series = [[(r["round"], r["acc_mean"]) for r in rows_ if "acc_mean" in r] for rows_ in runs]
        if not series or not series[0]:
            continue
        rounds = [x for x, _ in series[0]]
        values = np.array([[y for _, y in s] for s in series if len(s) == len(rounds)])
        mean, std = values.mean(axis=0), values.std(axis=0)
        ax.plot(rounds, mean, label=label)
        ax.fill_between(rounds, mean - std, mean + std, alpha=0.2)
    ax.set_xlabel("round")
    ax.set_ylabel("mean client test accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "curves.png"), dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
