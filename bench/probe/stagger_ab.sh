#!/usr/bin/env bash
# The split kernel's first wave started in groups (FwdConfig.stagger: blocks below stagger_w wait
# bid % stagger L2 round trips before their loads), against the table's config (bench/NOTES.md item 21).
#   git apply bench/probe/experiments/split_stagger.patch && bash bench/probe/stagger_ab.sh [ROUNDS]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/results}; mkdir -p "$OUT"
ROUNDS=${1:-5}
source bench/probe/ab.sh
staggered() {  # N, first-wave blocks (SMs x CTAs per SM), then extra configs
  local n=$1 w=$2; shift 2
  ab stagger_ab $n "table stagger=2 stagger_w=$w" "table stagger=4 stagger_w=$w" "table stagger=8 stagger_w=$w" \
    "table stagger=4 stagger_w=1073741824" "$@"
}
staggered 16384 660
staggered 32768 792
staggered 65536 792 "table stagger=4 stagger_w=792 occupancy=5" "table occupancy=5"
