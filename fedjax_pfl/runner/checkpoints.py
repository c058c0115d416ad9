"""A run's checkpoints: what they hold besides the state, which one a resume uses, and the
round-end callback that writes them.

checkpoints/round_RRRRRR/ holds the state after round R (`fedjax_pfl.checkpoint`) with the
run's progress (history, logs, counters, round keys) as its metadata. The last two are kept:
when the newest turns out damaged (its manifest does not match its files), a resume falls back
to the one before, with a message. Round r's randomness is `fold_in(round_keys, r)`, so the RNG
position is the round counter, stored with the round keys.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any, Callable

import jax
import numpy as np

from fedjax_pfl import checkpoint, core
from fedjax_pfl.callbacks import Callback, RoundEnd
from fedjax_pfl.errors import OptionError, arg
from fedjax_pfl.interrupts import compute, deferred_signals
from fedjax_pfl.runner.config import config_record, record_differences
from fedjax_pfl.runner.records import Progress

KEEP = 2                      # checkpoints kept: the newest and a fallback


class ResumeError(OptionError):
    """A run cannot resume: its configuration differs from the saved run's, its checkpoint is past
    `rounds`, or no intact checkpoint is left. The message names the setting (`errors.arg`) or
    the file."""


def _root(out: str) -> str:
    return os.path.join(out, "checkpoints")


def completed(out: str) -> list[str]:
    """The run's complete checkpoint directories, oldest first."""
    root = _root(out)
    if not os.path.isdir(root):
        return []
    return [os.path.join(root, n) for n in sorted(os.listdir(root))
            if n.startswith("round_") and checkpoint.is_complete(os.path.join(root, n))]


def latest_checkpoint(out: str) -> str | None:
    """The newest complete checkpoint directory of the run in `out` (None if there is none)."""
    done = completed(out)
    return done[-1] if done else None


def require_checkpoint(out: str) -> None:
    """ResumeError unless the run in `out` has a complete checkpoint: a resume with nothing to
    continue is refused before anything is loaded, compiled or written, so the run's files stay
    as they are."""
    if latest_checkpoint(out) is None:
        raise ResumeError(f"{arg('resume')}: {out} holds no checkpoint to continue from (it was "
                          f"made with {arg('checkpoint_every')} 0, stopped before its first "
                          "checkpoint, or its checkpoints/ was removed); start it again with "
                          f"{arg('overwrite')}")


def check_saved_config(out: str, record: dict, path: str | None = None,
                       metadata: dict | None = None) -> None:
    """ResumeError naming every setting in which the run's config.json (`record`) differs from
    the configuration the checkpoint (`path`, default the newest; its `metadata` if read) saved
    of itself: a hand-edited config.json would load the checkpoint into another configuration.
    Checked before anything is loaded or written; a checkpoint that saved no configuration (made
    before it did) is taken as it is."""
    path = path or latest_checkpoint(out)
    if path is None:
        return
    if metadata is None:
        try:
            metadata = checkpoint.read_metadata(path, check=False)
        except (checkpoint.CheckpointError, OSError, ValueError):
            return                             # (resume_point reports the damage, or falls back)
    saved = metadata.get("config")
    if not isinstance(saved, dict):
        return
    differ = record_differences(record, saved)
    if differ:
        raise ResumeError(f"{arg('resume')}: {os.path.join(out, 'config.json')} disagrees with "
                          f"the configuration its checkpoint {os.path.basename(path)} saved, in "
                          f"{', '.join(differ)} (was it edited?); restore it, or start the run "
                          f"again with {arg('overwrite')}")


def resume_point(out: str, log: Callable[[str], None] = print) -> tuple[str, dict] | None:
    """(path, metadata) of the newest checkpoint that verifies (`checkpoint.verify`: every file
    of it present with the size and checksum written at save), checked before anything is
    loaded or compiled. A damaged newest one is reported and the previous one used; None when
    the run has no checkpoint. ResumeError (naming the file) when every checkpoint is damaged."""
    done = completed(out)
    problems = []
    for path in reversed(done):
        try:
            # (several processes: each hashes a share of the files, and all agree on the verdict)
            checkpoint.verify(path, shared=True)
            return path, checkpoint.read_metadata(path)
        except (checkpoint.CheckpointError, OSError, ValueError) as e:
            problems.append(" ".join(str(e).split()))
            if len(problems) < len(done):
                log(f"checkpoint {path} is damaged ({problems[-1]}); using the one before it")
    if problems:
        raise ResumeError(f"{arg('resume')}: no intact checkpoint in {out}: {problems[0]}")
    return None


def check_fits(path: str, meta: dict, prep) -> None:
    """ResumeError unless the checkpoint at `path` (`meta` its metadata) restores into this run's
    state, checked from its metadata and host arrays before anything is compiled.

    The devices and processes that wrote it do not matter (`checkpoint.restore` places the state
    in this run's shardings). What can differ with them is the number of client slots: N is
    padded with empty clients to a multiple of the device count (`FederatedData.pad_clients`),
    so 5 clients are 6 slots on 2 devices and 5 on one; state leaves of another slot count are
    refused, naming the leaf and both layouts. A host store's rows are those of real clients
    only, which every layout has: a checkpoint written under host state placement whose device
    leaves do not depend on N (FedAvg's) restores on any device count. An init that needs
    concrete data (FedPC) has no shapes before it runs: `restore` checks them then.
    """
    program = prep.program
    if not program.traceable_init:
        return
    host = checkpoint.read_host(path)
    slots = program.num_clients
    try:
        checkpoint.check_like(path, program.checkpoint_like(host, None))
    except checkpoint.CheckpointError as e:
        raise ResumeError(f"{arg('resume')}: {e}{_layout_hint(meta, slots, prep)}") from None


def _layout_hint(meta: dict, slots: int, prep) -> str:
    """Why a checkpoint's client slots differ from this run's, when its layout says they do."""
    saved = meta.get("layout") or {}
    if "client_slots" not in saved or saved["client_slots"] == slots:
        return ""
    clients = prep.data.num_real_clients
    devices = lambda d: f"{d} device{'s' if d != 1 else ''}"
    return (f" (its {clients} clients were padded to {saved['client_slots']} slots for "
            f"{devices(saved['devices'])}, this run's to {slots} for {devices(jax.device_count())}: "
            "resume on a device count that pads them to as many)")


def save(cfg, out: str, state, prog: Progress, prep, wall: float) -> str:
    """Writes checkpoints/round_R (atomically), then removes all but the last `KEEP`. Signals
    are held back until the save and the bookkeeping are done, so an interrupt during a save
    reports the checkpoint it finished (and leaves no older one behind)."""
    path = os.path.join(_root(out), f"round_{prog.round:06d}")
    metadata = {
        "round": prog.round,
        "rng": {"next_round": prog.round,
                "round_keys": np.asarray(jax.random.key_data(prep.round_keys)).tolist(),
                "round_keys_impl": str(jax.random.key_impl(prep.round_keys))},
        "history": prog.history.rounds,
        "counters": {"train_time": prog.train_time, "eval_time": prog.eval_time,
                     "total_steps": prog.total_steps, "num_sampled": prog.num_sampled,
                     "wall_time": prog.previous_wall + wall},
        "config": config_record(cfg, prep.hparams, prep.model_name, {}),
        # (not needed to restore, which places the state for the resuming run's devices: it
        # names the layout in the one refusal a layout can cause, `check_fits`)
        "layout": {"devices": jax.device_count(), "processes": jax.process_count(),
                   "client_slots": prep.program.num_clients},
    }
    # Under --state-placement host the client rows wait in a host store: they are saved as host
    # arrays beside the device leaves (`Program.checkpoint_parts`), each process its own rows.
    tree, store = prep.program.checkpoint_parts(state)
    with deferred_signals():
        compute(checkpoint.save, path, tree, metadata=metadata,
                host=prog.host_arrays(prep.data.num_real_clients), host_local=store)
        prog.checkpoint_round = prog.round
        if jax.process_index() == 0:
            for old in completed(out)[:-KEEP]:
                shutil.rmtree(old, ignore_errors=True)
    return path


def load(path: str, like, prep) -> tuple[Any, Progress, jax.Array, int]:
    """(state, Progress, round keys, next round) from a checkpoint written by `save`."""
    meta = checkpoint.read_metadata(path)
    host = checkpoint.read_host(path)
    like = prep.program.checkpoint_like(host, like)
    state = prep.program.restored(compute(checkpoint.restore, path, like), host)
    history = core.History(prep.data.num_real_clients)
    history.rounds = [dict(r) for r in meta["history"]]
    history.best_when_sampled = np.asarray(host["best_when_sampled"], np.float64).copy()
    c = meta["counters"]
    prog = Progress(history, sampled_log=list(host["sampled"]), acc_log=list(host["accuracy"]),
                    eval_rounds=[int(r) for r in host["eval_rounds"]],
                    train_time=c["train_time"], eval_time=c["eval_time"],
                    total_steps=c["total_steps"], num_sampled=c["num_sampled"],
                    round=int(meta["round"]), checkpoint_round=int(meta["round"]),
                    previous_wall=c.get("wall_time", 0.0))
    rng = meta["rng"]
    round_keys = jax.random.wrap_key_data(np.asarray(rng["round_keys"], np.uint32),
                                          impl=rng.get("round_keys_impl") or None)
    return state, prog, round_keys, rng["next_round"]


class Checkpointer(Callback):
    """Saves a checkpoint after every `every`-th round, after the last round, and at the first
    round boundary after a scheduler's warning signal (`warning.take()`)."""

    def __init__(self, cfg, out: str, prog: Progress, prep, t_start: float, every: int,
                 warning=None, log: Callable[[str], None] = print):
        self.cfg, self.out, self.prog, self.prep = cfg, out, prog, prep
        self.t_start, self.every, self.warning, self.log = t_start, every, warning, log

    def on_round_end(self, event: RoundEnd) -> None:
        if event.state is None:                  # inside a --rounds-per-call call
            return
        warned = self.warning is not None and self.warning.take()
        due = self.every and (event.round % self.every == 0 or event.final)
        if due or warned:
            path = save(self.cfg, self.out, event.state, self.prog, self.prep,
                        time.perf_counter() - self.t_start)
            if warned:
                self.log(f"checkpoint {path} written on the scheduler's warning signal")
