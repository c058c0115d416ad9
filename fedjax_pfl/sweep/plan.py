"""A sweep's plan: its groups of runs (one vmapped program each), their folders and labels, every
run's configuration checked before anything runs (what experiments/sweep.py plans from its
flags)."""

from __future__ import annotations

import dataclasses
import itertools
import os
from typing import Any, Collection, Mapping, Sequence

from fedjax_pfl import algorithms
from fedjax_pfl.errors import OptionError, arg, marked
from fedjax_pfl.sweep.group import check_seeds, slug
from fedjax_pfl.sweep.runs import RunSpec


def grid(values: dict[str, Sequence[Any]]) -> list[dict[str, Any]]:
    """Every combination of the listed values (a dict per combination)."""
    names = sorted(values)
    return [dict(zip(names, combo)) for combo in itertools.product(*(values[n] for n in names))]


_combinations = grid          # (for the functions below, whose argument is called `grid`)


@dataclasses.dataclass
class Group:
    """Runs of one algorithm on one dataset with the same static hyperparameters: one vmapped
    program when possible (`run_group`). `traced` lists the traced combinations (each run is one
    of them with one seed); `resolved` every hyperparameter of each of them."""

    dataset: str
    algo: str
    cfg: Any                          # runner.RunConfig with the static hyperparameters set
    static: dict[str, Any]
    traced: list[dict[str, Any]]
    runs: list                        # RunSpec
    directory: str
    resolved: list[dict[str, Any]]

    def label(self, combo: dict[str, Any]) -> str:
        """The hyperparameters of one traced combination of the group, "mu=0.1 lr=0.05"."""
        return label({**self.static, **combo})

    def run_config(self, run: RunSpec):
        """The RunConfig of one run of the group: its seed and traced values on the group's
        configuration, its folder under the group's (the partition stays the group's)."""
        return dataclasses.replace(self.cfg, seed=run.seed,
                                   hparams={**self.cfg.hparams, **dict(run.traced)},
                                   out=os.path.join(self.directory, slug(run.label)),
                                   progress=False)


@dataclasses.dataclass
class Plan:
    out: str
    groups: list[Group]
    datasets: list[str]


def label(hparams: dict[str, Any]) -> str:
    """Hyperparameters as a sweep labels them: "k=v k=v" in the given order."""
    return " ".join(f"{k}={v}" for k, v in hparams.items())


def _text(value: Any) -> str:
    """A grid value as a label shows it (and run.py would read it)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return value if isinstance(value, str) else repr(value)


def check_grid_names(grid: Mapping[str, Any], algos: Sequence[str],
                     settings: Collection[str] | None = None) -> None:
    """Every grid name is a hyperparameter of at least one of `algos` (OptionError naming the
    `grid` entry otherwise; a run setting, one of `settings`, by default `RunConfig.from_options`'
    options, belongs in the sweep's `base` configuration instead)."""
    from fedjax_pfl.algorithms import COMMON_HPARAMS
    from fedjax_pfl.runner.options import DEFAULTS

    settings = set(DEFAULTS) if settings is None else set(settings)
    specs = {a: algorithms.spec(a) for a in algos}
    common_names = [hp.name for hp in COMMON_HPARAMS]
    for name in grid:
        if any(name in {hp.name for hp, _ in spec.all_hparams()} for spec in specs.values()):
            continue
        if name in settings:
            raise OptionError(f"{arg('grid')} {name}: {arg(name)} is a run setting, not an "
                              f"algorithm hyperparameter; set it in {arg('base')} (one value per "
                              "sweep)")
        own = "; ".join(f"{algo}: {', '.join(hp.name for hp in spec.hparams) or '(none)'}"
                        for algo, spec in specs.items())
        raise OptionError(f"{arg('grid')} {name}: no chosen algorithm ({', '.join(specs)}) has a "
                          f"hyperparameter {name!r}; they take {', '.join(common_names)} (all) "
                          f"and their own ({own})")


_SWITCH = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def plan_groups(base, grid: Mapping[str, Sequence[Any]], seeds: Sequence[int], out: str, *,
                folders: dict[str, str] | None = None, log=print) -> list[Group]:
    """The groups of the sweep of one configuration (`base`, a runner.RunConfig: one algorithm on
    one dataset) over `grid` ({hyperparameter: values}; values as text, as the command line
    gives them, or typed) and `seeds`, in folders OUT/DATASET/ALGO/STATIC/RUN: every run's
    configuration validated, nothing run or created.

    Grid names `base.algo` does not have are skipped (`log` says so). Scalar hyperparameters the
    algorithm uses only in arithmetic (`spec.traceable`) vary inside one group (one vmapped
    program), the others make a group per value. `folders` (folder -> run, shared by the calls
    of one sweep) catches two runs that would share a folder. OptionError naming the `grid`
    entry at fault (with the run's own error quoted).
    """
    spec = algorithms.spec(base.algo)
    dataset, algo = base.dataset, base.algo
    folders = {} if folders is None else folders
    table = {hp.name: hp for hp, _ in spec.all_hparams()}
    mine = {k: v for k, v in grid.items() if k in table}
    what = f"{algo} on {dataset}"
    skipped = sorted(set(grid) - set(mine))
    if skipped:
        log(f"{algo}: no hyperparameter {skipped}; not varied for it")

    def validated(hparams: dict, label_: str) -> dict:
        cfg = dataclasses.replace(base, hparams={**base.hparams, **hparams})
        try:
            return cfg.validate()
        except ValueError as e:
            raise OptionError(f"{arg('grid')} {label_}: {what}: {marked(e)}") from None

    typed: dict[str, list] = {}
    for name, given in mine.items():
        texts = [_text(v) for v in given]
        values = []
        for value, text in zip(given, texts):
            if table[name].type is bool and isinstance(value, str):   # run.py's switches
                value = _SWITCH.get(value.lower(), value)
            values.append(validated({name: value}, f"{name}={text}")[name])
        for i, v in enumerate(values):
            if v in values[:i]:
                raise OptionError(f"{arg('grid')} {name} lists the value {v!r} more than once "
                                  f"({texts[values.index(v)]!r} and {texts[i]!r})")
        typed[name] = values
    traced_names = {k for k, v in typed.items() if k in spec.traceable and all(
        isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)}
    static_grid = {k: v for k, v in typed.items() if k not in traced_names}
    traced_grid = {k: v for k, v in typed.items() if k in traced_names}
    groups = []
    for static in _combinations(static_grid):
        static_label = label(static)
        traced = _combinations(traced_grid)
        resolved = [validated({**static, **combo}, label({**static, **combo}) or "(none)")
                    for combo in traced]                  # every combination of the sweep
        cfg = dataclasses.replace(base, hparams={**base.hparams, **static})
        directory = os.path.join(out, dataset, algo,
                                 slug(static_label) if static_label else "default")
        runs = [RunSpec(seed, tuple(sorted(tc.items()))) for tc in traced for seed in seeds]
        for r in runs:
            folder = os.path.normpath(os.path.join(directory, slug(r.label)))
            values = " ".join(f"{k}={v!r}" for k, v in {**static, **dict(r.traced)}.items())
            run_label = f"{what} {values} seed={r.seed}".replace("  ", " ")
            if folder in folders:
                raise OptionError(f"{arg('grid')}: the runs {folders[folder]!r} and "
                                  f"{run_label!r} would share the folder {folder} (folder names "
                                  "keep 6 significant digits of each value); use values that "
                                  "differ in their first 6 significant digits")
            folders[folder] = run_label
        groups.append(Group(dataset, algo, cfg, static, traced, runs, directory, resolved))
    return groups


def plan(base, grid: Mapping[str, Sequence[Any]] | None = None, seeds: Sequence[int] = (0,), *,
         out: str, log=print) -> Plan:
    """A sweep's plan: each configuration of `base` (a runner.RunConfig or several: the
    algorithms and datasets, e.g. `RunConfig.from_options(algo=…, dataset=…, rounds=…)` for
    each) over `grid` and `seeds` (`plan_groups`), every run checked first, nothing created.
    What experiments/sweep.py plans from its flags.

        the_plan = sweep.plan([RunConfig.from_options(algo=a, rounds=30, progress=False)
                               for a in ("fedavg", "pgfed")], {"lr": [0.01, 0.05]}, [0, 1],
                              out="runs/sweep")
    """
    bases = [base] if not isinstance(base, (list, tuple)) else list(base)
    grid = dict(grid or {})
    check_seeds(seeds)
    check_grid_names(grid, list(dict.fromkeys(b.algo for b in bases)))
    groups: list[Group] = []
    folders: dict[str, str] = {}
    for b in bases:
        b.validate()
        groups += plan_groups(b, grid, seeds, out, folders=folders, log=log)
    return Plan(out, groups, list(dict.fromkeys(b.dataset for b in bases)))

