"""The runs behind docs/results/privacy.md: accuracy against ε on Fashion-MNIST.

    python docs/results/privacy_runs.py run   [--jobs 2] [--seeds 0 1 2] [--only PREFIX]
    python docs/results/privacy_runs.py table

`run` starts experiments/run.py once per (setting, method, privacy level, seed), at most
--jobs at a time, writing to /tmp/privacy_runs/NAME (a run whose summary.json exists is
skipped). `table` reads the summaries and prints the Markdown tables of the page.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

OUT = "/tmp/privacy_runs"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Setting A (the main grid): N = 100 clients, M = 10 a round.
COMMON_A = ["--dataset", "fashion_mnist", "--clients", "100", "--participation", "0.1",
            "--rounds", "50", "--eval-every", "10", "--quiet"]
# Setting B (FedAvg only): N = 1000 clients, M = 100 a round.
COMMON_B = ["--dataset", "fashion_mnist", "--clients", "1000", "--participation", "0.1",
            "--rounds", "50", "--eval-every", "10", "--quiet"]

# C: about the median of dp_update_norm over a no-noise run (--dp-clip 1e6, seed 0).
CLIP_A = {"fedavg": 0.65, "fedrep": 0.47, "ditto": 0.65}
CLIP_B = {"fedavg": 0.4, "fedrep": 0.23, "ditto": 0.4}
EPSILONS_A = (32, 8, 2)
EPSILONS_B = (8, 2)


def _setting(label, common, clips, epsilons, seed, clip_only):
    """One seed's runs of a setting: each algorithm without DP, at each ε (and, with `clip_only`,
    clipped without noise), then Local."""
    run = lambda algo, *extra: ["--algo", algo, *common, "--seed", str(seed), *extra]
    out = []
    for algo, clip in clips.items():
        out.append((f"{label}_{algo}_nodp_s{seed}", run(algo)))
        for eps in epsilons:
            out.append((f"{label}_{algo}_e{eps}_s{seed}",
                        run(algo, "--dp-clip", str(clip), "--target-epsilon", str(eps))))
        if clip_only:        # clipping alone (z = 0, no privacy): its cost apart from the noise
            out.append((f"{label}_{algo}_cliponly_s{seed}", run(algo, "--dp-clip", str(clip))))
    # Local (nothing sent, the same participation): the floor a personalised method keeps
    out.append((f"{label}_local_nodp_s{seed}", run("local")))
    return out


def jobs(seeds):
    out = []
    for seed in seeds:                                     # seed-major: whole seeds first
        out += _setting("A", COMMON_A, CLIP_A, EPSILONS_A, seed, clip_only=True)
    for seed in seeds[:2]:
        out += _setting("B", COMMON_B, CLIP_B, EPSILONS_B, seed, clip_only=False)
    return out


def run(args):
    os.makedirs(OUT, exist_ok=True)
    todo = [(n, a) for n, a in jobs(args.seeds)
            if n.startswith(args.only) and not os.path.exists(f"{OUT}/{n}/summary.json")]
    running = []
    while todo or running:
        while todo and len(running) < args.jobs:
            name, argv = todo.pop(0)
            cmd = [sys.executable, "experiments/run.py", *argv, "--out", f"{OUT}/{name}",
                   "--overwrite"]
            log = open(f"{OUT}/{name}.log", "w")
            log.write(" ".join(cmd) + "\n")
            log.flush()
            running.append((name, subprocess.Popen(cmd, cwd=REPO, stdout=log,
                                                   stderr=subprocess.STDOUT), time.time()))
        time.sleep(2)
        for item in list(running):
            name, proc, t0 = item
            if proc.poll() is not None:
                running.remove(item)
                print(f"{time.strftime('%H:%M:%S')} {name}: rc {proc.returncode}, "
                      f"{time.time() - t0:.0f} s", flush=True)


def load(name):
    try:
        with open(f"{OUT}/{name}/summary.json") as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def fmt(values):
    if not values:
        return "–"
    m = statistics.mean(values)
    if len(values) == 1:
        return f"{100 * m:.1f}"
    return f"{100 * m:.1f} ± {100 * statistics.stdev(values):.1f}"


def table(args):
    for setting, clips, epss in (("A", {**CLIP_A, "local": None}, EPSILONS_A),
                                 ("B", {**CLIP_B, "local": None}, EPSILONS_B)):
        print(f"\nsetting {setting}\n")
        print("| method | C | target ε | z | ε at δ | δ | seeds | acc_mean (%) | per seed (%) "
              "| drop from no DP (points) | shared model acc_mean (%) | clipped share | wall s |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for algo, clip in clips.items():
            base = None
            for level in ("nodp", "cliponly", *[f"e{e}" for e in epss]):
                accs, walls, clipped, priv, glob = [], [], [], None, []
                for seed in range(10):
                    s = load(f"{setting}_{algo}_{level}_s{seed}")
                    if s is None:
                        continue
                    accs.append(s["last"]["acc_mean"])
                    walls.append(s["wall_time_s"])
                    if "global_acc_mean" in s["last"]:
                        glob.append(s["last"]["global_acc_mean"])
                    if "dp_clipped_fraction" in s["last"]:
                        clipped.append(s["last"]["dp_clipped_fraction"])
                    priv = s.get("privacy") or priv
                if not accs:
                    continue
                if level == "nodp":
                    base = statistics.mean(accs)
                drop = "–" if level == "nodp" or base is None else \
                    f"{100 * (base - statistics.mean(accs)) + 0.0:.1f}".replace("-0.0", "0.0")
                if priv and level == "cliponly":
                    z, eps, delta, tgt = "0", "∞", "–", "clip only"
                elif priv:
                    z = f"{priv['noise_multiplier']:.3g}"
                    eps = f"{priv['dp_epsilon']:.2f}"
                    delta = f"{priv['delta']:.2g}"
                    tgt = f"{priv['target_epsilon']:g}"
                else:
                    z = eps = delta = tgt = "–"
                cl = f"{statistics.mean(clipped):.2f}" if clipped else "–"
                print(f"| {algo} | {clip if priv else '–'} | {tgt} | {z} | {eps} | {delta} | "
                      f"{len(accs)} | {fmt(accs)} | "
                      f"{', '.join(f'{100 * a:.1f}' for a in accs)} | {drop} | "
                      f"{fmt(glob) if glob else ('=' if algo == 'fedavg' else 'n/a')} | {cl} | "
                      f"{statistics.mean(walls):.0f} |")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--jobs", type=int, default=2)
    r.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    r.add_argument("--only", default="")
    sub.add_parser("table")
    args = p.parse_args()
    run(args) if args.cmd == "run" else table(args)


if __name__ == "__main__":
    main()
