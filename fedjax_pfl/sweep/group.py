"""Running a group of runs as one program (`VectorProgram`, `run_group`), and several seeds of one
configuration (`run_seeds`) with their aggregate (mean ± std over the seeds)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_pfl import compile_cache, compiles, core
from fedjax_pfl.errors import OptionError, arg
from fedjax_pfl.sweep.runs import RunSpec, stack

Params = Any


class VectorProgram:
    """V runs of `algo_name` on `data` as one `core.Program` of their stacked algorithm
    (`runs.stack`): each run's keys, and its metrics and evaluations taken apart again.

    Args:
      algo_name: a registered algorithm.
      model: the model.
      data: the federated dataset (shared by all runs).
      static_hparams: hyperparameters common to all runs (validated here).
      runs: the runs; the names in each run's `traced` must be in the algorithm's `traceable`.
      devices: split the runs over all devices (True: each device holds whole runs) or run on
        one (False).
      data_placement, state_placement, state_dtype, rounds_per_call: as `core.Program`'s (every
        placement computes the rounds of "device" bit for bit).
    """

    def __init__(self, algo_name: str, model, data, static_hparams: dict, runs: Sequence[RunSpec],
                 devices: bool = True, *, data_placement: str = "device",
                 state_placement: str = "device", state_dtype: str = "float32",
                 rounds_per_call: int = 1):
        mesh = core.client_mesh() if devices else None
        self.algo, tiled, seeds, self.padded = stack(algo_name, model, data, static_hparams, runs,
                                                     blocks=1 if mesh is None else mesh.size)
        self.runs, self.num_runs = list(runs), len(runs)
        self.program = core.Program(self.algo, tiled, mesh=mesh, state_dtype=state_dtype,
                                    rounds_per_call=rounds_per_call, data_placement=data_placement,
                                    state_placement=state_placement)
        self.clients = self.program.num_clients // self.padded      # each run's N
        roots = jax.vmap(jax.random.key)(jnp.asarray(seeds))
        # Run v's keys are a plain run's with its seed: init fold_in(key, 0), rounds fold_in(key, 1).
        self.init_keys = jax.vmap(jax.random.fold_in, (0, None))(roots, 0)
        self.round_keys = jax.vmap(jax.random.fold_in, (0, None))(roots, 1)

    def init(self) -> Params:
        return self.program.init(self.init_keys)

    def run_rounds(self, state: Params, first: int, count: int = 1) -> tuple[Params, list[list[dict]]]:
        """Rounds first … first + count − 1 of every run; returns the state and, per round, each
        run's metrics (host numpy)."""
        state, per_round = self.program.run_rounds(state, self.round_keys, first, count)
        return state, [[jax.tree.map(lambda a, v=v: a[v], m["runs"]) for v in range(self.num_runs)]
                       for m in per_round]

    def run_round(self, state: Params, r: int) -> tuple[Params, list[dict]]:
        """Round r of every run; returns the state and each run's metrics (host numpy)."""
        state, per_round = self.run_rounds(state, r, 1)
        return state, per_round[0]

    def evaluate(self, state: Params) -> list[dict]:
        """Each run's evaluation of its N clients: every run at once, or run by run where the
        program evaluates in groups of clients (client state or data off the devices)."""
        n, at = self.clients, self.program.placements
        if not (at.state.grouped or at.data.needs_participants):
            out = jax.tree.map(lambda a: np.asarray(a).reshape((self.padded, n) + a.shape[1:]),
                               self.program.evaluate(state))
            return [jax.tree.map(lambda a, v=v: a[v], out) for v in range(self.num_runs)]
        return [self.program.evaluate(state, v * n + np.arange(n)) for v in range(self.num_runs)]

    def close(self) -> None:
        """Stops the placements' background staging, if any."""
        for placement in self.program.placements:
            getattr(placement, "close", lambda: None)()


def sweep_model(cfg, data):
    """The model every run of a group shares, built as `runner.prepare` builds a run's
    (`runner.build_model`: a zoo model, `hf:PATH`, LoRA adapters over a frozen base). A zoo
    model's frozen base under `peft` lora is drawn from `cfg.seed` (--seed in the sweep's
    --common), like the partition: every seed of the sweep trains over the same base."""
    from fedjax_pfl import runner
    from fedjax_pfl.runner.loop import build_model

    return build_model(cfg, runner.model_name_of(cfg), data)[0]


def run_group(cfg, runs: Sequence[RunSpec], *, data, data_info: dict, out: str | None,
              log=print, progress: bool = True) -> list[dict]:
    """Runs `runs` of `cfg` (a runner.RunConfig; cfg.seed is ignored, each run has its own) as one
    vmapped program and writes, per run, OUT/<run label>/{metrics.jsonl, summary.json}.
    Returns each run's summary (best/last metrics, as runner.run's)."""
    import json
    import os
    import time

    from fedjax_pfl import runner
    from fedjax_pfl.runner.records import compile_record

    hparams = cfg.validate()
    compile_cache.apply(cfg.compile_cache)        # before anything compiles, as runner.prepare
    if cfg.target_acc is not None:
        raise OptionError(f"{arg('target_acc')} stops one run; the runs of a sweep share one "
                          "program")
    program_hparams, hparams, plans = _privacy_plans(cfg, hparams, runs, data.num_real_clients)
    model_name = runner.model_name_of(cfg)
    model = sweep_model(cfg, data)
    with compiles.record() as compiled:        # summary.json's "compile", as runner.run's
        t0 = time.perf_counter()
        program = VectorProgram(cfg.algo, model, data, program_hparams, runs,
                                data_placement=cfg.data_placement,
                                state_placement=cfg.state_placement, state_dtype=cfg.state_dtype,
                                rounds_per_call=cfg.rounds_per_call)
        state = program.init()
        histories = [core.History(data.num_real_clients) for _ in runs]
        bar = None
        if progress and jax.process_index() == 0:        # one voice in a multi-process run
            from tqdm.auto import tqdm

            bar = tqdm(total=cfg.rounds, desc="rounds", unit="round", dynamic_ncols=True)
        compile_time = None
        n_real, poisson = data.num_real_clients, hparams["sampling"] == "poisson"
        r = 0
        try:
            while r < cfg.rounds:
                count = min(cfg.rounds_per_call, cfg.rounds - r)
                t1 = time.perf_counter()
                state, per_round = program.run_rounds(state, r, count)
                round_time = (time.perf_counter() - t1) / count
                if compile_time is None:
                    compile_time = round_time * count
                evals = None
                if (r + count) % cfg.eval_every == 0 or r + count == cfg.rounds:
                    evals = program.evaluate(state)
                for i, metrics in enumerate(per_round):
                    last = i == count - 1
                    for v, m in enumerate(metrics):
                        row = runner.round_row(r + i + 1, m, round_time / len(runs),
                                               n_real if poisson else None)
                        if plans[v] is not None:
                            row["dp_epsilon"] = plans[v].epsilons[r + i]
                        if evals is not None and last:
                            runner.record_evaluation(row, evals[v], None, n_real, histories[v],
                                                     runner.round_slots(m, n_real, poisson))
                        histories[v].append(row)
                r += count
                if bar is not None:
                    bar.update(count)
        finally:
            program.close()
            if bar is not None:
                bar.close()
    wall = time.perf_counter() - t0
    summaries = []
    for spec, history, plan in zip(runs, histories, plans):
        summary = {"algo": cfg.algo, "dataset": cfg.dataset, "model": model_name,
                   "rounds": cfg.rounds, "seed": spec.seed, "traced": dict(spec.traced),
                   "clients": data.num_real_clients, **history.best_and_last(),
                   "vectorised_runs": len(runs), "group_wall_time_s": wall,
                   "group_first_round_s": compile_time,
                   "compile": compile_record(compiled, None, compile_cache.active())}
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
