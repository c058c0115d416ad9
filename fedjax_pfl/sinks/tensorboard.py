"""TensorBoard event files under OUT/tensorboard/, without TensorFlow (`--log tensorboard`).

Written with the tensorboard package's own writer (`tensorboard.summary.writer.event_file_writer`,
the one `torch.utils.tensorboard` uses) and its protos; the test reads them back with
TensorBoard's EventAccumulator. We use it rather than tensorboardX: the tensorboard package is
kept by the TensorBoard team together with the reader, needs no TensorFlow, and is one package
(tensorboardX carries its own copy of the protos, kept by one maintainer).

Per round: one Event, step = the round, with a `simple_value` per metric. TensorBoard keeps
scalars as float32, so a value reads back rounded to float32 (metrics.jsonl keeps float64).
At the start: the configuration as JSON text (tag "config") and as hyperparameters (the
HParams dashboard), both at step first_round; at the end the summary as JSON text ("summary").

Resume: every start writes SessionLog.START at step first_round + 1 into a new event file. On
reading, TensorBoard drops events of earlier files at that step or later: the rounds after the
checkpoint that the interrupted run had logged and the resumed run computes again.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Mapping

from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.plugins.hparams import summary_v2 as hparams_summary
from tensorboard.plugins.text import summary_v2 as text_summary
from tensorboard.summary.writer.event_file_writer import EventFileWriter

from fedjax_pfl.callbacks import Callback, RoundEnd, RunStart, scalars
from fedjax_pfl.sinks import _common


class Sink(Callback):
    """Writes TensorBoard event files into OUT/tensorboard/ (view: `tensorboard --logdir OUT`)."""

    def __init__(self, out: str | None, quiet: bool = False) -> None:   # (it prints nothing)
        self.out = out
        self.writer: EventFileWriter | None = None

    def on_run_start(self, start: RunStart) -> None:
        logdir = os.path.join(_common.run_dir(self.out, start.out, "tensorboard"), "tensorboard")
        self.writer = EventFileWriter(logdir)
        restart = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
        self._write(start.first_round + 1, session_log=restart)
        text = json.dumps(start.config, indent=2, sort_keys=True, default=str)
        # Four leading spaces make the text plugin's Markdown show it as a code block.
        self._write(start.first_round, summary=text_summary.text_pb(
            "config", "\n".join("    " + line for line in text.splitlines())))
        self._write(start.first_round, summary=hparams_summary.hparams_pb(
            _common.flatten(start.config, sep="/")))
        self.writer.flush()

    def on_round_end(self, event: RoundEnd) -> None:
        values = [summary_pb2.Summary.Value(tag=k, simple_value=v)
                  for k, v in scalars(event.row).items()]
        self._write(event.round, summary=summary_pb2.Summary(value=values))
        # Flushed every round (a small write), so a TensorBoard watching the run sees it live.
        self.writer.flush()

    def on_run_end(self, summary: Mapping[str, Any]) -> None:
        if self.writer is None:
            return
        text = json.dumps(summary, indent=2, sort_keys=True, default=str)
        self._write(int(summary.get("last_completed_round", 0)), summary=text_summary.text_pb(
            "summary", "\n".join("    " + line for line in text.splitlines())))
        self.writer.close()
        self.writer = None

    def _write(self, step: int, **fields: Any) -> None:
        self.writer.add_event(event_pb2.Event(wall_time=time.time(), step=step, **fields))
