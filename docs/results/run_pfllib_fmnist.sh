#!/usr/bin/env bash
# Runs behind docs/results/pfllib_fmnist.md: PFLlib's leaderboard protocol on Fashion-MNIST
# (presets pfllib_fmnist_dir01 and pfllib_fmnist_pat) for the 13 algorithms PFLlib shares with us,
# one after the other. Results go to $OUT/PRESET/ALGO/; a table of them to $OUT/table.tsv.
#   bash docs/results/run_pfllib_fmnist.sh                                       # what the page ran
#   ROUNDS=2000 LOCAL_STEPS= EVAL_EVERY=1 bash docs/results/run_pfllib_fmnist.sh  # PFLlib's protocol
#
# Defaults are what 2 shared CPU cores allowed in ~45 minutes for all 26 runs: ROUNDS=3 rounds of
# LOCAL_STEPS=20 local steps (B = 10) each, evaluated at the end only. An empty LOCAL_STEPS keeps the
# preset's one local epoch (PFLlib's E = 1: ≈ 263 steps for the average client, 5,259 steps in all a
# round), EVAL_EVERY=1 evaluates every round as PFLlib does (its number is the best round's).
# DATA_DIR: the folder of Fashion-MNIST's four .gz files (Debian's dataset-fashion-mnist by default).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/pfllib_fmnist}
ROUNDS=${ROUNDS:-3}
LOCAL_STEPS=${LOCAL_STEPS-20}
EVAL_EVERY=${EVAL_EVERY:-$ROUNDS}
DATA_DIR=${DATA_DIR:-/usr/share/datasets/fashion-mnist}
PRESETS=${PRESETS:-pfllib_fmnist_dir01 pfllib_fmnist_pat}
ALGOS=${ALGOS:-fedavg fedprox perfedavg pfedme ditto apfl fedfomo fedamp fedala fedper fedrep fedrod fedbabu}

# FedRep counts its head and body phases in epochs (it refuses --local-steps): the presets give it
# PFLlib's 1 head epoch (-pls 1) and 1 body epoch (-ls 1), our --local-epochs 2
# --fedrep-head-epochs 1; with LOCAL_STEPS set it runs FEDREP_ROUNDS (default 1) such rounds.
FEDREP_ROUNDS=${FEDREP_ROUNDS:-$([[ -n $LOCAL_STEPS ]] && echo 1 || echo "$ROUNDS")}
for preset in $PRESETS; do
  for algo in $ALGOS; do
    work=(); rounds=$ROUNDS; every=$EVAL_EVERY
    if [[ $algo == fedrep ]]; then
      rounds=$FEDREP_ROUNDS
      if [[ -n $LOCAL_STEPS ]]; then every=$rounds; fi
    elif [[ -n $LOCAL_STEPS ]]; then
      work=(--local-steps "$LOCAL_STEPS")
    fi
    dir=$OUT/$preset/$algo
    if [[ -f $dir/summary.json ]]; then continue; fi      # a rerun skips the finished runs
    start=$(date +%s)
    nice -n 10 python experiments/run.py --preset "$preset" --algo "$algo" --rounds "$rounds" \
      "${work[@]}" --eval-every "$every" --data-dir "$DATA_DIR" --out "$dir" --overwrite \
      --quiet > "$OUT/$preset.$algo.log" 2>&1 || echo "$preset $algo failed: see $OUT/$preset.$algo.log"
    echo "$preset $algo $(( $(date +%s) - start )) s"
  done
done

# One row a run: PFLlib's reading (best over the evaluated rounds of the test accuracy pooled over
# clients, i.e. weighted by their test samples: acc_weighted) and ours (acc_mean), per-round wall.
python - "$OUT" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
rows = ["preset\talgo\trounds\tacc_weighted_best\tacc_mean_best\ts_per_round\tclient_steps_per_s\tcompile_s\twall_s"]
for f in sorted(out.glob("*/*/summary.json")):
    s = json.loads(f.read_text())
    rows.append("\t".join(str(v) for v in (
        f.parent.parent.name, s["algo"], s["last_completed_round"],
        round(s["best"]["acc_weighted"], 4), round(s["best"]["acc_mean"], 4),
        round(s["time_per_round_s"], 2), round(s["client_steps_per_s"], 1),
        round(s["compile_time_s"], 1), round(s["wall_time_s"], 1))))
(out / "table.tsv").write_text("\n".join(rows) + "\n")
print("\n".join(rows))
EOF
