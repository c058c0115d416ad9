#!/usr/bin/env bash
# Reproduces the runs behind docs/results/baselines_b.md (CPU, 2 cores): the split-model baselines
# (FedRep, LG-FedAvg, FedRoD, FedBABU, and FedPer for reference) on the digits sections of
# pgfed.md and pfedsop.md, with the same partitions and common flags. Results go to $OUT.
#   bash docs/results/run_baselines_b.sh
# GROUPS_TO_RUN, PRESETS (a) and DATASETS (b) choose the parts to run; set empty, a part is skipped:
#   GROUPS_TO_RUN="digits:2" DATASETS="" bash ...   (one seed of the PGFed protocol only)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/baselines_b}

# PGFed's protocol (preset pgfed_paper, as run_pgfed.sh): 25 clients, Dir(0.3), E = 5, B = 10,
# lr 0.005, SGD momentum 0.9 with persistent per-client buffers, 300 rounds; seeds 0, 1, 2.
# Each baseline at its defaults (FedRep: 1 head epoch of the 5; FedBABU: 1 fine-tuning epoch at
# lr / 5 = 0.001, the reference code's example).
for group in ${GROUPS_TO_RUN-digits digits:1 digits:2}; do
  dataset=${group%%:*}; seed=0; dir=pgfed_$dataset
  if [[ $group == *:* ]]; then seed=${group##*:}; dir=pgfed_${dataset}_seed$seed; fi
  python experiments/compare.py --resume --out "$OUT/$dir" \
    --title "Split-model baselines, PGFed protocol (25 clients, Dir(0.3)) on $dataset, MLP, seed $seed" \
    --common "--preset pgfed_paper --dataset $dataset --model mlp --rounds 300 --seed $seed" \
    --run "fedper: --algo fedper" \
    --run "fedrep: --algo fedrep" \
    --run "lg_fedavg: --algo lg_fedavg" \
    --run "fedrod: --algo fedrod" \
    --run "fedbabu: --algo fedbabu"
done

# pFedSOP's protocol (presets pfedsop_paper / pfedsop_paper_shards, as run_pfedsop.sh): 100
# clients, 20 % participation, one epoch of batch-50 SGD, 100 rounds; digits uses the per-client
# Dirichlet reading. Learning rate 0.1: of the paper's grid {0.1, 0.01}, the one every method
# of pfedsop.md's digits tables was selected at (only it was run here, for time).
# FedRep needs E >= 2 for a head epoch and a body epoch (its --fedrep-head-epochs are part of
# --local-epochs), so it runs E = 2: one head epoch, then one body epoch (one epoch more of
# local computation than the others).
# Fashion-MNIST: the paper's grid {0.1, 0.01} for every method, selected as pfedsop.md selects
# (best-round mean); digits keeps lr 0.1 only.
split_family=(
  "fedper: --algo fedper"
  "fedrep: --algo fedrep --local-epochs 2"
  "lg_fedavg: --algo lg_fedavg"
  "fedrod: --algo fedrod"
  "fedbabu: --algo fedbabu"
)
for dataset in ${DATASETS-digits}; do
  lrs="0.1"; [ "$dataset" = fashion_mnist ] && lrs="0.1 0.01"
  for preset in pfedsop_paper pfedsop_paper_shards; do
    extra=""
    if [ "$preset" = pfedsop_paper ]; then
      [ "$dataset" = fashion_mnist ] && extra="--min-size 5"
      [ "$dataset" = digits ] && extra="--partition dirichlet_client"
    fi
    runs=()
    for run in "${split_family[@]}"; do
      for lr in $lrs; do
        runs+=(--run "${run%%:*} lr=$lr: ${run#*: } --lr $lr")
      done
    done
    python experiments/compare.py --resume --out "$OUT/pfedsop_${dataset}_${preset}" \
      --title "Split-model baselines, pFedSOP protocol ($preset) on $dataset, MLP" \
      --common "--preset $preset --dataset $dataset --model mlp $extra" \
      "${runs[@]}"
  done
done
