"""Sweeps: many runs of one algorithm on one dataset as ONE compiled, vmapped program.

Runs that differ only in their seed (model initialisation and client sampling) and in scalar
hyperparameters that the algorithm uses only in arithmetic (`AlgorithmSpec.traceable`: lr, μ,
λ, β, …) share every shape, so `VectorProgram` stacks their states along a leading "run" axis
and vmaps init, round and evaluation over it: one compile for the whole group, and vectorised
work across runs. The hyperparameters enter the traced program as arrays: the algorithm factory
is called inside the trace with them (`spec.build(model, {…, "lr": <tracer>})`).

With several devices the runs are split across them (each device holds whole runs; the clients of
a run are not split further), so V runs on D devices need no communication at all.

Run v uses the keys of a plain run with --seed seeds[v]: fold_in(key(seed), 0) for init and
fold_in(key(seed), 1) folded with the round for rounds, so a vmapped run of one seed reproduces
`runner.run` with that seed. The data (partition) is shared by all runs of a group.

What the command lines do with it, as library calls: `run_seeds` (run.py --seeds: one
configuration over several seeds, OUT/seed=S/ and their mean ± std, `seeds_summary`,
`seeds_table`), `plan` / `plan_groups` (experiments/sweep.py's groups, folders and labels, every
run checked first) and `group_results` / `results_table` / `write_results` (its results.md,
results.json and curves.png).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from typing import Any, Collection, Mapping, Sequence

import jax
import jax.numpy as jnp

from fedjax_pfl import algorithms, core
from fedjax_pfl.errors import OptionError, arg, marked

Params = Any


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One run of a group: its seed and the values of the traced hyperparameters."""

    seed: int
    traced: tuple[tuple[str, float], ...] = ()

    @property
    def label(self) -> str:
        hp = " ".join(f"{k}={v:g}" for k, v in self.traced)
        return f"{hp} seed={self.seed}".strip()


def grid(values: dict[str, Sequence[Any]]) -> list[dict[str, Any]]:
    """Every combination of the listed values (a dict per combination)."""
    names = sorted(values)
    return [dict(zip(names, combo)) for combo in itertools.product(*(values[n] for n in names))]


_combinations = grid          # (for the functions below, whose argument is called `grid`)


class VectorProgram:
    """V runs of `algo_name` on `data` stacked along a leading axis (see the module docstring).

    Args:
      algo_name: a registered algorithm.
      model: the model.
      data: the federated dataset (shared by all runs).
      static_hparams: hyperparameters common to all runs (validated here).
      runs: the runs; the names in each run's `traced` must be in the algorithm's `traceable`.
      devices: split the runs over all devices (True) or run on one (False).
    """

    def __init__(self, algo_name: str, model, data, static_hparams: dict, runs: Sequence[RunSpec],
                 devices: bool = True):
        self.spec = algorithms.spec(algo_name)
        traced_names = sorted({k for r in runs for k, _ in r.traced})
        for r in runs:
            if sorted(k for k, _ in r.traced) != traced_names:
                raise ValueError("every run of a group must set the same traced hyperparameters")
        bad = [k for k in traced_names if k not in self.spec.traceable]
        if bad:
            raise ValueError(f"{algo_name} cannot vary {bad} inside one program (traceable: "
                             f"{list(self.spec.traceable)}); run those values one after another")
        # Every concrete combination is validated like a normal run before anything is traced.
        for r in runs:
            self.resolved = self.spec.resolve({**static_hparams, **dict(r.traced)})
        if self.resolved["backend"] in core.EAGER_BACKENDS:
            raise ValueError("a vectorised sweep needs --backend chunked or vmap")
        self.model, self.runs, self.traced_names = model, list(runs), traced_names
        self.static = {k: v for k, v in self.resolved.items() if k not in traced_names}
        n_dev = len(jax.devices()) if devices else 1
        self.mesh = core.client_mesh() if n_dev > 1 else None
        self.num_runs = len(runs)
        self.padded = -(-self.num_runs // n_dev) * n_dev     # whole runs per device
        order = list(range(self.num_runs)) + [self.num_runs - 1] * (self.padded - self.num_runs)
        self.seeds = jnp.asarray([runs[i].seed for i in order], jnp.uint32)
        self.hp = {k: jnp.asarray([dict(runs[i].traced)[k] for i in order], jnp.float32)
                   for k in traced_names}
        if self.resolved["sampling"] == "poisson":       # an empty client for unused slots
            data = data.pad_clients(1, minimum=1)
        # (a dataset loaded for host placement arrives as NumPy: on device once, not every call)
        self.data = core.prepare_data(data, self.mesh) if self.mesh is not None else jax.device_put(data)
        self._round = self._per_device(self._round_all)
        self._init = self._per_device(self._init_all)
        self._evaluate = self._per_device(self._evaluate_all)
        self._jit_round = jax.jit(self._round, donate_argnums=0)
        self._jit_init = jax.jit(self._init)
        self._jit_evaluate = jax.jit(self._evaluate)

    def _make(self, hp: dict) -> algorithms.Algorithm:
        """The algorithm with traced hyperparameters (inside the trace); clients of a run stay on
        the run's device (inside the shard_map over runs the clients axis is split by hand, so
        the client mapper runs on one device: `core.layout.context_mesh`)."""
        return self.spec.build(self.model, {**self.static, **hp})

    def _per_device(self, fn):
        """fn over the local runs [V/D, ...]; with a mesh, each device takes a block of runs."""
        if self.mesh is None:
            return fn
        runs = jax.sharding.PartitionSpec("clients")
        whole = jax.sharding.PartitionSpec()

        def sharded(*args):
            return jax.shard_map(fn, mesh=self.mesh, in_specs=(runs,) * (len(args) - 1) + (whole,),
                                 out_specs=runs, check_vma=False)(*args)
        return sharded

    def _init_all(self, seeds, hp, data):
        def one(seed, hp):
            return self._make(hp).init(jax.random.fold_in(jax.random.key(seed), 0), data)
        return jax.vmap(one)(seeds, hp)

    def _round_all(self, state, seeds, hp, r, data):
        def one(state, seed, hp, r):
            keys = jax.random.fold_in(jax.random.key(seed), 1)
            return self._make(hp).round_fn(state, data, jax.random.fold_in(keys, r))
        return jax.vmap(one)(state, seeds, hp, r)

    def _evaluate_all(self, state, hp, data):
        return jax.vmap(lambda s, hp: self._make(hp).evaluate(s, data))(state, hp)

    def init(self) -> Params:
        return self._jit_init(self.seeds, self.hp, self.data)

    def run_round(self, state: Params, r: int) -> tuple[Params, list[dict]]:
        """Round r of every run; returns the state and each run's metrics (host numpy)."""
        rounds = jnp.full(self.padded, r, jnp.int32)
        state, metrics = self._jit_round(state, self.seeds, self.hp, rounds, self.data)
        metrics = core.to_host(metrics)
        return state, [jax.tree.map(lambda a: a[v], metrics) for v in range(self.num_runs)]

    def evaluate(self, state: Params) -> list[dict]:
        evals = core.to_host(self._jit_evaluate(state, self.hp, self.data))
        return [jax.tree.map(lambda a: a[v], evals) for v in range(self.num_runs)]


def run_group(cfg, runs: Sequence[RunSpec], *, data, data_info: dict, out: str | None,
              log=print, progress: bool = True) -> list[dict]:
    """Runs `runs` of `cfg` (a runner.RunConfig; cfg.seed is ignored, each run has its own) as one
    vmapped program and writes, per run, OUT/<run label>/{metrics.jsonl, summary.json}.
    Returns each run's summary (best/last metrics, as runner.run's)."""
    import json
    import os
    import time

    from fedjax_pfl import models, runner

    hparams = cfg.validate()
    if cfg.target_acc is not None:
        raise OptionError(f"{arg('target_acc')} stops one run; the runs of a sweep share one "
                          "program")
    program_hparams, hparams, plans = _privacy_plans(cfg, hparams, runs, data.num_real_clients)
    model_name = cfg.model or runner.DEFAULT_MODEL.get(cfg.dataset, "mlp")
    model = models.get(model_name, data.input_shape, data.num_classes, cr=cfg.model_cr,
                       conv=cfg.model_conv, task=data.task,
                       options=cfg.model_options)
    t0 = time.perf_counter()
    program = VectorProgram(cfg.algo, model, data, program_hparams, runs)
    state = program.init()
    histories = [core.History(data.num_real_clients) for _ in runs]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.rounds, desc="rounds", unit="round", dynamic_ncols=True)
    compile_time = None
    n_real, poisson = data.num_real_clients, hparams["sampling"] == "poisson"
    for r in range(cfg.rounds):
        t1 = time.perf_counter()
        state, metrics = program.run_round(state, r)
        round_time = time.perf_counter() - t1
        if compile_time is None:
            compile_time = round_time
        evals = None
        if (r + 1) % cfg.eval_every == 0 or r + 1 == cfg.rounds:
            evals = program.evaluate(state)
        for v, m in enumerate(metrics):
            row = runner.round_row(r + 1, m, round_time / len(runs), n_real if poisson else None)
            if plans[v] is not None:
                row["dp_epsilon"] = plans[v].epsilons[r]
            if evals is not None:
                runner.record_evaluation(row, evals[v], None, n_real, histories[v],
                                         runner.round_slots(m, n_real, poisson))
            histories[v].append(row)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    wall = time.perf_counter() - t0
    summaries = []
    for spec, history, plan in zip(runs, histories, plans):
        summary = {"algo": cfg.algo, "dataset": cfg.dataset, "model": model_name,
                   "rounds": cfg.rounds, "seed": spec.seed, "traced": dict(spec.traced),
                   "clients": data.num_real_clients, **history.best_and_last(),
                   "vectorised_runs": len(runs), "group_wall_time_s": wall,
                   "group_first_round_s": compile_time}
        comm = runner.communication_totals(history.rounds)
        if comm:
            summary["communication"] = comm
        if plan is not None:
            summary["privacy"] = plan.record(cfg.rounds)
            summary["dp_epsilon"] = summary["privacy"]["dp_epsilon"]
        if out and jax.process_index() == 0:      # a multi-process run: process 0 writes
            run_dir = os.path.join(out, slug(spec.label))
            os.makedirs(run_dir, exist_ok=True)
            with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
                for row in history.rounds:
                    f.write(json.dumps(row) + "\n")
            config = runner.config_record(cfg, {**hparams, **dict(spec.traced)}, model_name, data_info)
            config["seed"] = spec.seed
            runner.write_json(os.path.join(run_dir, "config.json"), config)
            runner.write_json(os.path.join(run_dir, "summary.json"), summary)
        summaries.append({**summary, "rows": history.rounds})
    return summaries


def check_seeds(seeds: Sequence[int], *, target_acc: float | None = None) -> None:
    """Each seed an integer in [0, 2**32) and none listed twice (two runs of one seed would share
    one seed_S directory and count twice in the mean ± std); several seeds with a `target_acc`
    are refused (it stops one run, and the seeds run as one program). OptionError naming
    `seeds`."""
    for seed in seeds:
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
            raise OptionError(f"{arg('seeds')} must be in [0, 2**32), got {seed!r}")
    repeated = sorted({s for s in seeds if list(seeds).count(s) > 1})
    if repeated:
        raise OptionError(f"{arg('seeds')} lists seed {repeated[0]} more than once; each seed "
                          "is one run")
    if len(seeds) > 1 and target_acc is not None:
        raise OptionError(f"{arg('target_acc')} stops one run; {arg('seeds')} runs several as "
                          f"one program (run the seeds one by one with {arg('seed')} to stop "
                          "each at the target)")


# The metrics of the seeds' aggregate: mean ± std over the seeds of the best and the last round.
SEED_METRICS = ("acc_mean", "acc_weighted", "acc_worst10", "global_acc_mean")


def seeds_summary(seeds: Sequence[int], summaries: Sequence[dict]) -> dict[str, Any]:
    """The aggregate of several seeds' runs (what OUT/summary.json of `run_seeds` holds): the
    seeds, and for each of `SEED_METRICS` at the best and the last round ("best_acc_mean", …)
    its mean, std (NumPy's, ddof 0) and per-seed values, over the runs that report it."""
    import numpy as np

    aggregate: dict[str, Any] = {"seeds": list(seeds), "runs": [s["seed"] for s in summaries]}
    for kind in ("best", "last"):
        for key in SEED_METRICS:
            values = [s[kind][key] for s in summaries if key in s[kind]]
            if values:
                aggregate[f"{kind}_{key}"] = {"mean": float(np.mean(values)),
                                              "std": float(np.std(values)), "values": values}
    return aggregate


def seeds_table(aggregate: dict[str, Any]) -> list[str]:
    """The aggregate as lines of text: per metric, last and best round as mean ± std."""
    lines = []
    for key in SEED_METRICS:
        if f"last_{key}" in aggregate:
            last, best = aggregate[f"last_{key}"], aggregate[f"best_{key}"]
            lines.append(f"  {key:<22} last {last['mean']:.4f} ± {last['std']:.4f}   "
                         f"best {best['mean']:.4f} ± {best['std']:.4f}")
    return lines


def run_seeds(cfg, seeds: Sequence[int], *, data=None, data_info: dict | None = None,
              progress: bool | None = None) -> tuple[dict[str, Any], list[dict]]:
    """`cfg` once per seed, as one vmapped program (`run_group`; the partition comes from
    cfg.seed, so every seed sees the same clients): what `run.py --seeds S1 S2 …` runs.

    With cfg.out, a previous run's files there are removed first (as `runner.run` does), each
    seed's run writes OUT/seed_S/ and the aggregate (`seeds_summary`: mean ± std over the seeds)
    goes to OUT/summary.json. `data`, `data_info`: the federated dataset when the caller has
    it (else `runner.load_data(cfg)`); `progress`: a progress bar (default cfg.progress).

    Returns (the aggregate, each seed's summary as `run_group` returns it).
    """
    from fedjax_pfl import runner

    check_seeds(seeds, target_acc=cfg.target_acc)
    if data is None:
        data, data_info = runner.load_data(cfg)
    primary = jax.process_index() == 0             # a multi-process run: process 0 writes
    if cfg.out and primary:
        runner.clear_out(cfg.out)
    summaries = run_group(cfg, [RunSpec(s) for s in seeds], data=data, data_info=data_info or {},
                          out=cfg.out, progress=cfg.progress if progress is None else progress)
    aggregate = seeds_summary(seeds, summaries)
    if cfg.out and primary:
        runner.write_json(os.path.join(cfg.out, "summary.json"), aggregate)
    return aggregate, summaries


def _privacy_plans(cfg, hparams: dict[str, Any], runs: Sequence[RunSpec], num_clients: int):
    """(the hyperparameter overrides the program is built with, their resolved values, each run's
    `runner.privacy.PrivacyPlan` or None): ε after every round of each private run, at its own clipping norm and noise
    multiplier (traced or not; ε depends on z, M, N, the rounds and δ). --target-epsilon gives
    every run the one noise multiplier it calls for, which then cannot vary inside the group."""
    from fedjax_pfl.runner import privacy

    overrides = dict(cfg.hparams)
    untargeted = cfg
    if cfg.target_epsilon is not None:
        if any("dp_noise_multiplier" in dict(r.traced) for r in runs):
            raise OptionError(f"{arg('target_epsilon')} sets the noise multiplier; it cannot "
                              "also vary in the sweep")
        first, _ = privacy.plan(cfg, {**hparams, **dict(runs[0].traced)}, num_clients)
        overrides["dp_noise_multiplier"] = first["dp_noise_multiplier"]
        hparams = {**hparams, "dp_noise_multiplier": first["dp_noise_multiplier"]}
        untargeted = dataclasses.replace(cfg, target_epsilon=None)
    by_values = {}                 # runs that differ only in their seed share one accounting
    for r in runs:
        if r.traced not in by_values:
            _, plan = privacy.plan(untargeted, {**hparams, **dict(r.traced)}, num_clients)
            by_values[r.traced] = plan if plan is None else dataclasses.replace(
                plan, target_epsilon=cfg.target_epsilon)
    return overrides, hparams, [by_values[r.traced] for r in runs]


def slug(label: str) -> str:
    import re

    return re.sub(r"[^a-z0-9.=_-]+", "_", label.lower()).strip("_") or "run"


# -- a sweep's plan: groups, folders, labels ---------------------------------------------------


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


# -- the results table ----------------------------------------------------------------------------


def _stat(values) -> str:
    import numpy as np

    values = [v for v in values if v is not None]
    if not values:
        return "–"
    return f"{100 * np.mean(values):.2f} ± {100 * np.std(values):.2f}"


def result_row(dataset: str, algo: str, label_: str, summaries: Sequence[dict]) -> dict:
    """One row of a sweep's table: the runs of one (dataset, algorithm, hyperparameters), mean ±
    std over their seeds of the best and last mean client accuracy (%), the last worst-10 % and
    global accuracy, and, for private runs, ε after the last round at δ."""
    get = lambda kind, key: [s[kind].get(key) for s in summaries]  # noqa: E731
    return {"dataset": dataset, "algo": algo, "hparams": label_ or "defaults",
            "seeds": len(summaries),
            "best": _stat(get("best", "acc_mean")), "last": _stat(get("last", "acc_mean")),
            "worst10": _stat(get("last", "acc_worst10")),
            "global": _stat(get("last", "global_acc_mean")), **_privacy_columns(summaries)}


def _privacy_columns(summaries) -> dict:
    """A private group's ε at δ after its last round (the same for every seed: ε depends on the
    noise multiplier, the clients per round, N, the rounds and δ); None: no noise, no bound."""
    if not any("privacy" in s for s in summaries):
        return {}
    eps = [s["privacy"]["dp_epsilon"] for s in summaries]
    return {"dp_epsilon": None if None in eps else max(eps),
            "dp_delta": summaries[0]["privacy"]["delta"]}


def group_results(group: Group, summaries: Sequence[dict]) -> tuple[list[dict], dict[str, list]]:
    """(one `result_row` per traced combination of `group`, each combination's runs' metrics
    rows by its curve name) from the group's run summaries (`run_group`'s, rows included)."""
    rows, curves = [], {}
    for tc in group.traced:
        name_ = group.label(tc)
        cell = [s for s in summaries if s["traced"] == tc]
        rows.append(result_row(group.dataset, group.algo, name_, cell))
        curves[f"{group.dataset} {group.algo} {name_}".strip()] = [s["rows"] for s in cell]
    return rows, curves


def results_table(rows: Sequence[dict]) -> str:
    """The rows as results.md: a Markdown table, with an ε column when any run is private."""
    private = any("dp_delta" in r for r in rows)
    eps = lambda r: ("—" if "dp_delta" not in r else "∞" if r["dp_epsilon"] is None  # noqa: E731
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
    return "\n".join(lines) + "\n"


def write_results(out: str, rows: Sequence[dict], curves: dict[str, list]) -> None:
    """OUT/results.md (`results_table`), OUT/results.json (the rows) and OUT/curves.png (mean
    accuracy per round, ± std over the seeds, per curve)."""
    import json

    import numpy as np

    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(results_table(rows))
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(list(rows), f, indent=2)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for name_, runs in curves.items():
        series = [[(r["round"], r["acc_mean"]) for r in rows_ if "acc_mean" in r] for rows_ in runs]
        if not series or not series[0]:
            continue
        rounds = [x for x, _ in series[0]]
        values = np.array([[y for _, y in s] for s in series if len(s) == len(rounds)])
        mean, std = values.mean(axis=0), values.std(axis=0)
        ax.plot(rounds, mean, label=name_)
        ax.fill_between(rounds, mean - std, mean + std, alpha=0.2)
    ax.set_xlabel("round")
    ax.set_ylabel("mean client test accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "curves.png"), dpi=100)
    plt.close(fig)
