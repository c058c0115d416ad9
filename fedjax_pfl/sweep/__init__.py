"""Sweeps: many runs of one algorithm on one dataset as ONE compiled, vmapped program.

Runs that differ only in their seed (model initialisation and client sampling) and in scalar
hyperparameters that the algorithm uses only in arithmetic (`AlgorithmSpec.traceable`: lr, μ,
λ, β, …) share every shape, so they are stacked into one algorithm of V·N clients
(`sweep.runs`) that `core.Program` runs with any placement of the data and the client state
(device, host, sharded): one compile for the whole group, vectorised work across the runs, and
with several devices whole runs on each device, no communication between them. Run v uses the
keys of a plain run with seed v, so it reproduces `runner.run` with that seed; the data
(partition) is shared by all runs of a group.

  runs     the stacked algorithm (`RunSpec`, `stack`)
  group    `VectorProgram` (the runs' program, their keys, metrics and evaluations apart),
           `run_group` (a group's runs written as runs), `run_seeds` (run.py --seeds: one
           configuration over several seeds and their mean ± std, `seeds_summary`,
           `seeds_table`)
  plan     `plan` / `plan_groups` (experiments/sweep.py's groups, folders and labels, every run
           checked first), `grid`
  results  `group_results` / `results_table` / `write_results` (results.md, results.json and
           curves.png)
"""

from fedjax_pfl.sweep.group import (
    SEED_METRICS,
    VectorProgram,
    check_seeds,
    run_group,
    run_seeds,
    seeds_summary,
    seeds_table,
    slug,
    sweep_model,
)
from fedjax_pfl.sweep.plan import Group, Plan, check_grid_names, grid, label, plan, plan_groups
from fedjax_pfl.sweep.results import group_results, result_row, results_table, write_results
from fedjax_pfl.sweep.runs import RunSpec, RunsState, stack, tiled
