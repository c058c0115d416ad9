#!/usr/bin/env bash
# Reproduces the runs behind docs/results/tdpfed.md (CPU, 2 cores). Results go to $OUT.
#   bash docs/results/run_tdpfed.sh                        # both datasets
#   GROUPS_TO_RUN=digits bash docs/results/run_tdpfed.sh   # one
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/tdpfed}

# TDPFed's MNIST protocol (preset tdpfed_paper): 20 clients with two labels each, S = K = 20,
# |B| = 20, tau = 23, s = 5, s' = 17, lambda = 12, eta_p = 0.08 (NAG 0.9), eta = 8e-4 (Adam),
# 784-100-10 DNN (64-100-10 on the 8x8 digits). Digits runs the paper's 800 rounds; Fashion-MNIST
# (70,000 images, ~4 s per TDPFed round on 2 cores) runs 150. --resume reuses finished runs.
for group in ${GROUPS_TO_RUN:-digits fashion_mnist}; do
  rounds=800; [[ $group == fashion_mnist ]] && rounds=${FMNIST_ROUNDS:-150}
  python experiments/compare.py --resume --out "$OUT/$group" \
    --title "TDPFed protocol (20 clients, 2 labels each) on $group, DNN, $rounds rounds" \
    --common "--preset tdpfed_paper --dataset $group --model mlp --rounds $rounds" \
    --run "tdpfed x1.5 AFM: --algo tdpfed --tdpfed-cr 1.5" \
    --run "tdpfed x2 AFM: --algo tdpfed --tdpfed-cr 2" \
    --run "tdpfed x2 AFM eta=3e-4: --algo tdpfed --tdpfed-cr 2 --lr 3e-4" \
    --run "tdpfed x1.5 ACT: --algo tdpfed --tdpfed-cr 1.5 --tdpfed-aggregate act" \
    --run "tdpfed x2 ACT: --algo tdpfed --tdpfed-cr 2 --tdpfed-aggregate act" \
    --run "tdpfed x2 AFM beta=1.4: --algo tdpfed --tdpfed-cr 2 --tdpfed-beta 1.4" \
    --run "tdpfed x2 AFM beta=1.8: --algo tdpfed --tdpfed-cr 2 --tdpfed-beta 1.8" \
    --run "pfedme: --algo pfedme" \
    --run "fedavg: --algo fedavg" \
    --run "fedavg_sar x1.5: --algo fedavg_sar --sar-cr 1.5 --sar-mask-fill zero" \
    --run "fedavg_sar x2: --algo fedavg_sar --sar-cr 2 --sar-mask-fill zero" \
    --run "fedavg_sar x2 keep: --algo fedavg_sar --sar-cr 2 --sar-mask-fill keep"
done
