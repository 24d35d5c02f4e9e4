#!/usr/bin/env bash
# The two-pass kernel with its chunk loops kept rolled (FwdConfig.rolled: a trip count the compiler
# cannot see, so fewer chunks in flight per block, as Inductor's looped reduction has), against the
# table's config and the unrolled loops (bench/NOTES.md item 21).
#   git apply bench/probe/experiments/reload_rolled.patch && bash bench/probe/reload_rolled_ab.sh [ROUNDS]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/results}; mkdir -p "$OUT"
R=${1:-5}
for n in 8192 16384 32768 65536; do
  timeout 150 python3 bench/probe/config_ab.py --case bfloat16:$n --sizes 1,2 --rounds "$R" \
    --out "$OUT/rolled_ab_$n.json" table "kernel=reload chunk=2048 num_worker_warps=8" \
    "kernel=reload chunk=2048 num_worker_warps=8 rolled=1" "kernel=reload chunk=4096 num_worker_warps=8 rolled=1" \
    "kernel=reload chunk=1024 rolled=1" "kernel=reload chunk=2048 rolled=1" 2>&1 | grep -v -i warn | grep -v "^$"
done
