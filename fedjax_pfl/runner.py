"""Runs an algorithm for R rounds: jit once, log every round, write the run's files.

Phases: `prepare` (checks, data, model, algorithm, program) → compile and memory plan → rounds
(with checkpoints) → report. `run` strings them together; `check_out` is the output directory's
gatekeeper (the CLI calls it before any computation).

Output directory:
  config.json             the resolved configuration (data, algorithm hyperparameters, versions)
  metrics.jsonl           one JSON object per round
  summary.json            best-over-rounds (accuracies, with the round) and last metrics,
                          wall/compile/round times, throughput; "interrupted" and the last
                          completed round when the run was stopped
  client_metrics.npz      per-round sampled ids and per-client accuracy (to recompute any statistic)
  learning_curve.png      accuracy and loss against rounds
  label_distribution.png  clients × classes sample counts
  checkpoints/round_RRRRRR/  the full state after round R (fedjax_pfl.checkpoint; the latest only)

Resume (`RunConfig.resume`): the run continues from its latest checkpoint and its metrics are
identical, bit for bit on the same backend and devices, to an uninterrupted run's (round times
aside). Round r's randomness is `fold_in(round_keys, r)`, so the RNG position is the round counter,
stored with the round keys in the checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import shutil
import signal
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_pfl import algorithms, checkpoint, core, models
from fedjax_pfl.data.build import PartitionConfig, build_federated, plot_label_distribution
from fedjax_pfl.data.federated import FederatedData, label_counts


class NonFiniteError(FloatingPointError):
    """Training produced NaN/Inf; the message names the round and the clients."""


class ResumeError(ValueError):
    """A run cannot resume: its flags differ from the saved run's, or its checkpoint is past
    --rounds. The message names the flag."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) stopped the run; the output directory records what finished.

    Attributes: `last_round` (rounds completed), `checkpoint_round` (round of the latest
    checkpoint, or None), `out` (the output directory, or None), `phase` ("compile", "rounds").
    """

    def __init__(self, last_round: int, checkpoint_round: int | None, out: str | None, phase: str):
        super().__init__(f"interrupted during {phase} after round {last_round}")
        self.last_round, self.checkpoint_round, self.out, self.phase = (
            last_round, checkpoint_round, out, phase)


# Files a run writes into its output directory (and removes from it when it starts afresh).
RUN_FILES = ("config.json", "metrics.jsonl", "summary.json", "client_metrics.npz",
             "learning_curve.png", "label_distribution.png", "checkpoints")
DEFAULT_CHECKPOINT_EVERY = 10
# Configuration that may change when a run is resumed (everything else must match).
# model_conv changes float rounding only (the same convolution, computed another way).
RESUMABLE_CHANGES = ("rounds", "out", "progress", "memory_check", "checkpoint_every", "resume",
                     "overwrite", "target_acc", "model_conv")
# Models whose strided stages collapse small images (8×8 digits) to 1×1: they train at chance.
MIN_IMAGE_SIDE = {"resnet9": 16, "resnet18": 16}


DEFAULT_MODEL = {"digits": "mlp", "synthetic": "logreg", "mnist": "mlp", "fashion_mnist": "mlp",
                 "emnist": "mlp", "cifar10": "cnn", "cifar100": "cnn"}


@dataclasses.dataclass
class RunConfig:
    """Everything a run needs. `hparams` holds the algorithm's hyperparameters (CLI or notebook)."""

    algo: str = "fedavg"
    dataset: str = "digits"
    model: str | None = None
    model_cr: float = 2.0
    model_conv: str = "auto"              # how convolutions are computed (models.CONV_IMPLS)
    partition: PartitionConfig = dataclasses.field(default_factory=PartitionConfig)
    rounds: int = 50
    seed: int = 0
    eval_every: int = 1
    eval_clients: str = "all"
    rounds_per_call: int = 1
    state_dtype: str = "float32"
    memory_check: bool = True
    out: str | None = None
    hparams: dict[str, Any] = dataclasses.field(default_factory=dict)
    data_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    progress: bool = True
    checkpoint_every: int | None = None   # None: every 10 rounds (a multiple of rounds_per_call)
    resume: bool = False                  # continue from the latest checkpoint in `out`
    target_acc: float | None = None       # stop after the first evaluation with acc_mean >= this

    def checkpoint_interval(self) -> int:
        """Rounds between checkpoints, also written after the last round (0: none; none either
        without `out`)."""
        if self.checkpoint_every is not None:
            return self.checkpoint_every
        k = self.rounds_per_call
        return k * max(1, math.ceil(DEFAULT_CHECKPOINT_EVERY / k))

    def validate(self) -> dict[str, Any]:
        """Checks everything that needs no data; returns the resolved algorithm hyperparameters."""
        spec = algorithms.spec(self.algo)
        for flag, value in (("--rounds", self.rounds), ("--seed", self.seed),
                            ("--eval-every", self.eval_every),
                            ("--rounds-per-call", self.rounds_per_call)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ValueError(f"{flag} must be an integer, got {value!r}")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"--seed must be in [0, 2**32), got {self.seed}")
        if self.rounds < 1:
            raise ValueError(f"--rounds must be >= 1, got {self.rounds}")
        if self.eval_every < 1:
            raise ValueError(f"--eval-every must be >= 1, got {self.eval_every}")
        if self.model is not None and self.model not in models.MODELS:
            raise ValueError(f"--model must be one of {list(models.MODELS)}, got {self.model!r}")
        if not self.model_cr >= 1:
            raise ValueError(f"--model-cr must be >= 1, got {self.model_cr}")
        if self.model_conv not in models.CONV_IMPLS:
            raise ValueError(f"--conv must be one of {list(models.CONV_IMPLS)}, got {self.model_conv!r}")
        if self.state_dtype not in core.STATE_DTYPES:
            raise ValueError(f"--state-dtype must be one of {list(core.STATE_DTYPES)}, "
                             f"got {self.state_dtype!r}")
        if self.rounds_per_call < 1:
            raise ValueError(f"--rounds-per-call must be >= 1, got {self.rounds_per_call}")
        if self.eval_every % self.rounds_per_call:
            raise ValueError(f"--eval-every {self.eval_every} must be a multiple of "
                             f"--rounds-per-call {self.rounds_per_call} (evaluation runs between calls)")
        if self.checkpoint_every is not None:
            if self.checkpoint_every < 0:
                raise ValueError(f"--checkpoint-every must be >= 0, got {self.checkpoint_every}")
            if self.checkpoint_every % self.rounds_per_call:
                raise ValueError(f"--checkpoint-every {self.checkpoint_every} must be a multiple of "
                                 f"--rounds-per-call {self.rounds_per_call} (checkpoints are written "
                                 "between calls)")
        if not math.isfinite(self.model_cr):
            raise ValueError(f"--model-cr must be finite, got {self.model_cr}")
        if self.target_acc is not None and (isinstance(self.target_acc, bool) or not isinstance(
                self.target_acc, (int, float, np.integer, np.floating)) or not 0 < self.target_acc <= 1):
            raise ValueError(f"--target-acc must be in (0, 1] (a mean client accuracy), got {self.target_acc}")
        _eval_clients(self.eval_clients)
        self.partition.validate()
        hparams = spec.resolve(self.hparams)
        for hp, flag in spec.all_hparams():
            value = hparams.get(hp.name)
            if hp.type is float and value is not None and not math.isfinite(value):
                raise ValueError(f"{flag} must be finite, got {value}")
        if self.rounds_per_call > 1 and hparams["backend"] in core.EAGER_BACKENDS:
            raise ValueError(f"--rounds-per-call needs --backend chunked or vmap (the "
                             f"{hparams['backend']} backend runs one client at a time from Python)")
        return hparams


def model_name_of(cfg: RunConfig) -> str:
    """--model, or the dataset's default model."""
    return cfg.model or DEFAULT_MODEL.get(cfg.dataset, "mlp")


def _eval_clients(value: str) -> str | int:
    """'all', 'participants', or K (a fixed random subset of K clients)."""
    value = str(value)
    if value in ("all", "participants"):
        return value
    try:
        k = int(value)
    except ValueError:
        raise ValueError(f"--eval-clients must be 'all', 'participants' or a number of clients, "
                         f"got {value!r}") from None
    if k < 1:
        raise ValueError(f"--eval-clients must be >= 1, got {k}")
    return k


def load_data(cfg: RunConfig) -> tuple[FederatedData, dict[str, Any]]:
    """Reads the dataset (fails fast when absent) and builds the federated split."""
    from fedjax_pfl.data import sources

    raw = sources.load_raw(cfg.dataset, seed=cfg.seed, **cfg.data_options)
    n = int(np.asarray(raw.y).size)
    part = cfg.partition
    if part.scheme != "natural" and part.num_clients > n:
        raise ValueError(f"--clients {part.num_clients} is more than the {n} samples of {cfg.dataset}")
    return build_federated(raw, part)


@dataclasses.dataclass
class Prepared:
    """A run after its checks: data on device, the algorithm, its compiled program."""

    cfg: RunConfig
    hparams: dict[str, Any]
    data: FederatedData
    data_info: dict[str, Any]
    model_name: str
    algo: Any
    program: core.Program
    root: jax.Array
    round_keys: jax.Array
    eval_ids: np.ndarray | None        # a fixed evaluation subset (--eval-clients K), or None


def prepare(cfg: RunConfig, data: FederatedData | None = None, data_info: dict | None = None) -> Prepared:
    """Phase 1: validate, load the data, build the model, the algorithm and its program."""
    hparams = cfg.validate()
    if data is None:
        data, data_info = load_data(cfg)
    model_name = model_name_of(cfg)
    side = MIN_IMAGE_SIDE.get(model_name)
    shape = tuple(data.input_shape)
    if side and len(shape) == 3 and min(shape[:2]) < side:
        raise ValueError(f"--model {model_name} needs images of at least {side}x{side} (its strided "
                         f"stages reduce {shape[0]}x{shape[1]} {cfg.dataset} images to 1x1 and it "
                         "trains at chance); use --model mlp")
    model = models.get(model_name, data.input_shape, data.num_classes, cr=cfg.model_cr,
                       conv=cfg.model_conv)
    algo = algorithms.get(cfg.algo, model=model, **hparams)
    vectorised = hparams["backend"] not in core.EAGER_BACKENDS
    mesh = core.client_mesh() if vectorised else None
    data = core.prepare_data(data, mesh)
    program = core.Program(algo, data, mesh=mesh, jit=vectorised, state_dtype=cfg.state_dtype,
                           rounds_per_call=cfg.rounds_per_call)
    root = jax.random.key(cfg.seed)
    subset = _eval_clients(cfg.eval_clients)
    eval_ids = None
    if isinstance(subset, int):
        if subset > data.num_real_clients:
            raise ValueError(f"--eval-clients {subset} is more than the {data.num_real_clients} clients")
        rng = np.random.default_rng(cfg.seed + 7)
        eval_ids = np.sort(rng.choice(data.num_real_clients, subset, replace=False)).astype(np.int32)
    return Prepared(cfg, hparams, data, data_info or {}, model_name, algo, program, root,
                    jax.random.fold_in(root, 1), eval_ids)


def check_out(out: str, *, overwrite: bool = False, resume: bool = False) -> None:
    """Refuses an output directory before any computation (ValueError naming --out): an
    existing file, a path that cannot be created or written, or a directory that holds another
    run's files (unless `overwrite`, which replaces them, or `resume`, which continues that run)."""
    path = os.path.abspath(out)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"--out {out} is an existing file, not a directory")
    ancestor = path
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise ValueError(f"--out {out} cannot be created: {ancestor} is a file")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out} is not writable ({ancestor} does not allow writing)")
    if resume:
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"--resume: {out} holds no run to resume (no config.json)")
        return
    if os.path.isdir(path) and os.listdir(path) and not overwrite:
        found = sorted(os.listdir(path))
        shown = ", ".join(found[:4]) + (", …" if len(found) > 4 else "")
        raise ValueError(f"--out {out} already holds files ({shown}); pass --overwrite to replace "
                         "that run's files or --resume to continue it")


def clear_out(out: str) -> None:
    """Removes a previous run's files from `out` (RUN_FILES and per-seed run directories), so
    that a new run never leaves its files mixed with stale ones."""
    if not os.path.isdir(out):
        return
    for name in os.listdir(out):
        path = os.path.join(out, name)
        if name in RUN_FILES or name.startswith("seed_") or name.startswith(".checkpoints"):
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.remove(path)


def resume_conflicts(cfg: RunConfig, hparams: dict, model_name: str, saved: dict) -> str | None:
    """The first setting of `cfg` that differs from the saved run's config.json record, as a
    one-line message naming its flag (None when the run may resume)."""
    mine = _config_record(cfg, hparams, model_name, {})
    flags = _flag_names(cfg.algo)
    for key in sorted(set(mine) | set(saved)):
        if key in RESUMABLE_CHANGES or key in ("data", "versions", "devices"):
            continue
        a, b = mine.get(key), saved.get(key)
        if isinstance(a, dict) or isinstance(b, dict):
            a, b = a or {}, b or {}
            for sub in sorted(set(a) | set(b)):
                if key == "data_options" and sub in ("data_dir", "tfds_dir", "download"):
                    continue
                if a.get(sub) != b.get(sub) and not (key == "hparams" and
                                                     _same_number(a.get(sub), b.get(sub))):
                    flag = flags.get((key, sub), f"--{sub.replace('_', '-')}")
                    return (f"--resume: the run in {cfg.out} was made with {flag} {b.get(sub)!r}, "
                            f"not {a.get(sub)!r} (only --rounds, --checkpoint-every, --target-acc, "
                            "--conv, --quiet and --no-memory-check may change)")
        elif a != b and not _same_number(a, b):
            flag = flags.get((key, None), f"--{key.replace('_', '-')}")
            return (f"--resume: the run in {cfg.out} was made with {flag} {b!r}, not {a!r} "
                    "(only --rounds, --checkpoint-every, --target-acc, --conv, --quiet and "
                    "--no-memory-check may change)")
    return None


def _same_number(a, b) -> bool:
    return (isinstance(a, (int, float)) and isinstance(b, (int, float))
            and not isinstance(a, bool) and not isinstance(b, bool) and float(a) == float(b))


def _flag_names(algo: str) -> dict:
    names = {("algo", None): "--algo", ("model", None): "--model", ("dataset", None): "--dataset",
             ("partition", "scheme"): "--partition", ("partition", "num_clients"): "--clients",
             ("partition", "seed"): "--seed"}
    try:
        for hp, flag in algorithms.spec(algo).all_hparams():
            names[("hparams", hp.name)] = flag
    except ValueError:
        pass
    return names


def read_config(out: str) -> dict:
    with open(os.path.join(out, "config.json")) as f:
        return json.load(f)


def config_from_record(record: dict) -> RunConfig:
    """The RunConfig a config.json record describes (to resume a run from its directory)."""
    fields = {f.name for f in dataclasses.fields(RunConfig)}
    kwargs = {k: v for k, v in record.items() if k in fields}
    kwargs["partition"] = PartitionConfig(**record["partition"])
    kwargs["hparams"] = dict(record.get("hparams", {}))
    return RunConfig(**kwargs)


def latest_checkpoint(out: str) -> str | None:
    """The newest complete checkpoint directory of the run in `out` (None if there is none)."""
    root = os.path.join(out, "checkpoints")
    if not os.path.isdir(root):
        return None
    done = sorted(n for n in os.listdir(root)
                  if n.startswith("round_") and checkpoint.is_complete(os.path.join(root, n)))
    return os.path.join(root, done[-1]) if done else None


# -- interrupts ---------------------------------------------------------------------------------

_INTERRUPTIBLE = threading.local()


def _compute(fn: Callable, *args, **kwargs):
    """Calls `fn`; under `interruptible()`, in a worker thread while the main thread waits, so
    that Ctrl-C reaches Python at once even during a long XLA compilation or round (the
    KeyboardInterrupt is raised here, never inside JAX or orbax)."""
    if not getattr(_INTERRUPTIBLE, "on", False):
        return fn(*args, **kwargs)
    box: dict = {}

    def target():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as e:           # handed to the main thread below
            box["error"] = e

    worker = threading.Thread(target=target, name="fedjax_pfl-compute", daemon=True)
    worker.start()
    worker.join()                            # interruptible by SIGINT (POSIX lock wait)
    if "error" in box:
        raise box["error"]
    return box["value"]


class interruptible:
    """Context manager (the CLI's): heavy calls of `run` go to a worker thread so that SIGINT
    interrupts them promptly. After an `Interrupted`, end the process with `os._exit` when
    `busy()`: a worker still inside XLA cannot be stopped, and interpreter teardown around it
    is what used to segfault."""

    def __enter__(self):
        _INTERRUPTIBLE.on = threading.current_thread() is threading.main_thread()
        return self

    def __exit__(self, *exc):
        _INTERRUPTIBLE.on = False
        return False

    @staticmethod
    def busy() -> bool:
        return any(t.name == "fedjax_pfl-compute" and t.is_alive() for t in threading.enumerate())


class _NoInterrupts:
    """Defers SIGINT while the record of an interrupted run is written (main thread only)."""

    def __enter__(self):
        self.previous = None
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        return self

    def __exit__(self, *exc):
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)
        return False


# -- the run ------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Progress:
    """What the rounds produced so far: everything a checkpoint stores besides the state."""

    history: core.History
    sampled_log: list = dataclasses.field(default_factory=list)
    acc_log: list = dataclasses.field(default_factory=list)
    eval_rounds: list = dataclasses.field(default_factory=list)
    train_time: float = 0.0
    eval_time: float = 0.0
    total_steps: int = 0
    num_sampled: int | None = None
    round: int = 0                        # rounds completed
    checkpoint_round: int | None = None   # round of the latest checkpoint
    previous_wall: float = 0.0            # wall time of earlier sessions (resumed runs)

    def host_arrays(self, n_real: int) -> dict[str, np.ndarray]:
        return {"best_when_sampled": self.history.best_when_sampled,
                "sampled": (np.stack(self.sampled_log) if self.sampled_log
                            else np.zeros((0, 0), np.int32)),
                "accuracy": (np.stack(self.acc_log) if self.acc_log
                             else np.zeros((0, n_real))),
                "eval_rounds": np.asarray(self.eval_rounds, np.int32)}


def _save_checkpoint(cfg: RunConfig, out: str, state, prog: _Progress, prep: Prepared,
                     wall: float) -> None:
    """Writes checkpoints/round_R (atomically), then removes the older ones."""
    root = os.path.join(out, "checkpoints")
    path = os.path.join(root, f"round_{prog.round:06d}")
    metadata = {
        "round": prog.round,
        "rng": {"next_round": prog.round,
                "round_keys": np.asarray(jax.random.key_data(prep.round_keys)).tolist(),
                "round_keys_impl": str(jax.random.key_impl(prep.round_keys))},
        "history": prog.history.rounds,
        "counters": {"train_time": prog.train_time, "eval_time": prog.eval_time,
                     "total_steps": prog.total_steps, "num_sampled": prog.num_sampled,
                     "wall_time": prog.previous_wall + wall},
        "config": _config_record(cfg, prep.hparams, prep.model_name, {}),
    }
    _compute(checkpoint.save, path, state, metadata=metadata,
             host=prog.host_arrays(prep.data.num_real_clients))
    prog.checkpoint_round = prog.round
    for name in os.listdir(root):
        if name.startswith("round_") and name != os.path.basename(path):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _load_checkpoint(path: str, like, prep: Prepared):
    """(state, _Progress, round keys) from a checkpoint written by `_save_checkpoint`."""
    meta = checkpoint.read_metadata(path)
    host = checkpoint.read_host(path)
    state = _compute(checkpoint.restore, path, like)
    history = core.History(prep.data.num_real_clients)
    history.rounds = [dict(r) for r in meta["history"]]
    history.best_when_sampled = np.asarray(host["best_when_sampled"], np.float64).copy()
    c = meta["counters"]
    prog = _Progress(history, sampled_log=list(host["sampled"]), acc_log=list(host["accuracy"]),
                     eval_rounds=[int(r) for r in host["eval_rounds"]],
                     train_time=c["train_time"], eval_time=c["eval_time"],
                     total_steps=c["total_steps"], num_sampled=c["num_sampled"],
                     round=int(meta["round"]), checkpoint_round=int(meta["round"]),
                     previous_wall=c.get("wall_time", 0.0))
    rng = meta["rng"]
    round_keys = jax.random.wrap_key_data(np.asarray(rng["round_keys"], np.uint32),
                                          impl=rng.get("round_keys_impl") or None)
    return state, prog, round_keys, rng["next_round"]


def run(cfg: RunConfig, *, data: FederatedData | None = None, data_info: dict | None = None,
        log: Callable[[str], None] = print, prepared: Prepared | None = None) -> dict[str, Any]:
    """Runs `cfg` and returns the summary (also written to `cfg.out` when it is set).
    `prepared` is the result of `prepare(cfg, …)` when the caller already has it.

    With `cfg.out`, a new run first removes a previous run's files there (`check_out` is the
    gatekeeper that refuses such a directory without --overwrite); with `cfg.resume` it continues
    from the latest checkpoint in `cfg.out`. Ctrl-C raises `Interrupted` after summary.json (marked
    interrupted), metrics.jsonl, client_metrics.npz and the learning curve record what finished.
    """
    t_start = time.perf_counter()
    prep = prepared or prepare(cfg, data, data_info)
    program, data = prep.program, prep.data
    primary = jax.process_index() == 0       # in a multi-process run only process 0 writes
    out = cfg.out if primary else None
    if not primary:
        log = lambda *_: None
    n_real = data.num_real_clients
    prog = _Progress(core.History(n_real))
    phase = "compile"
    state = None
    resume_from = latest_checkpoint(cfg.out) if cfg.resume and cfg.out else None
    if cfg.resume and cfg.out and os.path.isfile(os.path.join(cfg.out, "config.json")):
        conflict = resume_conflicts(cfg, prep.hparams, prep.model_name, read_config(cfg.out))
        if conflict:
            raise ResumeError(conflict)
    if out:
        if resume_from is None:
            clear_out(out)
        os.makedirs(out, exist_ok=True)
        _write_json(os.path.join(out, "config.json"),
                    _config_record(cfg, prep.hparams, prep.model_name, prep.data_info))
    try:
        init_key = jax.random.fold_in(prep.root, 0)
        if not program.traceable_init:     # e.g. FedPC's host-side graph: shapes known after init
            state = _compute(program.init, init_key)
        compile_time = 0.0                                              # phase 2: compile, plan
        if getattr(program, "_round_compiled", None) is None:   # a reused Prepared is compiled
            if cfg.progress:
                log(f"compiling {cfg.algo}'s round and evaluation (XLA; a large model can take "
                    "minutes; Ctrl-C stops cleanly)")
            compile_time = _compute(program.compile, prep.round_keys)
        plan = program.memory_plan()
        if cfg.progress or cfg.memory_check:
            log(plan.describe())
        if cfg.memory_check:
            core.check_memory(plan)
        round_keys = prep.round_keys
        if resume_from is not None:
            like = state if state is not None else program._abstract_with_shardings()
            state, prog, round_keys, first = _load_checkpoint(resume_from, like, prep)
            assert first == prog.round, (first, prog.round)     # the RNG position is the round
            if prog.round > cfg.rounds:
                raise ResumeError(f"--rounds {cfg.rounds} is less than the {prog.round} rounds the "
                                 f"checkpoint {resume_from} has done")
            log(f"resuming from {resume_from} (round {prog.round} of {cfg.rounds})")
        elif state is None:
            state = _compute(program.init, init_key)                     # phase 3: rounds
        if out:
            _start_files(out, prep, prog)
        phase = "rounds"
        state = _rounds(cfg, prep, program, state, round_keys, prog, out, log, primary, t_start)
    except KeyboardInterrupt:
        with _NoInterrupts():
            if out and os.path.isfile(os.path.join(out, "config.json")):
                if phase == "compile" and resume_from is not None and prog.round == 0:
                    # Nothing of this session ran: the directory keeps its previous record.
                    pass
                else:
                    _report(cfg, prep, prog, out, t_start, compile_time=None, plan=None,
                            interrupted=phase)
        raise Interrupted(prog.round, prog.checkpoint_round, out, phase) from None
    return _report(cfg, prep, prog, out, t_start, compile_time=compile_time, plan=plan)


def _start_files(out: str, prep: Prepared, prog: _Progress) -> None:
    """metrics.jsonl holds exactly the rounds done (a resumed run drops the rows of rounds done
    after its checkpoint: they are run again); the label distribution is drawn once."""
    with open(os.path.join(out, "metrics.jsonl"), "w") as f:
        for row in prog.history.rounds:
            f.write(json.dumps(row) + "\n")
    path = os.path.join(out, "label_distribution.png")
    if not os.path.exists(path):
        data = prep.data
        plot_label_distribution(label_counts(data, "all")[: data.num_real_clients], path,
                                title=f"{prep.cfg.dataset}: {prep.cfg.partition.scheme} partition")


def _rounds(cfg, prep, program, state, round_keys, prog: _Progress, out, log, primary, t_start):
    """Phase 3: the rounds from `prog.round` to `cfg.rounds`, with evaluation and checkpoints."""
    n_real = prep.data.num_real_clients
    # Multi-process runs: orbax would need every process to write its shards; not done yet.
    every = cfg.checkpoint_interval() if out and jax.process_count() == 1 else 0
    metrics_file = open(os.path.join(out, "metrics.jsonl"), "a") if out else None
    bar = _progress(cfg.rounds, cfg.progress and primary, initial=prog.round)
    evaluation = core.CachedEvaluation(program)    # personalised models: only the changed ones
    try:
        r = prog.round
        while r < cfg.rounds:
            count = min(cfg.rounds_per_call, cfg.rounds - r)
            t0 = time.perf_counter()
            state, per_round = _compute(program.run_rounds, state, round_keys, r, count)
            call_time = time.perf_counter() - t0
            rows = []
            for i, m in enumerate(per_round):
                row = _round_row(r + i + 1, m, call_time / count)
                sampled = np.asarray(m["sampled"])
                evaluation.changed(sampled)
                rows.append((row, sampled))
            last_row, last_sampled = rows[-1]
            evals = ids = None
            if (r + count) % cfg.eval_every == 0 or r + count == cfg.rounds:
                t1 = time.perf_counter()
                ids = _eval_ids(prep, last_sampled, final=r + count == cfg.rounds)
                evals = _compute(evaluation, state, ids)
                eval_dt = time.perf_counter() - t1
            # Everything of this call is on the host: record it (no interrupt can split it).
            with _Deferred():
                _record_call(prog, rows, evals, ids, eval_dt if evals is not None else 0.0, r, n_real,
                             metrics_file)
            if bar is not None:
                row = rows[-1][0]
                bar.set_postfix(loss=f"{row['train_loss']:.3f}",
                                acc=f"{row['acc_mean']:.3f}" if "acc_mean" in row else "-")
                bar.update(count)
            r += count
            reached = evals is not None and _target_round(cfg, [rows[-1][0]]) is not None
            if every and (r % every == 0 or r == cfg.rounds or reached):
                _save_checkpoint(cfg, out, state, prog, prep, time.perf_counter() - t_start)
            _test_pause(r)
            if reached:
                break
    finally:
        if bar is not None:
            bar.close()
        if metrics_file:
            metrics_file.close()
    return state


def _target_round(cfg: RunConfig, rows: list[dict]) -> int | None:
    """The first of these rounds whose evaluation reached --target-acc (None: none, or no target).
    Rounds-to-accuracy is how FedAvg (McMahan et al. 2017, Table 2) compares methods."""
    if cfg.target_acc is None:
        return None
    return next((row["round"] for row in rows if row.get("acc_mean", -1.0) >= cfg.target_acc), None)


def _record_call(prog: _Progress, rows, evals, ids, eval_time, r, n_real, metrics_file) -> None:
    """Adds one call's rounds (and the evaluation after its last round) to `prog` and
    metrics.jsonl."""
    prog.train_time += sum(row["round_time"] for row, _ in rows)
    for i, (row, sampled) in enumerate(rows):
        prog.num_sampled = sampled.size
        prog.total_steps += row["client_steps"]
        prog.sampled_log.append(sampled)
        if i == len(rows) - 1 and evals is not None:
            prog.eval_time += eval_time
            accuracy = _record_evaluation(row, evals, ids, n_real, prog.history, sampled)
            prog.acc_log.append(accuracy)
            prog.eval_rounds.append(r + i + 1)
        prog.history.append(row)
        if metrics_file:
            metrics_file.write(json.dumps(row) + "\n")
        prog.round = r + i + 1
    if metrics_file:
        metrics_file.flush()


class _Deferred:
    """Holds back SIGINT for the duration of the block, then raises it (main thread only)."""

    def __enter__(self):
        self.previous, self.hit = None, False
        if threading.current_thread() is threading.main_thread():
            def note(signum, frame):
                self.hit = True
            self.previous = signal.signal(signal.SIGINT, note)
        return self

    def __exit__(self, exc_type, *exc):
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)
            if self.hit and exc_type is None:
                raise KeyboardInterrupt
        return False


def _test_pause(r: int) -> None:
    """Test hook: $FEDJAX_PFL_TEST_PAUSE_AFTER_ROUND=R sleeps (up to a minute) after round R and
    its checkpoint, so that a test can signal the process at a known point."""
    at = os.environ.get("FEDJAX_PFL_TEST_PAUSE_AFTER_ROUND")
    if at and int(at) == r:
        print(f"paused after round {r}", flush=True)
        time.sleep(60)


def _report(cfg, prep, prog: _Progress, out, t_start, *, compile_time, plan,
            interrupted: str | None = None) -> dict[str, Any]:
    """Phase 4: summary.json, client_metrics.npz and the learning curve of the rounds done."""
    n_real = prep.data.num_real_clients
    wall = prog.previous_wall + time.perf_counter() - t_start
    rows = prog.history.rounds
    times = [row["round_time"] for row in (rows[1:] if len(rows) > 1 else rows)]
    per_round = float(np.median(times)) if times else float("nan")
    summary = {
        "algo": cfg.algo, "dataset": cfg.dataset, "model": prep.model_name, "rounds": cfg.rounds,
        "interrupted": interrupted is not None,
        "last_completed_round": prog.round,
        "last_checkpoint_round": prog.checkpoint_round,
        "clients": n_real, "clients_per_round": prog.num_sampled,
        "backend": prep.hparams["backend"],
        **best_and_last(rows),
        "wall_time_s": wall, "compile_time_s": compile_time, "train_time_s": prog.train_time,
        "eval_time_s": prog.eval_time, "time_per_round_s": per_round,
        "client_steps_per_s": prog.total_steps / max(prog.train_time, 1e-9),
        "devices": [str(d) for d in jax.devices()],
    }
    if interrupted is not None:
        summary["interrupted_during"] = interrupted
    if cfg.target_acc is not None:
        summary["target"] = {"acc_mean": cfg.target_acc, "round": _target_round(cfg, rows)}
    if plan is not None:
        summary["memory_plan"] = dataclasses.asdict(plan)
    communication = _communication_totals(rows)
    if communication:
        summary["communication"] = communication
    if out:
        if prog.sampled_log:
            host = prog.host_arrays(n_real)
            _atomic(os.path.join(out, "client_metrics.npz"), lambda f: np.savez_compressed(
                f, sampled=host["sampled"], eval_rounds=host["eval_rounds"],
                accuracy=host["accuracy"]))
        if rows:
            plot_learning_curves({cfg.algo: rows}, os.path.join(out, "learning_curve.png"),
                                 title=f"{cfg.algo} on {cfg.dataset}"
                                 + (f" (interrupted after round {prog.round})" if interrupted else ""),
                                 acc_keys=("acc_mean", "acc_worst10", "global_acc_mean"))
        _write_json(os.path.join(out, "summary.json"), summary)
    return summary


def best_and_last(rows: list[dict]) -> dict[str, dict]:
    """"last": every numeric metric's last value; "best": the highest value over the rounds of
    each accuracy metric only (a best round time or step count means nothing), and "best_round":
    the round where it was reached (the first, on ties)."""
    last: dict[str, float] = {}
    best: dict[str, float] = {}
    best_round: dict[str, int] = {}
    for row in rows:
        for k, v in row.items():
            if k == "round" or isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
                continue
            last[k] = v
            if _is_accuracy(k) and (k not in best or v > best[k]):
                best[k], best_round[k] = v, row["round"]
    return {"best": best, "best_round": best_round, "last": last}


def _is_accuracy(key: str) -> bool:
    return ("acc" in key and not key.endswith("_std")) or key == "participant_best_mean"


def _round_row(round_number: int, m: dict, round_time: float) -> dict[str, Any]:
    """One metrics.jsonl row from a round's metrics; stops the run on a non-finite loss."""
    sampled = np.asarray(m["sampled"])
    losses = np.asarray(m["train_loss"], np.float64)
    if not np.all(np.isfinite(losses)):
        trained = np.asarray(m.get("trained", sampled))  # TDPFed trains every client
        bad = trained[~np.isfinite(losses)].tolist()
        raise NonFiniteError(f"round {round_number}: clients {bad} have a non-finite training "
                             "loss; lower --lr or check the data")
    row: dict[str, Any] = {"round": round_number, "train_loss": float(losses.mean()),
                           "client_steps": int(m["client_steps"]), "round_time": round_time}
    row.update(_scalar_metrics(m))
    return row


def _eval_ids(prep: Prepared, sampled: np.ndarray, *, final: bool) -> np.ndarray | None:
    """The clients evaluated this time: all at the last round, else per --eval-clients."""
    if final or prep.cfg.eval_clients == "all":
        return None
    if prep.cfg.eval_clients == "participants":
        return np.asarray(sampled, np.int32)
    return prep.eval_ids


def _record_evaluation(row: dict, evals: dict, ids, n_real: int, history, sampled) -> np.ndarray:
    """Adds the evaluation statistics to `row`; returns the per-client accuracy [n_real] (NaN
    for clients not evaluated this time)."""
    client = evals["client"]
    correct, count = np.asarray(client.correct), np.asarray(client.count)
    accuracy = np.full(n_real, np.nan)
    acc = np.where(count > 0, correct / np.maximum(count, 1), np.nan)
    where = np.arange(n_real) if ids is None else np.asarray(ids)
    accuracy[where] = acc[: len(where)]
    row.update(core.summarize(client.correct, client.loss_sum, client.count))
    row["eval_clients"] = int(np.sum(count > 0))
    row.update(history.record_participants(accuracy, sampled))
    for name, ev in evals.items():
        if name != "client":
            row.update(core.summarize(ev.correct, ev.loss_sum, ev.count, prefix=f"{name}_"))
    return accuracy


def _communication_totals(rows: list[dict]) -> dict[str, float]:
    """Every per-round `comm_*` metric summed over the rounds run (floats or bits sent), and
    its per-round mean as `<name>_per_round`."""
    totals: dict[str, float] = {}
    for row in rows:
        for k, v in row.items():
            if k.startswith("comm_"):
                totals[k] = totals.get(k, 0.0) + float(v)
    out = {}
    for k, v in sorted(totals.items()):
        out[f"{k[5:]}_total"] = v
        out[f"{k[5:]}_per_round"] = v / max(len(rows), 1)
    return out


def _scalar_metrics(m: dict) -> dict[str, float]:
    """Algorithm-specific scalar metrics (everything but the standard per-client arrays)."""
    out = {}
    for k, v in m.items():
        if k in ("sampled", "trained", "train_loss", "client_steps"):
            continue
        v = np.asarray(v)
        if v.ndim == 0:
            out[k] = float(v)
    return out


def _progress(total: int, enabled: bool, initial: int = 0):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    import sys

    # In a log file (CI) a redraw per round floods the output; redraw at most every 5 s there.
    interval = 0.1 if sys.stderr.isatty() else 5.0
    return tqdm(total=total, initial=initial, desc="rounds", unit="round", dynamic_ncols=True,
                mininterval=interval)


def plot_learning_curves(runs: dict[str, list[dict]], path: str, title: str = "",
                         acc_keys: tuple[str, ...] = ("acc_mean",)) -> None:
    """Accuracy (each of `acc_keys`) and mean local training loss against rounds, for one or
    several runs (label -> per-round metric rows), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_acc, ax_loss) = plt.subplots(1, 2, figsize=(12, 4.2))
    styles = ("-", ":", "--", "-.")
    palette = plt.get_cmap("tab10" if len(runs) <= 10 else "tab20").colors
    for (label, rows), color in zip(runs.items(), palette * (1 + len(runs) // len(palette))):
        for key, style in zip(acc_keys, styles):
            pts = [(r["round"], r[key]) for r in rows if key in r]
            if pts:
                name = key if len(runs) == 1 else (label if len(acc_keys) == 1 else f"{label} {key}")
                ax_acc.plot(*zip(*pts), style, label=name,
                            color=None if len(runs) == 1 else color)
        ax_loss.plot([r["round"] for r in rows], [r["train_loss"] for r in rows], label=label,
                     color=color)
    ax_acc.set_xlabel("round")
    ax_acc.set_ylabel("client test accuracy")
    ax_acc.legend(fontsize=8)
    ax_acc.grid(alpha=0.3)
    ax_loss.set_xlabel("round")
    ax_loss.set_ylabel("mean local training loss")
    ax_loss.set_yscale("log")
    if len(runs) > 1:
        ax_loss.legend(fontsize=8)
    ax_loss.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _config_record(cfg: RunConfig, hparams: dict, model_name: str, data_info: dict) -> dict:
    record = dataclasses.asdict(cfg)
    record["hparams"] = hparams
    record["model"] = model_name
    record["data"] = data_info
    record["versions"] = {"python": platform.python_version(), "jax": jax.__version__,
                          "numpy": np.__version__}
    return record


def _write_json(path: str, obj: Any) -> None:
    """Writes JSON atomically (a temporary file renamed over `path`)."""
    def write(f):
        f.write((json.dumps(obj, indent=2, default=_json_default) + "\n").encode())
    _atomic(path, write)


def _atomic(path: str, write: Callable) -> None:
    """Calls `write(binary file)` on a temporary beside `path`, then renames it to `path`: a
    reader never sees a half-written file."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)
