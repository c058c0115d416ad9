"""Runs an algorithm for R rounds and writes the run's files.

    from fedjax_pfl import runner
    summary = runner.run(runner.RunConfig(algo="pgfedmo", rounds=20, out="runs/x"),
                         callbacks=[my_callback])       # fedjax_pfl.callbacks.Callback

The package by phase:
  config       RunConfig, its checks, its config.json record, what a resume may change
  options      RunConfig.from_options (run.py's rules, by option name)
  resume       resume_config: a saved run's configuration with what a resume may change
  rundir       the output directory: check_out (the gatekeeper), clear_out, atomic writes
  loop         prepare (data, model, algorithm, program), run (compile, rounds, report)
  records      per-round rows, evaluation statistics, progress, the summary
  writers      the run's own callbacks: metrics.jsonl, the progress bar
  checkpoints  which checkpoint a resume uses (verified, with a fallback), the Checkpointer
Signals (SIGINT, SIGTERM) are handled in `fedjax_pfl.interrupts`.
"""

from fedjax_pfl.data.build import PartitionConfig
from fedjax_pfl.interrupts import compute, interruptible
from fedjax_pfl.plots import plot_learning_curves
from fedjax_pfl.runner.checkpoints import ResumeError, latest_checkpoint, require_checkpoint
from fedjax_pfl.runner.config import (
                                      DEFAULT_CHECKPOINT_EVERY,
                                      DEFAULT_MODEL,
                                      MIN_IMAGE_SIDE,
                                      RESUMABLE_CHANGES,
                                      REUSABLE_CHANGES,
                                      RunConfig,
                                      config_from_record,
                                      config_record,
                                      model_name_of,
                                      parse_eval_clients,
                                      read_config,
                                      resume_conflicts,
                                      reuse_conflicts,
)
from fedjax_pfl.runner.loop import Interrupted, Prepared, check_with_data, load_data, prepare, run
from fedjax_pfl.runner.records import (
                                      NonFiniteError,
                                      best_and_last,
                                      communication_totals,
                                      participants,
                                      record_evaluation,
                                      round_row,
                                      round_slots,
)
from fedjax_pfl.runner.resume import resume_config, saved_options
from fedjax_pfl.runner.rundir import RUN_FILES, atomic, check_out, clear_out, write_json

__all__ = [
    "PartitionConfig", "compute", "interruptible", "plot_learning_curves", "ResumeError",
    "latest_checkpoint", "require_checkpoint", "DEFAULT_CHECKPOINT_EVERY", "DEFAULT_MODEL", "MIN_IMAGE_SIDE",
    "RESUMABLE_CHANGES", "REUSABLE_CHANGES", "RunConfig", "config_from_record", "config_record", "model_name_of",
    "parse_eval_clients", "read_config", "resume_conflicts", "reuse_conflicts", "Interrupted", "Prepared",
    "check_with_data", "resume_config", "saved_options",
    "load_data", "prepare", "run", "NonFiniteError", "best_and_last", "communication_totals",
    "participants", "record_evaluation", "round_row", "round_slots", "RUN_FILES", "atomic",
    "check_out", "clear_out", "write_json",
]
