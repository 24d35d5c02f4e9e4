#!/usr/bin/env bash
# The cached kernel with the row split by the compiler over a cluster of num_ctas CTAs (cuTile's
# num_ctas hint: DSMEM partial sums, cluster barriers), against the table's config (bench/NOTES.md item 21).
# A cluster of k CTAs of 8 warps holds a row with 1/k of it per CTA: 2 vectors of x per thread at
# 8192/2, 16384/4, 32768/8, where the table's one-block and split configs hold 4-8.
#   bash bench/probe/cluster_ab.sh [ROUNDS]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/results}; mkdir -p "$OUT"
ROUNDS=${1:-5}
source bench/probe/ab.sh
P="kernel=cached packed=True w_early=True"
ab cluster_ab 8192 "$P piece_min=8192 num_worker_warps=8 num_ctas=2" "$P piece_min=8192 num_worker_warps=4 num_ctas=2" \
  "kernel=cached w_early=True piece_min=8192 num_worker_warps=8 num_ctas=2"
ab cluster_ab 16384 "$P piece_min=16384 num_worker_warps=8 num_ctas=4" "$P piece_min=16384 num_worker_warps=8 num_ctas=2"
ab cluster_ab 32768 "$P piece_min=32768 num_worker_warps=8 num_ctas=8" "$P piece_min=32768 num_worker_warps=8 num_ctas=4"
ab cluster_ab 65536 "$P piece_min=65536 num_worker_warps=8 num_ctas=8" "kernel=cached packed=True piece_min=65536 num_worker_warps=8 num_ctas=8"
