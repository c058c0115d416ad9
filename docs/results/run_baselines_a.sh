#!/usr/bin/env bash
# Reproduces the runs behind docs/results/baselines_a.md (CPU, 2 cores). Results go to $OUT.
#   bash docs/results/run_baselines_a.sh
# FedProx, FedProx-FT, FedDyn, Ditto, APFL and Per-FedAvg (FO, HF) at their default
# hyperparameters, with FedAvg and FedAvg-FT rerun at this commit as references, on the digits
# partitions and presets of run_pgfed.sh and run_pfedsop.sh (same
# seeds and data flags, hence the same clients as the pgfed.md / pfedsop.md tables).
# GROUPS_TO_RUN (PGFed protocol), PRESETS and PFEDSOP_DATASETS (pFedSOP protocol) choose the parts
# to run; set empty, a part is skipped:
#   GROUPS_TO_RUN="digits:2" PRESETS="" bash ...   (one seed of the PGFed protocol only)
#   GROUPS_TO_RUN="" PFEDSOP_DATASETS=fashion_mnist bash ...   (pFedSOP protocol, Fashion-MNIST)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/baselines_a}

baselines=(
  --run "fedavg: --algo fedavg"
  --run "fedavg_ft: --algo fedavg_ft"
  --run "fedprox: --algo fedprox"
  --run "fedprox_ft: --algo fedprox_ft"
  --run "feddyn: --algo feddyn"
  --run "ditto: --algo ditto"
  --run "apfl: --algo apfl"
  --run "perfedavg fo: --algo perfedavg"
  --run "perfedavg hf: --algo perfedavg --perfedavg-variant hf"
)

# PGFed's protocol (as run_pgfed.sh): 25 clients, Dir(0.3), E = 5, B = 10, lr 0.005, momentum 0.9
# (persistent buffers), 300 rounds, seeds 0, 1, 2.
for group in ${GROUPS_TO_RUN-digits digits:1 digits:2}; do
  dataset=${group%%:*}; seed=0; dir=pgfed_$dataset
  if [[ $group == *:* ]]; then seed=${group##*:}; dir=pgfed_${dataset}_seed$seed; fi
  python experiments/compare.py --resume --out "$OUT/$dir" \
    --title "Baselines, PGFed protocol (25 clients, Dir(0.3)) on $dataset, MLP, seed $seed" \
    --common "--preset pgfed_paper --dataset $dataset --model mlp --rounds 300 --seed $seed" \
    "${baselines[@]}"
done

# pFedSOP's protocol (as run_pfedsop.sh): 100 clients, 20 % participation, one epoch of batch 50,
# 100 rounds. Digits: lr 0.1 (the learning rate selected for every method on digits in
# pfedsop.md). Fashion-MNIST (PFEDSOP_DATASETS="digits fashion_mnist"): the paper's grid
# {0.1, 0.01} for every baseline, selected as pfedsop.md selects (best-round mean).
for dataset in ${PFEDSOP_DATASETS-digits}; do
  for preset in ${PRESETS-pfedsop_paper pfedsop_paper_shards}; do
    extra=""
    if [ "$preset" = pfedsop_paper ]; then
      [ "$dataset" = digits ] && extra="--partition dirichlet_client"
      [ "$dataset" = fashion_mnist ] && extra="--min-size 5"
    fi
    if [ "$dataset" = digits ]; then
      python experiments/compare.py --resume --out "$OUT/pfedsop_digits_${preset}" \
        --title "Baselines, pFedSOP protocol ($preset) on digits, MLP, lr 0.1" \
        --common "--preset $preset --dataset digits --model mlp $extra --lr 0.1" \
        "${baselines[@]}"
    else
      grid=()
      for ((i = 1; i < ${#baselines[@]}; i += 2)); do
        name=${baselines[i]%%:*}; flags=${baselines[i]#*: }
        grid+=(--run "$name lr=0.1: $flags --lr 0.1" --run "$name lr=0.01: $flags --lr 0.01")
      done
      python experiments/compare.py --resume --out "$OUT/pfedsop_${dataset}_${preset}" \
        --title "Baselines, pFedSOP protocol ($preset) on $dataset, MLP, lr grid {0.1, 0.01}" \
        --common "--preset $preset --dataset $dataset --model mlp $extra" \
        "${grid[@]}"
    fi
  done
done
