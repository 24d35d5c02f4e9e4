#!/usr/bin/env bash
# The two-pass kernel with its chunk loops kept rolled (FwdConfig.rolled: a trip count the compiler
# cannot see, so fewer chunks in flight per block, as Inductor's looped reduction has), against the
# table's config and the unrolled loops (bench/NOTES.md item 21).
#   git apply bench/probe/experiments/reload_rolled.patch && bash bench/probe/reload_rolled_ab.sh [ROUNDS]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/results}; mkdir -p "$OUT"
ROUNDS=${1:-5}
source bench/probe/ab.sh
for n in 8192 16384 32768 65536; do
  ab rolled_ab $n "kernel=reload chunk=2048 num_worker_warps=8" \
    "kernel=reload chunk=2048 num_worker_warps=8 rolled=1" "kernel=reload chunk=4096 num_worker_warps=8 rolled=1" \
    "kernel=reload chunk=1024 rolled=1" "kernel=reload chunk=2048 rolled=1"
done
