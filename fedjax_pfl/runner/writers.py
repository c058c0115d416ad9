"""The run's own round-end callbacks (`fedjax_pfl.callbacks` protocol): metrics.jsonl and the
progress bar. (Checkpoints: `runner.checkpoints.Checkpointer`; metric sinks: `fedjax_pfl.sinks`.)
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Mapping

from fedjax_pfl.callbacks import Callback, RoundEnd, RunStart


class MetricsWriter(Callback):
    """metrics.jsonl: one JSON row per round, flushed at every round. At the start it holds
    exactly the rounds already done (`history`: a resumed run drops the rows of rounds done after
    its checkpoint, which are run again)."""

    def __init__(self, out: str, history: list[dict]):
        self.path = os.path.join(out, "metrics.jsonl")
        self.history = history
        self.file = None

    def on_run_start(self, start: RunStart) -> None:
        with open(self.path, "w") as f:
            for row in self.history:
                f.write(json.dumps(row) + "\n")
        self.file = open(self.path, "a")

    def on_round_end(self, event: RoundEnd) -> None:
        self.file.write(json.dumps(dict(event.row)) + "\n")
        if event.state is not None or event.final:       # once per call
            self.file.flush()

    def on_run_end(self, summary: Mapping[str, Any]) -> None:
        self.close()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


class ProgressBar(Callback):
    """A tqdm bar over rounds with the last training loss and mean accuracy. In a log file (CI)
    it redraws at most every 5 s: a redraw per round would flood the output."""

    def __init__(self):
        self.bar = None

    def on_run_start(self, start: RunStart) -> None:
        from tqdm.auto import tqdm

        interval = 0.1 if sys.stderr.isatty() else 5.0
        self.bar = tqdm(total=start.total_rounds, initial=start.first_round, desc="rounds",
                        unit="round", dynamic_ncols=True, mininterval=interval)

    def on_round_end(self, event: RoundEnd) -> None:
        row = event.row
        loss = row["train_loss"]          # None: a Poisson-sampled round without participants
        self.bar.set_postfix(loss="-" if loss is None else f"{loss:.3f}",
                             acc=f"{row['acc_mean']:.3f}" if "acc_mean" in row else "-",
                             refresh=False)
        self.bar.update(1)

    def on_run_end(self, summary: Mapping[str, Any]) -> None:
        self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
