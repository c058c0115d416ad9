"""What a run tells the code watching it: the round-end protocol.

The runner (`fedjax_pfl.runner.run`) calls each callback's methods in order, on the host, from the
main thread, after the round's numbers are final:

    on_run_start(RunStart)      once, after compilation and any resume, before the first new round
    on_round_end(RoundEnd)      after every round, in round order (a resumed run starts after
                                its checkpoint: rounds done after that checkpoint come again)
    on_run_end(summary)         once, with the dict written to summary.json (also when the run
                                was interrupted: summary["interrupted"] is then True)

The run's own files (metrics.jsonl, the progress bar, checkpoints, the learning curve) are
callbacks of this protocol, and a notebook passes its own with `run(cfg, callbacks=[...])`:

    class PrintAccuracy(fedjax_pfl.callbacks.Callback):
        def on_round_end(self, event):
            if "acc_mean" in event.row:
                print(event.round, event.row["acc_mean"])

The run's own writers run first, inside the block that records a round (signals wait until
it is written); the metric sinks and the caller's callbacks run after it. A callback that raises
stops the run: a KeyboardInterrupt is handled as Ctrl-C is (the rounds done are recorded and
`runner.Interrupted` is raised), any other exception propagates at once.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np


@dataclasses.dataclass(frozen=True)
class RunStart:
    """The run about to train.

    Attributes:
      out: the run directory, or None (no files are written).
      config: the resolved configuration as written to config.json (algorithm, hyperparameters,
        dataset, partition, rounds, seed, …); JSON-serialisable.
      first_round: rounds already done (0, or the checkpoint's round when resuming).
      total_rounds: the run's --rounds.
    """

    out: str | None
    config: Mapping[str, Any]
    first_round: int
    total_rounds: int


@dataclasses.dataclass(frozen=True)
class RoundEnd:
    """One finished round.

    Attributes:
      round: the round number, counted from 1.
      row: the round's metrics.jsonl row: "round", "train_loss", "client_steps", "round_time"
        and the algorithm's scalar metrics; after an evaluation also "acc_mean", "acc_std", … .
        Every value is a Python int or float.
      sampled: the round's sampled client ids, int [M].
      accuracy: per-client test accuracy [N] (NaN for clients not evaluated) when this round was
        evaluated, else None.
      state: the algorithm's state after this round when it is at hand (the last round of a
        `--rounds-per-call` call), else None. On device; do not keep references across rounds.
      final: True for the run's last round (--rounds reached, or --target-acc reached).
    """

    round: int
    row: Mapping[str, Any]
    sampled: np.ndarray
    accuracy: np.ndarray | None = None
    state: Any = None
    final: bool = False


class Callback:
    """Base class: override the methods you need; the others do nothing."""

    def on_run_start(self, start: RunStart) -> None:
        del start

    def on_round_end(self, event: RoundEnd) -> None:
        del event

    def on_run_end(self, summary: Mapping[str, Any]) -> None:
        del summary


def scalars(row: Mapping[str, Any]) -> dict[str, float]:
    """The numeric, finite-or-not metrics of a row as floats, without "round" (for sinks that
    take a flat dict of scalars)."""
    out = {}
    for k, v in row.items():
        if k == "round" or isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
            continue
        out[k] = float(v)
    return out
