"""Runs an algorithm for R rounds: prepare, compile, the round loop, the report.

Phases: `prepare` (checks, data, model, algorithm, program) → compile and memory plan → rounds
(round-end callbacks: metrics.jsonl, progress bar, checkpoints, metric sinks, the caller's own)
→ report. `run` strings them together.

Resume (`RunConfig.resume`): the run continues from its newest intact checkpoint and its metrics
are identical, bit for bit on the same backend and devices, to an uninterrupted run's (round
times aside). SIGINT and SIGTERM stop a run cleanly: the rounds done are recorded
(summary.json marked interrupted) and `Interrupted` is raised.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import threading
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from fedjax_pfl import algorithms, compile_cache, compiles, core, distributed, export, models, plots
from fedjax_pfl.algorithms.engine import num_unseen
from fedjax_pfl.callbacks import Callback, RoundEnd, RunStart
from fedjax_pfl.data.build import build_federated
from fedjax_pfl.data.federated import FederatedData, label_counts
from fedjax_pfl.errors import OptionError, arg
from fedjax_pfl.interrupts import WarningSignal, compute, deferred_signals, parse_signal, signal_name, stop_signals
from fedjax_pfl.runner import checkpoints, privacy, rundir
from fedjax_pfl.runner import options as options_lib
from fedjax_pfl.runner.checkpoints import ResumeError
from fedjax_pfl.runner.config import (
    MIN_IMAGE_SIDE,
    RunConfig,
    attack_seed_of,
    check_unseen_clients,
    config_record,
    model_name_of,
    parse_eval_clients,
    read_config,
    resume_conflicts,
)
from fedjax_pfl.runner.privacy import PrivacyPlan
from fedjax_pfl.runner.records import (
    Progress,
    eval_ids,
    malicious_of,
    record_call,
    report,
    round_row,
    round_slots,
    target_round,
    unseen_of,
)
from fedjax_pfl.runner.writers import MetricsWriter, ProgressBar


class Interrupted(KeyboardInterrupt):
    """A signal (SIGINT: Ctrl-C; SIGTERM: kill, timeout, a scheduler) stopped the run; the output
    directory records what finished.

    Attributes: `last_round` (rounds completed), `checkpoint_round` (round of the latest
    checkpoint, or None), `out` (the output directory, or None), `phase` ("compile", "rounds"),
    `signal` ("SIGINT" or "SIGTERM").
    """

    def __init__(self, last_round: int, checkpoint_round: int | None, out: str | None, phase: str,
                 signal: str = "SIGINT"):
        super().__init__(f"interrupted ({signal}) during {phase} after round {last_round}")
        self.last_round, self.checkpoint_round, self.out, self.phase, self.signal = (
            last_round, checkpoint_round, out, phase, signal)


def load_data(cfg: RunConfig) -> tuple[FederatedData, dict[str, Any]]:
    """Reads the dataset (fails fast when absent) and builds the federated split."""
    from fedjax_pfl.data import formats, sources

    device = cfg.data_placement == "device"       # otherwise the program places it
    if cfg.natural:
        return formats.load_natural(cfg.dataset, seed=cfg.seed, device=device, **cfg.data_options)
    part = cfg.partition
    # Sharded data over several processes: each process copies only its own devices' clients
    # (the others' rows stay unwritten zero pages; `ShardedData` reads only its own ranges), and
    # generates only theirs where the dataset's clients are known before its samples.
    keep = (core.sharded.clients_held_here
            if cfg.data_placement == "sharded" and jax.process_count() > 1 else None)
    options = dict(cfg.data_options)
    if keep is not None and cfg.dataset == "synthetic" and part.scheme == "natural":
        from fedjax_pfl.data import partition as partition_lib

        options["materialise"] = lambda counts: keep(
            *partition_lib.split_sizes(counts, test_fraction=part.test_fraction))
    raw = sources.load_raw(cfg.dataset, seed=cfg.seed, **options)
    n = int(np.asarray(raw.y).size)
    if part.scheme != "natural" and part.num_clients > n:
        raise OptionError(f"{arg('num_clients', 'partition')} {part.num_clients} is more than the "
                          f"{n} samples of {cfg.dataset}")
    return build_federated(raw, part, device=device, keep=keep)


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
    eval_ids: np.ndarray | None        # a fixed evaluation subset (eval_clients K), or None
    privacy: PrivacyPlan | None = None  # dp_clip: the noise multiplier and ε after each round
    compression: dict | None = None    # a CP model's or TDPFed's ranks and the rate used (`compression`)
    lora: Any = None                   # peft lora: the adapters' models.lora.LoraConfig
    frozen: Any = None                 # the model's frozen base parameters (peft lora), or None

    @property
    def poisson(self) -> bool:
        """Whether rounds are Poisson-sampled (their empty slots are logged as −1)."""
        return self.hparams.get("sampling") == "poisson"


def check_with_data(cfg: RunConfig, data: FederatedData) -> None:
    """The checks of `cfg` that need its dataset (OptionError naming the setting): a model that
    collapses the dataset's images, an `eval_clients` subset larger than the clients. `prepare`
    calls it; the sweep tool calls it for every run before the first one starts."""
    model_name = model_name_of(cfg)
    side = MIN_IMAGE_SIDE.get(model_name)
    shape = tuple(data.input_shape)
    if side and len(shape) == 3 and min(shape[:2]) < side:
        raise OptionError(f"{arg('model')} {model_name} needs images of at least {side}x{side} "
                          f"(its strided stages reduce {shape[0]}x{shape[1]} {cfg.dataset} images "
                          f"to 1x1 and it trains at chance); use {arg('model')} mlp")
    subset = parse_eval_clients(cfg.eval_clients)
    if isinstance(subset, int) and subset > data.num_real_clients:
        raise OptionError(f"{arg('eval_clients')} {subset} is more than the "
                          f"{data.num_real_clients} clients")


def prepare(cfg: RunConfig, data: FederatedData | None = None, data_info: dict | None = None) -> Prepared:
    """Phase 1: validate, turn the persistent compilation cache on (`cfg.compile_cache`), load
    the data, build the model, the algorithm and its program."""
    hparams = cfg.validate()
    compile_cache.apply(cfg.compile_cache)        # before anything compiles
    if data is None:
        data, data_info = load_data(cfg)
    elif not isinstance(data, FederatedData):
        hint = " (build_federated returns (data, info): pass the first)" if isinstance(data, tuple) else ""
        raise OptionError(f"{arg('data')} must be a fedjax_pfl.data.FederatedData, got "
                          f"{type(data).__name__}{hint}")
    else:
        algorithms.check_labels(data, "run")      # before the program places the data
    check_with_data(cfg, data)
    check_unseen_clients(cfg, hparams, data.num_real_clients)
    # Held-out clients are no part of the population a round samples (nor of the accounting's).
    trainable = data.num_real_clients - num_unseen(cfg.unseen_clients, data.num_real_clients)
    hparams, privacy_plan = privacy.plan(cfg, hparams, trainable)
    model_name = model_name_of(cfg)
    model, lora_config = build_model(cfg, model_name, data)
    algo = algorithms.get(cfg.algo, model=model, unseen_clients=cfg.unseen_clients,
                          unseen_seed=cfg.seed, attack_seed=attack_seed_of(cfg), **hparams)
    compression_used = compression(cfg, hparams, model, model_name)
    vectorised = hparams["backend"] not in core.EAGER_BACKENDS
    mesh = core.client_mesh() if vectorised else None
    placement = cfg.data_placement if vectorised else "device"   # the loop backend: on device
    state_placement = cfg.state_placement if vectorised else "device"
    program = core.Program(algo, data, mesh=mesh, jit=vectorised, state_dtype=cfg.state_dtype,
                           rounds_per_call=cfg.rounds_per_call, data_placement=placement,
                           state_placement=state_placement)
    data = program.data                           # placed by the program (padded, replicated)
    root = jax.random.key(cfg.seed)
    subset = parse_eval_clients(cfg.eval_clients)
    eval_ids = None
    if isinstance(subset, int):
        rng = np.random.default_rng(cfg.seed + 7)
        eval_ids = np.sort(rng.choice(data.num_real_clients, subset, replace=False)).astype(np.int32)
    return Prepared(cfg, hparams, data, data_info or {}, model_name, algo, program, root,
                    jax.random.fold_in(root, 1), eval_ids, privacy_plan, compression_used,
                    lora_config, model.frozen)


def build_model(cfg: RunConfig, model_name: str, data: FederatedData) -> tuple[models.Model, Any]:
    """The run's model and, with `peft` lora, its `models.lora.LoraConfig` (else None).

    `model` hf:PATH is `models.hf.model_from_hf(PATH, dtype=model_dtype)` (every weight trained
    without `peft`); a zoo name is `models.get`. With `peft` lora the model is wrapped by
    `models.lora.lora` over its initial parameters as the frozen base (the pretrained weights,
    or a zoo model's initialisation at the run's seed), so the trained state is the adapters.
    A task whose vocabulary exceeds the pretrained model's is an OptionError naming both."""
    if model_name.startswith(options_lib.HF_PREFIX):
        from fedjax_pfl.models import hf

        path = model_name[len(options_lib.HF_PREFIX):]
        model = hf.model_from_hf(path, dtype=cfg.model_dtype)
        vocab = int(hf.decoder(path, cfg.model_dtype).config.vocab_size)
        task = data.task
        needed = (task.vocab_size if task is not None and task.vocab_size else data.num_classes)
        if needed > vocab:
            raise OptionError(f"{arg('model')} {model_name} has a vocabulary of {vocab} tokens, "
                              f"the task's is {needed} ({arg('tokenizer', 'data')} "
                              f"{cfg.data_options.get('tokenizer')}): use the model's tokenizer")
    else:
        model = models.get(model_name, data.input_shape, data.num_classes, cr=cfg.model_cr,
                           conv=cfg.model_conv, task=data.task, options=cfg.model_options)
    if cfg.peft != "lora":
        return model, None
    from fedjax_pfl.models import lora

    base = model.init(jax.random.fold_in(jax.random.key(cfg.seed), 0x10A))
    example = jax.ShapeDtypeStruct((1, *data.input_shape), data.x.dtype)
    targets = [t.strip() for t in str(cfg.lora_targets).split(",") if t.strip()]
    try:
        return lora.lora(model, base, example, targets=targets, rank=int(cfg.lora_rank),
                         alpha=float(cfg.lora_alpha), dropout=float(cfg.lora_dropout))
    except ValueError as e:       # lora's messages start with the flag they are about
        flag = str(e).split()[0].lstrip("-").replace("-", "_")
        raise OptionError(str(e).replace(str(e).split()[0], arg(flag), 1)) from None


def compression(cfg: RunConfig, hparams: dict, model, model_name: str) -> dict | None:
    """The compression TDPFed's rank rule gives (`ops.cp.compression`): of the algorithm's
    `cr` (TDPFed: every weight tensor of the dense model, ndim >= 2, as `models.cp.cp_init_like`
    factors it) or of `model_cr` (cp_mlp, cp_vgg8: their CP tensors); None for neither or a
    rate of 1 (no decomposition). The record goes into config.json as "compression" (what the
    run used, beside the rate given); where a tensor's rank was clamped to 1 an OptionWarning
    says the rate used, in one line."""
    import warnings

    from fedjax_pfl.errors import OptionWarning
    from fedjax_pfl.models import cp as cp_models
    from fedjax_pfl.ops.cp import compression as rule

    if "cr" in hparams and hparams["cr"] != 1:
        name, space, cr, min_ndim = "cr", "hparams", float(hparams["cr"]), 2
    elif model_name in ("cp_mlp", "cp_vgg8") and cfg.model_cr != 1:
        name, space, cr, min_ndim = "model_cr", "", float(cfg.model_cr), 0
    else:
        return None
    params = jax.eval_shape(model.init, jax.random.key(0))   # (shapes only: nothing computed)
    leaves = jax.tree_util.tree_flatten_with_path(params, is_leaf=cp_models.is_cp)[0]
    shapes = {"/".join(str(getattr(k, "key", k)) for k in path): tuple(leaf.shape)
              for path, leaf in leaves
              if (cp_models.is_cp(leaf) if space == "" else len(leaf.shape) >= min_ndim)}
    record = {"setting": name, **rule(shapes, cr)}
    if record["clamped"]:
        clamped = record["clamped"]
        shown = ", ".join(clamped[:3]) + (", …" if len(clamped) > 3 else "")
        warnings.warn(OptionWarning(
            f"{arg(name, space)} {cr:g} would give {len(clamped)} of {len(shapes)} weight tensors "
            f"rank 0 ({shown}): they keep rank 1, so the compression used is "
            f"{record['used']:.4g}, recorded as compression.used in config.json"), stacklevel=2)
    return record


def run(cfg: RunConfig, *, data: FederatedData | None = None, data_info: dict | None = None,
        log: Callable[[str], None] = print, prepared: Prepared | None = None,
        callbacks: Sequence[Callback] = ()) -> dict[str, Any]:
    """Runs `cfg` and returns the summary (also written to `cfg.out` when it is set).

    Args:
      cfg: the run's configuration.
      data, data_info: the federated dataset when the caller already has it.
      log: where progress lines go.
      prepared: the result of `prepare(cfg, …)` when the caller already has it.
      callbacks: the caller's round-end callbacks (`fedjax_pfl.callbacks`), called after the
        run's own writers and sinks.

    With `cfg.out`, a new run first removes a previous run's files there (`rundir.check_out` is
    the gatekeeper that refuses such a directory without --overwrite); with `cfg.resume` it
    continues from the newest intact checkpoint in `cfg.out`, found and checked before anything
    is compiled or written. SIGINT or SIGTERM raises `Interrupted` after summary.json (marked
    interrupted), metrics.jsonl, client_metrics.npz and the learning curve record what finished.
    The programs the run compiles, and how many the persistent cache gave, are summary.json's
    "compile" (`compiles.record`).
    """
    with compiles.record() as compiled:
        return _run(cfg, data, data_info, log, prepared, callbacks, compiled)


def _run(cfg: RunConfig, data, data_info, log, prepared, callbacks,
         compiled: compiles.Log) -> dict[str, Any]:
    """`run`, the programs it compiles recorded in `compiled`."""
    t_start = time.perf_counter()
    prep = prepared or prepare(cfg, data, data_info)
    program = prep.program
    primary = jax.process_index() == 0       # in a multi-process run only process 0 writes
    out = cfg.out if primary else None
    if not primary:
        log = lambda *_: None
    prog = Progress(core.History(prep.data.num_real_clients))
    resume = _resume_point(cfg, prep, log)
    if out:
        if resume is None:
            rundir.clear_out(out)
        os.makedirs(out, exist_ok=True)
        if resume is None:     # a resumed run's record is rewritten once its checkpoint loaded
            _write_config(cfg, prep, out)
    phase, compile_time, plan = "compile", None, None
    own: list[Callback] = []
    started: list[Callback] = []          # callbacks whose on_run_start ran: they get on_run_end
    warning = WarningSignal(parse_signal(cfg.checkpoint_on_signal)
                            if cfg.checkpoint_on_signal else None)

    def abandoned(loss):        # the watchdog's last act when the main thread is stuck
        report(cfg, prep, prog, out, t_start, compile_time=None, plan=None, interrupted=phase,
               signal=loss.signal, compiled=compiled)

    # The label distribution is drawn while the programs compile (XLA's compile releases the
    # GIL; the figure is 1 s of the main job's start otherwise).
    figure = _Background(_draw_label_distribution, out, prep) if out else None
    if out and (cfg.checkpoint_interval() or cfg.checkpoint_on_signal):
        # orbax (0.2-0.4 s) imported beside the compile, not at the first save, which waits on it.
        _Background(importlib.import_module, "orbax.checkpoint")
    try:
        with stop_signals(), warning, distributed.on_abandon(abandoned):
            state, compile_time, plan = _compile(cfg, prep, log)
            round_keys = prep.round_keys
            if resume is not None:
                like = state if state is not None else program.abstract_sharded_state()
                state, prog, round_keys, first = checkpoints.load(resume[0], like, prep)
                assert first == prog.round, (first, prog.round)   # the RNG position is the round
                log(f"resuming from {resume[0]} (round {prog.round} of {cfg.rounds})")
                if out:
                    _write_config(cfg, prep, out)
            elif state is None:
                state = compute(program.init, jax.random.fold_in(prep.root, 0))
            own, theirs = _callbacks(cfg, prep, prog, out, t_start, warning, log, callbacks,
                                     checkpoint_dir=cfg.out)
            start = RunStart(out, _record(cfg, prep),
                             prog.round, cfg.rounds)
            for cb in own + theirs:
                cb.on_run_start(start)
                started.append(cb)
            phase = "rounds"
            state = _rounds(cfg, prep, state, round_keys, prog, own, theirs)
            if cfg.export and out:       # the final state's models (fedjax_pfl.export)
                export.export_run(prep, state, out)
            if figure is not None:
                figure.join()
    except BaseException as e:
        with deferred_signals(raise_after=False):
            # A signal, a lost process of a multi-process run, or a collective that failed
            # because its peer is gone: the same ending.
            stop = e if isinstance(e, KeyboardInterrupt) else distributed.explain(e)
            if stop is None:
                _close(own)
                raise
            fresh_start = phase == "compile" and resume is not None and prog.round == 0
            # A resume stopped while compiling: the directory keeps its previous record.
            summary = report(cfg, prep, prog, None if fresh_start else out, t_start,
                             compile_time=None, plan=None, interrupted=phase,
                             signal=signal_name(stop), compiled=compiled)
            _end(started, summary)
        raise Interrupted(prog.round, prog.checkpoint_round, out, phase, signal_name(stop)) from None
    summary = report(cfg, prep, prog, out, t_start, compile_time=compile_time, plan=plan,
                     compiled=compiled)
    _end(started, summary)
    return summary


def _resume_point(cfg: RunConfig, prep: Prepared, log) -> tuple[str, dict] | None:
    """The checkpoint a resume starts from, checked before anything is compiled or written:
    the flags agree with the saved run's, the checkpoint verifies (or an older one does), it
    is not past --rounds, and its state's shapes are this run's (`checkpoints.check_fits`)."""
    if not (cfg.resume and cfg.out):
        return None
    if os.path.isfile(os.path.join(cfg.out, "config.json")):
        conflict = resume_conflicts(cfg, prep.hparams, prep.model_name, read_config(cfg.out))
        if conflict:
            raise ResumeError(conflict)
    checkpoints.require_checkpoint(cfg.out)
    point = checkpoints.resume_point(cfg.out, log)
    assert point is not None                 # (an intact one, or ResumeError naming the damage)
    if os.path.isfile(os.path.join(cfg.out, "config.json")):  # (the one it falls back to, too)
        checkpoints.check_saved_config(cfg.out, read_config(cfg.out), *point)
    if int(point[1]["round"]) > cfg.rounds:
        raise ResumeError(f"{arg('rounds')} {cfg.rounds} is less than the {point[1]['round']} "
                          f"rounds the checkpoint {point[0]} has done")
    checkpoints.check_fits(point[0], point[1], prep)      # (any device or process count fits)
    return point


def _record(cfg: RunConfig, prep: Prepared) -> dict:
    """config.json's record: `config_record`, with the compression used where a rank rule set it."""
    record = config_record(cfg, prep.hparams, prep.model_name, prep.data_info)
    if prep.compression is not None:
        record["compression"] = prep.compression
    return record


def _write_config(cfg: RunConfig, prep: Prepared, out: str) -> None:
    rundir.write_json(os.path.join(out, "config.json"), _record(cfg, prep))


def _compile(cfg: RunConfig, prep: Prepared, log):
    """Phase 2: (state or None, compile seconds, memory plan). An init that needs concrete data
    (FedPC's host-side graph: its shapes are known after init) runs first."""
    program = prep.program
    state = None
    if not program.traceable_init:
        state = compute(program.init, jax.random.fold_in(prep.root, 0))
    compile_time = 0.0
    if not program.is_compiled:                   # a reused Prepared is compiled already
        if cfg.progress:
            log(f"compiling {cfg.algo}'s round and evaluation (XLA; a large model can take "
                "minutes; Ctrl-C stops cleanly)")
        compile_time = compute(program.compile, prep.round_keys)
    plan = program.memory_plan()
    if cfg.progress or cfg.memory_check:
        log(plan.describe())
    if cfg.memory_check:
        core.check_memory(plan)
    return state, compile_time, plan


def _callbacks(cfg, prep, prog, out, t_start, warning, log, extra, checkpoint_dir=None):
    """(the run's own writers, run inside the signal-deferred record of each call; the metric
    sinks and the caller's callbacks, run after it)."""
    own: list[Callback] = []
    if out:
        own.append(MetricsWriter(out, prog.history.rounds))
    if cfg.progress and jax.process_index() == 0:
        own.append(ProgressBar())
    # Every process of a multi-process run checkpoints (each writes its own shards of the state;
    # process 0 writes the rest and commits: checkpoint.save), into the run's directory.
    ckpt = checkpoint_dir or out
    every = cfg.checkpoint_interval() if ckpt else 0
    if ckpt and (every or cfg.checkpoint_on_signal):
        own.append(checkpoints.Checkpointer(cfg, ckpt, prog, prep, t_start, every, warning, log))
    theirs: list[Callback] = []
    if cfg.log and jax.process_index() == 0:
        from fedjax_pfl import sinks

        theirs += sinks.make(sinks.parse_log_flag(",".join(cfg.log)), out, quiet=not cfg.progress)
    return own, theirs + list(extra)


def _end(callbacks: Sequence[Callback], summary: dict) -> None:
    for cb in callbacks:
        cb.on_run_end(summary)


def _close(callbacks: Sequence[Callback]) -> None:
    for cb in callbacks:
        close = getattr(cb, "close", None)
        if close is not None:
            close()


class _Background:
    """`fn(*args)` in a daemon thread from now; `join()` waits for it and raises what it
    raised. An interrupted run never joins it (a figure is no reason to wait)."""

    def __init__(self, fn: Callable, *args):
        self._error: BaseException | None = None

        def run():
            try:
                fn(*args)
            except BaseException as e:     # (re-raised in the caller's thread by join)
                self._error = e

        self._thread = threading.Thread(target=run, name=fn.__name__, daemon=True)
        self._thread.start()

    def join(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error


_MAX_LABEL_CELLS = 4_000_000


def _draw_label_distribution(out: str, prep: Prepared) -> None:
    path = os.path.join(out, "label_distribution.png")
    data = prep.data
    # A clients × classes heatmap of a large natural dataset (Stack Overflow: 342,477 × 10,004)
    # would not fit in memory nor say anything; `experiments/prepare.py --plots` draws its
    # distributions instead.
    if data.num_real_clients * data.num_classes > _MAX_LABEL_CELLS:
        return
    if not os.path.exists(path):
        plots.plot_label_distribution(label_counts(data, "all")[: data.num_real_clients], path,
                                      title=f"{prep.cfg.dataset}: {prep.cfg.partition.scheme} partition")


def _rounds(cfg: RunConfig, prep: Prepared, state, round_keys, prog: Progress,
            own: Sequence[Callback], theirs: Sequence[Callback]):
    """Phase 3: the rounds from `prog.round` to `cfg.rounds`, evaluated every --eval-every."""
    program, n_real = prep.program, prep.data.num_real_clients
    evaluation = core.CachedEvaluation(program)    # personalised models: only the changed ones
    r = prog.round
    while r < cfg.rounds:
        count = min(cfg.rounds_per_call, cfg.rounds - r)
        t0 = time.perf_counter()
        state, per_round = compute(program.run_rounds, state, round_keys, r, count)
        call_time = time.perf_counter() - t0
        rows = []
        for i, m in enumerate(per_round):
            evaluation.changed(np.asarray(m["sampled"]))
            sampled = round_slots(m, n_real, prep.poisson)
            row = round_row(r + i + 1, m, call_time / count, n_real if prep.poisson else None)
            if prep.privacy is not None:
                row["dp_epsilon"] = prep.privacy.epsilons[r + i]
            rows.append((row, sampled))
        evals = ids = None
        eval_time = 0.0
        if (r + count) % cfg.eval_every == 0 or r + count == cfg.rounds:
            t1 = time.perf_counter()
            ids = eval_ids(prep, rows[-1][1], final=r + count == cfg.rounds)
            evals = compute(evaluation, state, ids)
            eval_time = time.perf_counter() - t1
        events = []
        # Everything of this call is on the host: record it (no signal can split it).
        with deferred_signals():
            recorded = record_call(prog, rows, evals, ids, eval_time, r, n_real,
                                   unseen=unseen_of(prep), malicious=malicious_of(prep))
            reached = evals is not None and target_round(cfg, [rows[-1][0]]) is not None
            r += count
            for i, (row, sampled, accuracy) in enumerate(recorded):
                last = i == len(recorded) - 1
                events.append(RoundEnd(row["round"], row, sampled, accuracy,
                                       state if last else None,
                                       last and (r == cfg.rounds or reached)))
                for cb in own:
                    cb.on_round_end(events[-1])
        for event in events:
            for cb in theirs:
                cb.on_round_end(event)
        if reached:
            break
    return state
