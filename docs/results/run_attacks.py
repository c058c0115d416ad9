"""The adversaries study of docs/results/attacks.md: FedAvg, Ditto, FedRep, PGFed and pFedSOP under
a sign flip (×4) and a backdoor, 30 % of the clients malicious, with the mean, the coordinate-wise
median and the trimmed mean (β = 0.3), plus a clean baseline per algorithm, on digits and
Fashion-MNIST. One experiments/run.py process per cell, sequential; a cell whose summary.json
exists is not run again, and a refusal (exit 2, one line) is recorded as the cell's result.

    python docs/results/run_attacks.py --out /tmp/attacks_study            # all runs
    python docs/results/run_attacks.py --out /tmp/attacks_study --collect  # tables and figure only

Fashion-MNIST's files are looked up where run.py looks (docs/datasets.md); `--fashion-dir DIR`
passes --data-dir. XLA's compiler settings per dataset (`XLA_FLAGS` below) only shorten the
compilation that dominates these small runs; they change no result beyond float rounding.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

ALGOS = ["fedavg", "ditto", "fedrep", "pgfed", "pfedsop"]
ATTACKS = {"sign_flip": ["--attack", "sign_flip", "--attack-scale", "4"],
           "backdoor": ["--attack", "backdoor"]}           # 2×2 trigger, p = 0.5, target 0
AGGREGATORS = {"mean": ["--aggregator", "mean"],
               "median": ["--aggregator", "median"],
               "trimmed_mean": ["--aggregator", "trimmed_mean", "--aggregator-beta", "0.3"]}
FRACTION = "0.3"
# Rounds: the runs are bound by compilation (about 25–60 s a run on 2 shared cores), so the
# rounds are what the 45-minute budget of the whole study leaves after it.
DATASETS = {
    "digits": {"flags": ["--dataset", "digits", "--participation", "0.5", "--rounds", "30",
                         "--eval-every", "30"],
               # LLVM -O0 and the elemental emitters (tests/conftest.py): compiling takes a third
               # of the time, and the 8×8 MLP's rounds stay a fraction of a second.
               "xla": "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
                      "--xla_cpu_parallel_codegen_split_count=1"},
    # 20 clients (Dirichlet α = 0.5), each training on about 350 samples (--test-fraction 0.9:
    # the rest of its ~3,500 is its test split), 10 a round.
    "fashion_mnist": {"flags": ["--dataset", "fashion_mnist", "--test-fraction", "0.9",
                                "--participation", "0.5", "--rounds", "20", "--eval-every", "20"],
                      # -O0 makes the 784-input MLP's rounds 25× slower; -O1 compiles in ~2/3.
                      "xla": "--xla_backend_optimization_level=1 --xla_cpu_use_fusion_emitters=false "
                             "--xla_cpu_parallel_codegen_split_count=1"},
}


def cells():
    """(dataset, algo, attack, aggregator) of every run: the clean baseline is `--attack none`
    with the same malicious set marked (the benign clients' figures, nothing attacked)."""
    for dataset in DATASETS:
        for algo in ALGOS:
            yield dataset, algo, "none", "mean"
            for attack in ATTACKS:
                for agg in AGGREGATORS:
                    yield dataset, algo, attack, agg


def argv_of(dataset, algo, attack, agg, out, fashion_dir):
    argv = ["--algo", algo, *DATASETS[dataset]["flags"], *AGGREGATORS[agg],
            *(ATTACKS[attack] if attack != "none" else ["--attack", "none"]),
            "--attack-fraction", FRACTION, "--checkpoint-every", "0", "--quiet",
            "--out", str(out), "--overwrite"]
    if dataset == "fashion_mnist" and fashion_dir:
        argv += ["--data-dir", fashion_dir]
    return argv


def run_all(out: Path, fashion_dir: str | None, only: list[str] | None) -> None:
    """Runs the cells not yet done; `only`: fnmatch patterns of DATASET:ALGO:ATTACK:AGGREGATOR
    (e.g. "fashion_mnist:ditto:*:mean"), default every cell."""
    for dataset, algo, attack, agg in cells():
        if only and not any(fnmatch.fnmatch(f"{dataset}:{algo}:{attack}:{agg}", p) for p in only):
            continue
        cell = out / dataset / f"{algo}__{attack}__{agg}"
        if any((cell / name).exists() for name in ("summary.json", "refused.txt", "failed.txt")):
            continue
        cell.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, XLA_FLAGS=DATASETS[dataset]["xla"],
                   FEDJAX_PFL_COMPILE_CACHE=str(out / "jit_cache"),
                   PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        cmd = ["nice", "-n", "10", sys.executable, str(ROOT / "experiments" / "run.py"),
               *argv_of(dataset, algo, attack, agg, cell, fashion_dir)]
        t0 = time.time()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        wall = time.time() - t0
        (cell / "log.txt").write_text(proc.stdout + proc.stderr)
        if proc.returncode == 2:             # a refusal: its one line is the result
            (cell / "refused.txt").write_text(proc.stderr.strip().splitlines()[-1] + "\n")
        elif proc.returncode != 0:          # e.g. a diverged run (non-finite loss): also a result
            (cell / "failed.txt").write_text(proc.stderr.strip().splitlines()[-1] + "\n")
            print(f"{cell}: exit {proc.returncode}\n{proc.stderr[-2000:]}", file=sys.stderr)
        print(f"{dataset:14s} {algo:8s} {attack:10s} {agg:13s} {wall:6.1f} s  rc {proc.returncode}",
              flush=True)


def collect(out: Path) -> list[dict]:
    """One record per cell: the last evaluation's benign accuracies and ASR (summary.json's
    "attack"), the wall time, or the refusal's line."""
    records = []
    for dataset, algo, attack, agg in cells():
        cell = out / dataset / f"{algo}__{attack}__{agg}"
        rec = {"dataset": dataset, "algo": algo, "attack": attack, "aggregator": agg}
        if (cell / "refused.txt").exists():
            rec["refused"] = (cell / "refused.txt").read_text().strip()
        elif (cell / "failed.txt").exists():
            rec["failed"] = (cell / "failed.txt").read_text().strip()
        elif (cell / "summary.json").exists():
            summary = json.loads((cell / "summary.json").read_text())
            a = summary["attack"]
            rec.update(acc=a.get("acc_mean_benign"), global_acc=a.get("global_acc_mean_benign"),
                       asr=a.get("asr"), global_asr=a.get("global_asr"), round=a.get("round"),
                       wall_s=summary["wall_time_s"], compile_s=summary["compile_time_s"])
        else:
            rec["missing"] = True
        records.append(rec)
    (out / "records.json").write_text(json.dumps(records, indent=1))
    return records


def _fmt(x):
    return "–" if x is None else f"{x:.3f}"


def table(records: list[dict], dataset: str) -> str:
    """Markdown: rows per algorithm (clean, sign flip, backdoor, the backdoor's ASR), a column per
    aggregator; a cell is personal / global (the benign clients' figures; one number where the
    algorithm evaluates one model)."""
    lines = ["| algorithm | benign clients' | mean | median | trimmed mean (β = 0.3) |",
             "|---|---|---|---|---|"]
    by = {(r["algo"], r["attack"], r["aggregator"]): r for r in records if r["dataset"] == dataset}
    rows = [("none", "acc", "accuracy, clean"), ("sign_flip", "acc", "accuracy, sign flip ×4"),
            ("backdoor", "acc", "accuracy, backdoor"), ("backdoor", "asr", "ASR, backdoor")]
    for algo in ALGOS:
        for attack, what, label in rows:
            row = [algo, label]
            for agg in AGGREGATORS:
                r = by.get((algo, attack, agg))
                if r is None:
                    row.append("–")            # the clean baseline runs with the mean only
                elif "refused" in r:
                    row.append("refused")
                elif "failed" in r:
                    m = re.search(r"round (\d+)", r["failed"])
                    row.append(f"diverged (round {m.group(1)})" if m and "non-finite" in r["failed"]
                               else "failed")
                elif "missing" in r:
                    row.append("not run")
                else:
                    glob = r["global_acc" if what == "acc" else "global_asr"]
                    row.append(_fmt(r[what]) + ("" if glob is None else f" / {_fmt(glob)}"))
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def figure(records: list[dict], path: Path) -> None:
    """Benign personal accuracy (bars) per algorithm and setting, and the backdoor's ASR
    (markers), one panel per dataset."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    settings = [("none", "mean", "clean"), ("sign_flip", "mean", "sign flip, mean"),
                ("sign_flip", "median", "sign flip, median"),
                ("sign_flip", "trimmed_mean", "sign flip, trimmed"),
                ("backdoor", "mean", "backdoor, mean"), ("backdoor", "median", "backdoor, median"),
                ("backdoor", "trimmed_mean", "backdoor, trimmed")]
    colors = ["0.55", "#c0392b", "#e67e22", "#f1c40f", "#2c3e50", "#2980b9", "#7fb3d5"]
    ran = [d for d in DATASETS if any(r["dataset"] == d and r.get("acc") is not None for r in records)]
    fig, axes = plt.subplots(len(ran), 1, figsize=(10, 1.0 + 3.4 * len(ran)), sharex=True,
                             squeeze=False)
    axes = axes[:, 0]
    x = np.arange(len(ALGOS))
    width = 0.12
    for ax, dataset in zip(axes, ran):
        by = {(r["algo"], r["attack"], r["aggregator"]): r for r in records if r["dataset"] == dataset}
        for k, ((attack, agg, label), color) in enumerate(zip(settings, colors)):
            acc = [by.get((a, attack, agg), {}).get("acc") for a in ALGOS]
            pos = x + (k - 3) * width
            ax.bar(pos, [np.nan if v is None else v for v in acc], width, color=color, label=label)
            for p_, a in zip(pos, ALGOS):
                if "failed" in by.get((a, attack, agg), {}):
                    ax.text(p_, 0.02, "diverged", rotation=90, ha="center", va="bottom", fontsize=7)
            if attack == "backdoor":
                asr = [by.get((a, attack, agg), {}).get("asr") for a in ALGOS]
                ax.plot(pos, [np.nan if v is None else v for v in asr], "kx", ms=6,
                        label="backdoor ASR" if agg == "mean" else None)
        ax.set_ylim(0, 1.02)
        ax.set_ylabel("benign clients' accuracy")
        ax.set_title(f"{dataset}: 30 % malicious (× ASR of the backdoor)")
        ax.grid(axis="y", alpha=0.3)
    axes[-1].set_xticks(x, ALGOS)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, ncol=4, fontsize=8, loc="lower center")
    fig.tight_layout(rect=(0, 0.09 if len(ran) == 1 else 0.06, 1, 1))
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="/tmp/attacks_study")
    p.add_argument("--fashion-dir", default=None, help="--data-dir for Fashion-MNIST's files")
    p.add_argument("--cells", nargs="*", default=None,
                   help="run only the cells matching these DATASET:ALGO:ATTACK:AGGREGATOR patterns")
    p.add_argument("--collect", action="store_true", help="tables and figure from finished runs only")
    p.add_argument("--figure", default=None, help="where the PNG goes (default OUT/attacks.png)")
    args = p.parse_args(argv)
    out = Path(args.out)
    if not args.collect:
        run_all(out, args.fashion_dir, args.cells)
    records = collect(out)
    for dataset in DATASETS:
        print(f"\n{dataset}\n" + table(records, dataset))
    path = Path(args.figure) if args.figure else out / "attacks.png"
    figure(records, path)
    print(f"\nfigure: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
