#!/usr/bin/env python
"""Run several configurations on the same data and tabulate them (used for docs/results/).

    python experiments/compare.py --out runs/cmp \\
        --common "--preset pfedsop_paper --dataset fashion_mnist --rounds 100" \\
        --run "fedavg: --algo fedavg" --run "pfedsop (newton): --algo pfedsop" \\
        --run "pfedsop (sgd): --algo pfedsop --pfedsop-keep sgd"

Each --run is "LABEL: FLAGS" with the flags of experiments/run.py; --common flags come first,
so a run's own flags override them. Every run gets its own directory OUT/<slug>/ with the usual
files; OUT/results.md holds the table and the exact commands, OUT/curves.png the accuracy curves.
All runs share the partition (same seed and data flags), so they see the same clients.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run as cli  # noqa: E402


def slug(label: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", label.lower()).strip("_")


def _same_config(run_dir: str, cfg) -> bool:
    """Whether run_dir/config.json was written for the configuration `cfg` describes.

    The saved record holds every hyperparameter resolved; `cfg` only the explicit ones, which
    must all match.
    """
    import dataclasses

    try:
        saved = json.load(open(os.path.join(run_dir, "config.json")))
    except (OSError, ValueError):
        return False
    wanted = json.loads(json.dumps(dataclasses.asdict(cfg), default=str))
    if any(saved.get(k) != wanted[k] for k in ("algo", "dataset", "partition", "rounds", "seed",
                                                "eval_every", "data_options")):
        return False
    if wanted["model"] is not None and saved.get("model") != wanted["model"]:
        return False
    return all(_same_value(saved.get("hparams", {}).get(k), v) for k, v in wanted["hparams"].items())


def _summary(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _same_value(saved, flag) -> bool:
    """A resolved hyperparameter against a flag's value (the CLI keeps "0.01" as text)."""
    if saved == flag:
        return True
    try:
        return float(saved) == float(flag)
    except (TypeError, ValueError):
        return str(saved) == str(flag)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--common", default="", help="flags shared by every run")
    p.add_argument("--run", action="append", required=True, help='"LABEL: FLAGS"')
    p.add_argument("--title", default="", help="heading of results.md")
    p.add_argument("--resume", action="store_true",
                   help="reuse runs whose directory already holds a summary.json of the same "
                        "configuration (a run whose flags changed is run again; an interrupted "
                        "run continues from its last checkpoint)")
    args = p.parse_args(argv)

    import fedjax_pfl

    fedjax_pfl.use_cpu_cores()
    from fedjax_pfl import runner

    os.makedirs(args.out, exist_ok=True)
    rows, curves = [], {}
    data_cache: dict = {}
    for spec in args.run:
        label, _, flags = spec.partition(":")
        label = label.strip()
        argv_run = shlex.split(args.common) + shlex.split(flags) + [
            "--out", os.path.join(args.out, slug(label)), "--quiet"]
        run_args = cli.parse(argv_run)
        cfg = cli.config_from_args(run_args)
        cfg.validate()
        key = json.dumps([cfg.dataset, cfg.data_options, cfg.partition.__dict__, cfg.seed], default=str)
        if key not in data_cache:
            data_cache[key] = runner.load_data(cfg)
        data, info = data_cache[key]
        print(f"== {label}: {' '.join(argv_run)}", flush=True)
        command = "python experiments/run.py " + " ".join(argv_run[:-3])
        summary_path = os.path.join(cfg.out, "summary.json")
        diverged = None
        saved = _summary(summary_path) if args.resume else None
        same = saved is not None and _same_config(cfg.out, cfg)
        finished = saved is not None and not saved.get("interrupted", False)
        reuse = finished and same
        if saved is not None and not same:
            print("   its saved run has another configuration: running it again", flush=True)
        elif saved is not None and not finished:
            # Stopped (Ctrl-C) earlier: continue from its last checkpoint, bit for bit.
            print(f"   it was interrupted after round {saved.get('last_completed_round')}: "
                  "resuming it", flush=True)
            cfg.resume = True
        if reuse:
            summary = json.load(open(summary_path))
        else:
            try:
                summary = runner.run(cfg, data=data, data_info=info, log=print)
            except runner.NonFiniteError as e:  # keep the sweep going; the table says so
                diverged = str(e).split(":")[0]
                print(f"   diverged: {e}", flush=True)
                with open(os.path.join(cfg.out, "metrics.jsonl")) as f:
                    curves[label] = [json.loads(line) for line in f]
                rows.append({"label": label, "command": command, "diverged": diverged})
                continue
        best, last = summary["best"], summary["last"]
        rows.append({
            "label": label, "command": command,
            "acc_last": last.get("acc_mean"), "acc_best": best.get("acc_mean"),
            "acc_weighted_last": last.get("acc_weighted"), "worst10_last": last.get("acc_worst10"),
            "participant_best": last.get("participant_best_mean"),
            "global_last": last.get("global_acc_mean"),
            "time_per_round_s": summary["time_per_round_s"], "wall_s": summary["wall_time_s"],
            "communication": summary.get("communication", {}),
        })
        with open(os.path.join(cfg.out, "metrics.jsonl")) as f:
            curves[label] = [json.loads(line) for line in f]
        print(f"   acc last {rows[-1]['acc_last']:.4f} best {rows[-1]['acc_best']:.4f} "
              f"({summary['wall_time_s']:.0f}s)", flush=True)

    write_table(args, rows, info)
    runner.plot_learning_curves(curves, os.path.join(args.out, "curves.png"), args.title)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(rows, f, indent=2)
    return 0


def _fmt(v):
    return "–" if v is None else f"{100 * v:.2f}"


# Communication columns (when any run reports floats sent): per round and in total.
_COMM_COLUMNS = (("up_floats_per_round", "up floats/round"), ("down_floats_per_round", "down floats/round"),
                 ("up_floats_total", "up floats total"), ("down_floats_total", "down floats total"))


def _comm_cells(comm: dict) -> str:
    return "".join(f" {comm[k]:,.0f} |" if k in comm else " – |" for k, _ in _COMM_COLUMNS)


def write_table(args, rows, info) -> None:
    has_comm = any(r.get("communication") for r in rows)
    comm_header = "".join(f" {title} |" for _, title in _COMM_COLUMNS) if has_comm else ""
    lines = [f"# {args.title or 'Comparison'}", "",
             f"Data: {info['dataset']} ({info['source']}), {info['num_clients']} clients, "
             f"{info['train_size']['total']} train / {info['test_size']['total']} test samples, "
             f"train size per client {info['train_size']['min']}–{info['train_size']['max']}.", "",
             "Accuracy in % of each client's own test split. `mean` is unweighted over clients; "
             "`best` is the best round's mean; `part.-best` is pFedSOP's Table II statistic (each "
             "client's best accuracy over the rounds it took part in, averaged); `worst 10%` is the "
             "mean of the worst tenth of clients.", "",
             "| run | mean (last) | mean (best round) | weighted (last) | worst 10% (last) | part.-best | global model (last) | s/round |"
             + comm_header,
             "|---|---|---|---|---|---|---|---|" + "---|" * comm_header.count("|")]
    for r in rows:
        if r.get("diverged"):
            lines.append(f"| {r['label']} | diverged ({r['diverged']}: non-finite training loss) "
                         "| | | | | | |" + " |" * comm_header.count("|"))
            continue
        lines.append(f"| {r['label']} | {_fmt(r['acc_last'])} | {_fmt(r['acc_best'])} | "
                     f"{_fmt(r['acc_weighted_last'])} | {_fmt(r['worst10_last'])} | "
                     f"{_fmt(r['participant_best'])} | {_fmt(r['global_last'])} | "
                     f"{r['time_per_round_s']:.2f} |"
                     + (_comm_cells(r.get("communication", {})) if has_comm else ""))
    lines += ["", "Commands:", ""] + [f"    {r['command']}" for r in rows] + [""]
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
