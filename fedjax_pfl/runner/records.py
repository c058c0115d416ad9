"""What the rounds of a run produced: per-round rows, evaluation statistics, the progress a
checkpoint stores, and the summary."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import jax
import numpy as np

from fedjax_pfl import compile_cache, compiles, core, plots
from fedjax_pfl.core.metrics import client_spread, first_round_reaching, participation_split, rounds_trained
from fedjax_pfl.errors import MarkedError, arg
from fedjax_pfl.runner import rundir


class NonFiniteError(MarkedError, FloatingPointError):
    """Training produced NaN/Inf; the message names the round and the clients."""


@dataclasses.dataclass
class Progress:
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


def target_round(cfg, rows: list[dict]) -> int | None:
    """The first of these rounds whose evaluation reached --target-acc (None: none, or no target).
    Rounds-to-accuracy is how FedAvg (McMahan et al. 2017, Table 2) compares methods."""
    if cfg.target_acc is None:
        return None
    return next((row["round"] for row in rows if row.get("acc_mean", -1.0) >= cfg.target_acc), None)


def unseen_of(prep) -> np.ndarray | None:
    """[n_real] bool: the run's held-out clients (--unseen-clients: `engine.unseen_ids` of its
    fraction and seed), or None where it holds none out."""
    from fedjax_pfl.algorithms.engine import unseen_mask

    fraction = getattr(prep.cfg, "unseen_clients", 0.0)
    if not fraction:
        return None
    return unseen_mask(fraction, prep.cfg.seed, prep.data.num_real_clients)


def attack_of(prep) -> dict | None:
    """The run's threat model ({attack, fraction, redraw, seed}: --attack, --attack-fraction,
    --attack-redraw, the seed of the set), or None without malicious clients."""
    from fedjax_pfl.runner.config import attack_seed_of

    hp = getattr(prep, "hparams", {}) or {}
    if not hp.get("attack_fraction"):
        return None
    return {"attack": hp.get("attack", "none"), "fraction": float(hp["attack_fraction"]),
            "redraw": bool(hp.get("attack_redraw")), "seed": attack_seed_of(prep.cfg)}


def malicious_of(prep) -> np.ndarray | None:
    """[n_real] bool: the run's fixed malicious set (`engine.malicious_mask`), or None (no
    malicious clients, or a set re-drawn every round: no client stays benign)."""
    from fedjax_pfl.algorithms.engine import malicious_mask

    threat = attack_of(prep)
    if threat is None or threat["redraw"]:
        return None
    return malicious_mask(threat["fraction"], threat["seed"], prep.data.num_real_clients)


def malicious_per_round(prep, rounds: int) -> np.ndarray:
    """[R, n_real] bool: each round's malicious set under --attack-redraw, recomputed from the
    round keys as the rounds drew it (`engine.redrawn_mask`)."""
    from fedjax_pfl.algorithms.engine import redrawn_mask
    from fedjax_pfl.core.program import round_key

    threat = attack_of(prep)
    n = prep.data.num_real_clients
    return np.stack([np.asarray(redrawn_mask(round_key(prep.round_keys, r), threat["seed"],
                                             threat["fraction"], n)) for r in range(rounds)]
                    ) if rounds else np.zeros((0, n), bool)


def record_call(prog: Progress, rows, evals, ids, eval_time, r, n_real,
                unseen: np.ndarray | None = None, malicious: np.ndarray | None = None) -> list:
    """Adds one call's rounds (and the evaluation after its last round) to `prog`; returns each
    round's (row, sampled ids, per-client accuracy or None). `unseen`: the held-out clients
    (`unseen_of`), whose accuracy the evaluation's row gives apart (`record_evaluation`)."""
    prog.train_time += sum(row["round_time"] for row, _ in rows)
    recorded = []
    for i, (row, sampled) in enumerate(rows):
        prog.num_sampled = sampled.size
        prog.total_steps += row["client_steps"]
        prog.sampled_log.append(sampled)
        accuracy = None
        if i == len(rows) - 1 and evals is not None:
            prog.eval_time += eval_time
            accuracy = record_evaluation(row, evals, ids, n_real, prog.history, sampled,
                                         unseen=unseen, malicious=malicious)
            prog.acc_log.append(accuracy)
            prog.eval_rounds.append(r + i + 1)
        prog.history.append(row)
        prog.round = r + i + 1
        recorded.append((row, sampled, accuracy))
    return recorded


def report(cfg, prep, prog: Progress, out, t_start, *, compile_time, plan,
           interrupted: str | None = None, signal: str | None = None,
           compiled: compiles.Log | None = None) -> dict[str, Any]:
    """Phase 4: summary.json, client_metrics.npz and the learning curve of the rounds done.
    With `compiled` (the programs `runner.run` compiled), summary.json's "compile"
    (`compile_record`)."""
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
    if compiled is not None:
        summary["compile"] = compile_record(compiled, compile_time, compile_cache.active())
    if interrupted is not None:
        summary["interrupted_during"] = interrupted
        summary["interrupted_by"] = signal or "SIGINT"
    if cfg.target_acc is not None:
        summary["target"] = {"acc_mean": cfg.target_acc, "round": target_round(cfg, rows)}
    if plan is not None:
        summary["memory_plan"] = dataclasses.asdict(plan)
    if getattr(prep, "privacy", None) is not None:
        summary["privacy"] = prep.privacy.record(prog.round)
        summary["dp_epsilon"] = summary["privacy"]["dp_epsilon"]
    communication = communication_totals(rows)
    if communication:
        summary["communication"] = communication
    final = final_accuracy(prog)
    if final is not None:
        summary["fairness"] = {"round": final[0], **client_spread(final[1])}
    unseen = unseen_of(prep)
    if unseen is not None:
        summary["unseen"] = unseen_record(cfg, unseen, final)
    threat = attack_of(prep)
    if threat is not None:
        summary["attack"] = attack_record(threat, malicious_of(prep), rows)
    summary["cost"] = {**communication_bytes(communication),
                       **round_flops(getattr(prep, "program", None), prog.round)}
    reached = first_round_reaching(rows, CONVERGENCE_METRIC, CONVERGENCE_FRACTION)
    if reached is not None:
        summary["convergence"] = {"metric": CONVERGENCE_METRIC, "fraction": CONVERGENCE_FRACTION,
                                  "best": summary["best"][CONVERGENCE_METRIC],
                                  "threshold": reached[0], "round": reached[1]}
    if out:
        if prog.sampled_log:
            host = prog.host_arrays(n_real)
            ids = prep.data_info.get("client_ids")
            named = {} if ids is None else {"client_ids": np.asarray(ids, dtype=str)}
            trained = trained_counts(cfg, host["sampled"], n_real, len(prog.sampled_log))
            held_out = np.zeros(n_real, bool) if unseen is None else unseen
            if threat is not None:     # [n_real], or [R, n_real] where re-drawn every round
                fixed = malicious_of(prep)
                named["malicious"] = (fixed if fixed is not None
                                      else malicious_per_round(prep, len(prog.sampled_log)))
            rundir.atomic(os.path.join(out, "client_metrics.npz"), lambda f: np.savez_compressed(
                f, sampled=host["sampled"], eval_rounds=host["eval_rounds"],
                accuracy=host["accuracy"], unseen=held_out, rounds_trained=trained, **named))
        if rows:
            plots.plot_learning_curves({cfg.algo: rows}, os.path.join(out, "learning_curve.png"),
                                 title=f"{cfg.algo} on {cfg.dataset}"
                                       + (f" (interrupted after round {prog.round})" if interrupted else ""),
                                       acc_keys=("acc_mean", "acc_worst10", "global_acc_mean"))
        if final is not None and np.isfinite(final[1]).any():
            plots.plot_client_accuracy(final[1], os.path.join(out, "client_accuracy.png"),
                                       title=f"{cfg.algo} on {cfg.dataset}: per-client accuracy "
                                             f"after round {final[0]}")
        rundir.write_json(os.path.join(out, "summary.json"), summary)
    return summary


def attack_record(threat: dict, malicious: np.ndarray | None, rows: list[dict]) -> dict[str, Any]:
    """summary.json's "attack": the threat model (`attack_of`), the malicious clients (their
    count and ids; with --attack-redraw the count a round's set has) and the latest
    evaluation's benign accuracy and attack success rate (`attack_metrics`)."""
    record: dict[str, Any] = dict(threat)
    if malicious is not None:
        record.update(clients=int(malicious.sum()), ids=np.flatnonzero(malicious).tolist())
    evaluated = [row for row in rows if "acc_mean" in row]
    if evaluated:
        last = evaluated[-1]
        record["round"] = last["round"]
        record.update({k: v for k, v in last.items()
                       if k.endswith("acc_mean_benign") or k.endswith("asr")
                       or k == "clients_benign"})
    return record


def unseen_record(cfg, unseen: np.ndarray, final) -> dict[str, Any]:
    """summary.json's "unseen": the held-out fraction and clients, how the algorithm evaluates
    them (`algorithms.newcomers`), and the latest evaluation's split (`participation_split`,
    with each side's fairness figures, `client_spread`)."""
    from fedjax_pfl.algorithms.newcomers import newcomer_rule

    record: dict[str, Any] = {"fraction": cfg.unseen_clients, "clients": int(unseen.sum()),
                              "ids": np.flatnonzero(unseen).tolist(),
                              "rule": newcomer_rule(cfg.algo)}
    if final is not None:
        record["round"] = final[0]
        record.update(participation_split(final[1], unseen))
        record["fairness_seen"] = client_spread(final[1][~unseen])
        record["fairness_unseen"] = client_spread(final[1][unseen])
    return record


def trained_counts(cfg, sampled: np.ndarray, n_real: int, rounds: int) -> np.ndarray:
    """client_metrics.npz's `rounds_trained` [n_real]: the rounds each client trained, counted
    from the rounds' sampled ids (`rounds_trained`); every round for every client where the
    algorithm trains them all (pFedMe, TDPFed: only their uploads are sampled)."""
    from fedjax_pfl.algorithms.newcomers import TRAINS_EVERY_CLIENT

    if cfg.algo in TRAINS_EVERY_CLIENT:
        return np.full(n_real, rounds, np.int64)
    return rounds_trained(sampled, n_real)


# The convergence round: the first round whose acc_mean reaches 95 % of its best (pFL-Bench).
CONVERGENCE_METRIC, CONVERGENCE_FRACTION = "acc_mean", 0.95
# Every uplink and downlink the engine counts in floats sends float32 (a bfloat16 --state-dtype
# only stores client rows; `core.gather` hands them back as float32 before anything is sent).
BYTES_PER_FLOAT = 4


def final_accuracy(prog: Progress) -> tuple[int, np.ndarray] | None:
    """(round, per-client accuracy [n_real], NaN where not evaluated) of the run's latest
    evaluation (the last round's, which evaluates every client, unless the run stopped early);
    None before any evaluation. client_metrics.npz keeps it as accuracy[-1], eval_rounds[-1]."""
    if not prog.acc_log:
        return None
    return int(prog.eval_rounds[-1]), np.asarray(prog.acc_log[-1], np.float64)


def communication_bytes(communication: dict[str, float]) -> dict[str, Any]:
    """summary.json's cost in bytes from the communication totals (`communication_totals`):
    "down_bytes_total" = down_floats_total × 4 (float32) and "up_bytes_total" = up_floats_total
    × 4, or, where the algorithm counts the bits its compressed uplink sends (FedPC's up_bits),
    up_bits_total / 8; "up_bytes_from" says which. Nothing for an algorithm that sends nothing."""
    out: dict[str, Any] = {}
    if "up_bits_total" in communication:
        out["up_bytes_total"] = communication["up_bits_total"] / 8
        out["up_bytes_from"] = "up_bits / 8"
    elif "up_floats_total" in communication:
        out["up_bytes_total"] = communication["up_floats_total"] * BYTES_PER_FLOAT
        out["up_bytes_from"] = f"up_floats x {BYTES_PER_FLOAT} (float32)"
    if "down_floats_total" in communication:
        out["down_bytes_total"] = communication["down_floats_total"] * BYTES_PER_FLOAT
        out["down_bytes_from"] = f"down_floats x {BYTES_PER_FLOAT} (float32)"
    return out


def round_flops(program, rounds_done: int) -> dict[str, Any]:
    """"flops_per_round" (XLA's cost analysis of the compiled round program) and "flops_total"
    (× the rounds done), or both None with "flops_unavailable" saying why.

    XLA's HloCostAnalysis counts every loop's body once, whatever its trip count: a call of K
    rounds (`rounds_per_call`, a lax.scan) counts one round, so the call's figure is the round's
    (not divided by K), and each client's local-step loop (a lax.while_loop of a data-dependent
    length) counts one step of every client slot. The figure is therefore the round's work
    with one local step per client — a lower bound, exact for the server's side — and
    "flops_counts_loops_once" says so."""
    compiled = getattr(program, "_round_compiled", None)
    if compiled is None:
        why = ("the rounds run from Python (loop or debug backend): no compiled round program"
               if program is not None and not getattr(program, "jit", True)
               else "the round program was not compiled (the run stopped before its compile)")
        return {"flops_per_round": None, "flops_total": None, "flops_unavailable": why}
    try:
        cost = compiled.cost_analysis()
    except Exception as e:         # (a backend without a cost model raises)
        return {"flops_per_round": None, "flops_total": None,
                "flops_unavailable": f"XLA's cost analysis failed: {type(e).__name__}: {e}"}
    if isinstance(cost, (list, tuple)):               # (older JAX: one dict per program)
        cost = cost[0] if cost else None
    flops = (cost or {}).get("flops")
    if flops is None or not flops >= 0:
        return {"flops_per_round": None, "flops_total": None,
                "flops_unavailable": "XLA's cost analysis of the round gives no flops on "
                                     f"{jax.default_backend()}"}
    return {"flops_per_round": float(flops), "flops_total": float(flops) * rounds_done,
            "flops_counts_loops_once": True}


def compile_record(compiled: compiles.Log, seconds: float | None,
                   cache_dir: str | None) -> dict[str, Any]:
    """summary.json's "compile": `seconds` (the round's and evaluation's compile, as
    "compile_time_s"; None when the run stopped before it ended), every program the run
    compiled or loaded ("programs"), how many of them the persistent compilation cache gave
    ("from_cache"), the backend's seconds over all of them ("backend_seconds": XLA's compile,
    or the cache's read), and the cache's directory ("cache_dir": None without one). A warm
    cache shows as from_cache == programs."""
    return {"seconds": seconds, **compiled.summary(), "cache_dir": cache_dir}


def compile_text(record: dict[str, Any]) -> str:
    """A summary's "compile" in words: "3 of 3 programs from the cache", "5 programs, none
    from the cache", "5 programs, no cache" (the cache off), "no program compiled"."""
    n, hits = int(record["programs"]), int(record["from_cache"])
    programs = f"{n} program{'s' * (n != 1)}"
    if n == 0:
        return "no program compiled"
    if record.get("cache_dir") is None and hits == 0:
        return f"{programs}, no cache"
    if hits == 0:
        return f"{programs}, none from the cache"
    return f"{hits} of {programs} from the cache"


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
            if is_accuracy(k) and (k not in best or v > best[k]):
                best[k], best_round[k] = v, row["round"]
    return {"best": best, "best_round": best_round, "last": last}


def is_accuracy(key: str) -> bool:
    return ("acc" in key and not key.endswith("_std")) or key == "participant_best_mean"


def round_slots(m: dict, n_real: int, poisson: bool) -> np.ndarray:
    """The round's sampled ids as logged: under Poisson sampling the unused slots (which hold a
    padding client) read −1, so every round logs the same number of slots."""
    sampled = np.asarray(m["sampled"])
    return np.where(sampled < n_real, sampled, -1) if poisson else sampled


def participants(sampled: np.ndarray) -> np.ndarray:
    """The clients that took part: the logged ids without the −1 of empty slots."""
    sampled = np.asarray(sampled)
    return sampled[sampled >= 0]


def round_row(round_number: int, m: dict, round_time: float,
              n_real: int | None = None) -> dict[str, Any]:
    """One metrics.jsonl row from a round's metrics; stops the run on a non-finite loss. With
    `n_real` (Poisson sampling) the row counts the round's "participants", and its train_loss
    is their mean (slots of padding clients excluded)."""
    sampled = np.asarray(m["sampled"])
    losses = np.asarray(m["train_loss"], np.float64)
    trained = np.asarray(m.get("trained", sampled))   # TDPFed and pFedMe train every client
    extra: dict[str, Any] = {}
    if n_real is not None:       # the padding client's slots (or, trained, its row) do not count
        real = trained < n_real
        losses, trained = losses[real], trained[real]
        extra["participants"] = int(np.sum(sampled < n_real))
    if not np.all(np.isfinite(losses)):
        bad = trained[~np.isfinite(losses)].tolist()
        raise NonFiniteError(f"round {round_number}: clients {bad} have a non-finite training "
                             f"loss; lower {arg('lr', 'hparams')} or check the data")
    # A Poisson-sampled round may have no participant: its loss is no one's (null, not 0).
    loss = float(losses.mean()) if losses.size else None
    row: dict[str, Any] = {"round": round_number, "train_loss": loss,
                           "client_steps": int(m["client_steps"]), "round_time": round_time,
                           **extra}
    row.update(scalar_metrics(m))
    return row


def eval_ids(prep, sampled: np.ndarray, *, final: bool) -> np.ndarray | None:
    """The clients evaluated this time: all at the last round, else per `eval_clients`."""
    if final or prep.cfg.eval_clients == "all":
        return None
    if prep.cfg.eval_clients == "participants":
        return np.asarray(participants(sampled), np.int32)
    return prep.eval_ids


def attack_metrics(evals: dict, ids, n_real: int,
                   malicious: np.ndarray | None) -> dict[str, float | int]:
    """An evaluation's figures under attack: with a fixed malicious set ([n_real] bool) the
    benign clients' accuracy, "acc_mean_benign" (the unweighted mean over benign clients, as
    acc_mean) for the clients' own models and "<name>_acc_mean_benign" for each other model
    evaluated (the global one), and "clients_benign"; under a backdoor the attack success rate
    "asr" ("<name>_asr"): of the benign clients' test samples whose label is not the target,
    the fraction the model classifies as the target once triggered (pooled over the clients;
    every client's where the set is re-drawn each round: `malicious` None)."""
    where = np.arange(n_real) if ids is None else np.asarray(ids)
    out: dict[str, float | int] = {}
    for name, ev in evals.items():
        prefix = "" if name == "client" else f"{name}_"
        k = len(where)
        benign = (np.ones(k, bool) if malicious is None
                  else ~np.asarray(malicious, bool)[np.minimum(where, n_real - 1)])
        benign &= where < n_real
        if malicious is not None:
            correct = np.asarray(ev.correct, np.float64)[:k]
            count = np.asarray(ev.count, np.float64)[:k]
            acc = correct[benign & (count > 0)] / count[benign & (count > 0)]
            if acc.size:
                out[f"{prefix}acc_mean_benign"] = float(acc.mean())
            if name == "client":
                out["clients_benign"] = int((benign & (count > 0)).sum())
        if getattr(ev, "backdoor_hits", None) is not None:
            hits = np.asarray(ev.backdoor_hits, np.float64)[:k][benign].sum()
            total = np.asarray(ev.backdoor_count, np.float64)[:k][benign].sum()
            if total > 0:
                out[f"{prefix}asr"] = float(hits / total)
    return out


def record_evaluation(row: dict, evals: dict, ids, n_real: int, history, sampled,
                      unseen: np.ndarray | None = None,
                      malicious: np.ndarray | None = None) -> np.ndarray:
    """Adds the evaluation statistics to `row`; returns the per-client accuracy [n_real] (NaN
    for clients not evaluated this time). With `unseen` (the held-out clients, [n_real] bool)
    also acc_mean_seen, acc_mean_unseen and participation_gap (`participation_split`)."""
    check_evaluation(row["round"], evals, ids)
    client = evals["client"]
    correct, count = np.asarray(client.correct), np.asarray(client.count)
    accuracy = np.full(n_real, np.nan)
    acc = np.where(count > 0, correct / np.maximum(count, 1), np.nan)
    where = np.arange(n_real) if ids is None else np.asarray(ids)
    accuracy[where] = acc[: len(where)]
    row.update(core.summarize(client.correct, client.loss_sum, client.count,
                              loss_count=client.loss_count))
    row["eval_clients"] = int(np.sum(count > 0))
    row.update(history.record_participants(accuracy, participants(sampled)))
    if unseen is not None:
        row.update(participation_split(accuracy, unseen))
    row.update(attack_metrics(evals, ids, n_real, malicious))
    for name, ev in evals.items():
        if name != "client":
            row.update(core.summarize(ev.correct, ev.loss_sum, ev.count, prefix=f"{name}_",
                                      loss_count=ev.loss_count))
    return accuracy


def check_evaluation(round_number: int, evals: dict, ids) -> None:
    """Stops the run (NonFiniteError naming the round, the model and the clients) where an
    evaluated client's loss or counts are not finite: its accuracy would be the argmax of NaN
    outputs, a number that looks like a result (Ditto with a huge λ diverges in its personal
    models while its training loss, the global model's, stays finite)."""
    for name, ev in evals.items():
        count = np.asarray(ev.count, np.float64)
        scored = count > 0
        values = [np.asarray(v, np.float64) for v in (ev.loss_sum, ev.correct, ev.count)]
        bad = scored & ~np.logical_and.reduce([np.isfinite(v) for v in values])
        if bad.any():
            clients = np.flatnonzero(bad) if ids is None else np.asarray(ids)[np.flatnonzero(bad)]
            model = "the clients' own models" if name == "client" else f"the {name} model"
            raise NonFiniteError(
                f"round {round_number}: the evaluation of {model} gives a non-finite loss on "
                f"clients {clients[:8].tolist()}{'…' if clients.size > 8 else ''}; the run "
                f"diverged (lower {arg('lr', 'hparams')}, or check the algorithm's "
                "hyperparameters)")


def communication_totals(rows: list[dict]) -> dict[str, float]:
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


def scalar_metrics(m: dict) -> dict[str, float]:
    """Algorithm-specific scalar metrics (everything but the standard per-client arrays)."""
    out = {}
    for k, v in m.items():
        if k in ("sampled", "trained", "train_loss", "client_steps"):
            continue
        v = np.asarray(v)
        if v.ndim == 0:
            out[k] = float(v)
    return out
