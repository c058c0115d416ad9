"""One Weights & Biases run per fedjax_pfl run, offline by default (`--log wandb`).

Offline unless the user set $WANDB_MODE: the run is written to OUT/wandb/offline-run-*/ and
nothing leaves the machine; `wandb sync OUT/wandb/offline-run-*` uploads it later. The project
is $WANDB_PROJECT, else "fedjax_pfl".

What: config = the configuration record (config.json, nested as it is); every round
`callbacks.scalars(row)` with step = the round; at the end the summary (except "last", which
W&B's summary already holds as the last logged values) into the run's summary, and finish with
exit code 0, or 130 (128 + SIGINT, the shells' convention) when summary["interrupted"], which
W&B shows as a failed run.

Resume (RunStart.first_round > 0): the run id kept in OUT/wandb_run_id is reused with
resume="allow". Offline, that writes a second offline-run directory with the same id; `wandb
sync` appends it to the same run. W&B takes steps in increasing order only, so on upload it
drops rounds after the checkpoint that both the interrupted and the resumed run logged (the
interrupted run's values are kept for those).
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import wandb

from fedjax_pfl.callbacks import Callback, RoundEnd, RunStart, scalars
from fedjax_pfl.sinks import _common

ID_FILE = "wandb_run_id"
DEFAULT_PROJECT = "fedjax_pfl"
INTERRUPTED_EXIT_CODE = 130


class Sink(Callback):
    """Logs the config, per-round metrics and the summary into one W&B run."""

    def __init__(self, out: str | None, quiet: bool = False) -> None:
        self.out, self.quiet = out, quiet
        self.run: Any = None

    def on_run_start(self, start: RunStart) -> None:
        out = _common.run_dir(self.out, start.out, "wandb")
        id_file = os.path.join(out, ID_FILE)
        run_id = _common.read_id(id_file) if start.first_round > 0 else None
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
            dir=out,
            id=run_id,  # None: W&B draws a new one
            resume="allow",
            name=os.path.basename(os.path.abspath(out)),
            config=dict(start.config),
            # Read here rather than left to W&B, which reads the environment once per process.
            mode=os.environ.get("WANDB_MODE") or "offline",
            # --quiet: no banner, no sync hints (W&B's own lines on stderr)
            settings=wandb.Settings(silent=True) if self.quiet else None,
        )
        _common.write_id(id_file, self.run.id)

    def on_round_end(self, event: RoundEnd) -> None:
        self.run.log(scalars(event.row), step=event.round)

    def on_run_end(self, summary: Mapping[str, Any]) -> None:
        if self.run is None:
            return
        self.run.summary.update({k: v for k, v in summary.items() if k != "last"})
        self.run.finish(exit_code=INTERRUPTED_EXIT_CODE if summary.get("interrupted") else 0)
        self.run = None
