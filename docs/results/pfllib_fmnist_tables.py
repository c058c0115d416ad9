#!/usr/bin/env python
"""The tables of docs/results/pfllib_fmnist.md from the runs of run_pfllib_fmnist.sh.

    python docs/results/pfllib_fmnist_tables.py /tmp/pfllib_fmnist

One table per preset: our accuracy (PFLlib's reading: the best evaluated round's test accuracy
pooled over clients, Σ correct / Σ test samples = our `acc_weighted`; and our unweighted client
mean `acc_mean`), PFLlib's published accuracy (docs/benchmark.html of TsingZ0/PFLlib: 2,000
rounds, mean ± std of three trials), our seconds a round, and the seconds a round of PFLlib's one
epoch estimated from our client-steps/s (5,259 local steps a round in all on dir0.1, 5,249 on
the pathological split: 20 clients × ⌈n_i / 10⌉).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# PFLlib's leaderboard, FMNIST columns (pathological, practical Dir(0.1)): test accuracy %.
PFLLIB = {
    "fedavg": ("FedAvg", "80.41 ± 0.08", "85.85 ± 0.19"),
    "fedprox": ("FedProx", "78.08 ± 0.15", "85.63 ± 0.57"),
    "perfedavg": ("Per-FedAvg", "99.18 ± 0.08", "95.10 ± 0.10"),
    "pfedme": ("pFedMe", "99.35 ± 0.14", "97.25 ± 0.17"),
    "ditto": ("Ditto", "99.44 ± 0.06", "97.47 ± 0.04"),
    "apfl": ("APFL", "99.41 ± 0.02", "97.25 ± 0.08"),
    "fedfomo": ("FedFomo", "99.46 ± 0.01", "97.21 ± 0.02"),
    "fedamp": ("FedAMP", "99.42 ± 0.03", "97.20 ± 0.06"),
    "fedala": ("FedALA", "99.57 ± 0.01", "97.66 ± 0.02"),
    "fedper": ("FedPer", "99.47 ± 0.03", "97.44 ± 0.06"),
    "fedrep": ("FedRep", "99.56 ± 0.03", "97.56 ± 0.04"),
    "fedrod": ("FedRoD", "99.52 ± 0.05", "97.52 ± 0.04"),
    "fedbabu": ("FedBABU", "99.41 ± 0.05", "97.46 ± 0.07"),
}
# Rounds with work that does not scale with the local steps: FedFomo's clients evaluate up to 8
# candidate models on their validation split, FedALA's run ALA passes over 80 % of their data.
NOT_SCALED = {"fedfomo", "fedala"}
PRESETS = {"pfllib_fmnist_dir01": ("practical, Dir(0.1)", 2),
           "pfllib_fmnist_pat": ("pathological, 2 classes a client", 1)}


def table(out: Path, preset: str) -> str:
    title, column = PRESETS[preset]
    lines = [f"`{preset}` ({title}):", "",
             "| algorithm | ours: acc_weighted (acc_mean) % | rounds × local steps | PFLlib % (2,000 rounds × 1 epoch) "
             "| our s a round | est. s a round at 1 epoch | compile s |",
             "|---|---|---|---|---|---|---|"]
    for algo, names in PFLLIB.items():
        f = out / preset / algo / "summary.json"
        if not f.is_file():
            lines.append(f"| {names[0]} | not run | | {names[column]} | | | |")
            continue
        s = json.loads(f.read_text())
        cfg = json.loads((f.parent / "config.json").read_text())
        steps = (cfg.get("hparams") or {}).get("local_steps")
        epochs = cfg["hparams"].get("local_epochs", 1)
        work = (f"{s['last_completed_round']} × {steps}" if steps else
                f"{s['last_completed_round']} × {epochs} epoch{'s' if epochs > 1 else ''}")
        epoch_steps = cfg["data"]["train_size"]["total"] / cfg["hparams"]["batch_size"]
        scale = epoch_steps / (s["clients"] * steps) if steps else 1.0
        est = "–" if algo in NOT_SCALED and steps else f"{s['time_per_round_s'] * scale:.0f}"
        lines.append(
            f"| {names[0]} | {100 * s['best']['acc_weighted']:.2f} ({100 * s['best']['acc_mean']:.2f}) "
            f"| {work} | {names[column]} | {s['time_per_round_s']:.1f} | {est} "
            f"| {s['compile_time_s']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/pfllib_fmnist")
    print("\n\n".join(table(out, p) for p in PRESETS))


if __name__ == "__main__":
    main()
