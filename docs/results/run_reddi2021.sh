#!/usr/bin/env bash
# Reddi et al. (ICLR 2021) Table 1's FedAvg, FedAvgM, FedAdagrad, FedAdam and FedYogi rows on the
# five reddi2021_* presets (docs/presets.md), one after the other, where TFF's (or FedJAX's) files
# are in $DATA_DIR (docs/natural-data.md: fed_emnist_*.h5, shakespeare_*.h5, stackoverflow_*.h5,
# fed_cifar100_*.h5). Results go to $OUT/PRESET/OPT/; each run's summary.json holds the best and
# last accuracy (the paper reports the average over the last 100 rounds: metrics.jsonl has every
# round). Not run here: the files cannot be fetched on our machines (docs/results/reddi2021.md).
#   DATA_DIR=~/tff bash docs/results/run_reddi2021.sh
#   DATA_DIR=~/tff PRESETS=reddi2021_emnist OPTS="sgd adam" ROUNDS=100 bash docs/results/run_reddi2021.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${DATA_DIR:?set DATA_DIR to the folder of the TFF or FedJAX files}"
OUT=${OUT:-runs/reddi2021}
PRESETS=${PRESETS:-reddi2021_emnist reddi2021_shakespeare reddi2021_stackoverflow_nwp reddi2021_stackoverflow_tp reddi2021_cifar100}
OPTS=${OPTS:-sgd momentum adagrad adam yogi}
rounds=()
if [[ -n ${ROUNDS:-} ]]; then rounds=(--rounds "$ROUNDS"); fi     # default: the preset's (the paper's)

for preset in $PRESETS; do
  for opt in $OPTS; do
    dir=$OUT/$preset/$opt
    if [[ -f $dir/summary.json ]]; then continue; fi               # finished
    again=(); if [[ -d $dir/checkpoints ]]; then again=(--resume); fi   # interrupted: continue it
    python experiments/run.py --preset "$preset" --server-opt "$opt" "${rounds[@]}" \
      --eval-every "${EVAL_EVERY:-10}" --data-dir "$DATA_DIR" --out "$dir" "${again[@]}"
  done
done
