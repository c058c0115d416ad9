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


class CompareError(ValueError):
    """Bad compare.py input or an --out it must not touch: one line, exit status 2."""


def _fail(message: str, code: int = 2) -> None:
    print(f"compare.py: error: {' '.join(str(message).split())}", file=sys.stderr)
    raise SystemExit(code)


def _summary(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _plan(args) -> list[tuple[str, list[str], object]]:
    """(label, run.py flags, RunConfig) of every --run, all checked before anything runs or any
    folder is made: each a valid run.py configuration, each in a folder of its own. --common is
    parsed once; each run's flags on top of it (`run.parse_on_top`), its RunConfig built from
    those options (`RunConfig.from_options`)."""

    common_argv = shlex.split(args.common)
    try:
        common, common_error = cli.parse_flags(common_argv), None
    except cli.UsageError as e:          # reported with the first run, as each run's own
        common, common_error = None, e
    planned, folders = [], {}
    for spec in args.run:
        label, sep, flags = spec.partition(":")
        label = label.strip()
        if not sep or not label:
            raise CompareError(f'--run wants "LABEL: FLAGS", got {spec!r}')
        folder = slug(label)
        if not folder:
            raise CompareError(f"--run {label!r}: the label needs a letter or a digit (it names "
                               "the run's folder)")
        if folder in folders:
            raise CompareError(f"--run {folders[folder]!r} and --run {label!r} would share the "
                               f"folder {os.path.join(args.out, folder)}: give them labels that "
                               "differ in their letters or digits")
        folders[folder] = label
        own = shlex.split(flags) + ["--out", os.path.join(args.out, folder), "--quiet"]
        algo = None
        try:
            if common_error is not None:
                raise common_error
            run_args = cli.parse_flags(own, on_top_of=common)
            algo = run_args.algo
            cfg = cli.config_from_args(run_args, prog=f"compare.py: --run {label!r}")
            algo = cfg.algo
            cfg.validate()
        except ValueError as e:                    # (cli.UsageError too)
            raise CompareError(f"--run {label!r}: {cli.message(e, algo)}") from None
        planned.append((label, common_argv + own, cfg))
    return planned


def _check_out(args, planned) -> None:
    """--out is new or empty, or (--resume) holds only runs of these configurations: nothing
    of an earlier run that this command cannot continue is touched."""
    from fedjax_pfl import runner
    from fedjax_pfl.errors import render

    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise CompareError(f"--out {args.out} is an existing file, not a directory")
    if not args.resume:
        if os.path.isdir(args.out) and os.listdir(args.out):
            found = sorted(os.listdir(args.out))
            shown = ", ".join(found[:4]) + (", …" if len(found) > 4 else "")
            raise CompareError(f"--out {args.out} already holds files ({shown}); pass --resume "
                               "to reuse its runs of the same configuration, or use a new --out")
        return
    for label, _, cfg in planned:
        if not os.path.isdir(cfg.out) or not os.listdir(cfg.out):
            continue
        try:
            saved = runner.read_config(cfg.out)
        except (OSError, ValueError):
            raise CompareError(f"--run {label!r}: {cfg.out} holds files but no readable "
                               "config.json: not a run this command made; move it away or use "
                               "a new --out") from None
        conflict = runner.reuse_conflicts(cfg, cfg.validate(), runner.model_name_of(cfg), saved)
        if conflict:
            conflict = render(conflict, cli.spelling(cfg.algo))
            raise CompareError(f"--run {label!r}: {cfg.out} holds a run made with {conflict}; "
                               "give this run another label, or use a new --out")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.error = lambda message: _fail(f"{message} (see --help)")   # one line, exit status 2
    p.add_argument("--out", required=True, help="output directory (new or empty, or an earlier "
                   "comparison's with --resume)")
    p.add_argument("--common", default="", help="flags shared by every run")
    p.add_argument("--run", action="append", required=True, help='"LABEL: FLAGS"')
    p.add_argument("--title", default="", help="heading of results.md")
    p.add_argument("--resume", action="store_true",
                   help="reuse the finished runs in --out (each must have been made with the same "
                        "configuration, else the comparison stops before running anything); an "
                        "interrupted run continues from its last checkpoint")
    args = p.parse_args(argv)

    import fedjax_pfl

    fedjax_pfl.use_cpu_cores()
    from fedjax_pfl import runner
    from fedjax_pfl.errors import spelled

    try:
        with cli.said_warnings("compare.py"):          # said once every run's checks passed
            planned = _plan(args)
            _check_out(args, planned)
    except CompareError as e:
        _fail(str(e))
    os.makedirs(args.out, exist_ok=True)
    rows, curves = [], {}
    data_cache: dict = {}
    for label, argv_run, cfg in planned:
        key = json.dumps([cfg.dataset, cfg.data_options, cfg.partition.__dict__, cfg.seed], default=str)
        if key not in data_cache:
            try:
                data_cache[key] = runner.load_data(cfg)
            except (ValueError, OSError) as e:       # (DatasetNotFoundError: an OSError)
                _fail(f"--run {label!r}: {spelled(e, cli.spelling(cfg.algo))}")
        data, info = data_cache[key]
        print(f"== {label}: {' '.join(argv_run)}", flush=True)
        command = "python experiments/run.py " + " ".join(argv_run[:-3])
        summary_path = os.path.join(cfg.out, "summary.json")
        diverged = None
        saved = _summary(summary_path) if args.resume else None
        reuse = saved is not None and not saved.get("interrupted", False)
        if saved is not None and not reuse:
            if runner.latest_checkpoint(cfg.out) is not None:
                # Stopped (Ctrl-C) earlier: continue from its last checkpoint, bit for bit.
                print(f"   it was interrupted after round {saved.get('last_completed_round')}: "
                      "resuming it", flush=True)
                cfg.resume = True
            else:                  # (the same configuration, _check_out said: nothing is lost)
                print(f"   it was interrupted after round {saved.get('last_completed_round')} "
                      "before its first checkpoint: running it again", flush=True)
        if reuse:
            summary = saved
        else:
            try:
                summary = runner.run(cfg, data=data, data_info=info, log=print)
            except ValueError as e:             # (ResumeError, MemoryPlanError, …)
                _fail(f"--run {label!r}: {cli.message(e, cfg.algo)}")
            except runner.NonFiniteError as e:  # keep the sweep going; the table says so
                diverged = str(e).split(":")[0]
                print(f"   diverged: {spelled(e, cli.spelling(cfg.algo))}", flush=True)
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
             "| run | mean (last) | mean (best round) | weighted (last) | worst 10% (last) | part.-best "
             "| global model (last) | s/round |"
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
