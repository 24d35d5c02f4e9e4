#!/usr/bin/env bash
# The split kernel's first wave started in groups (FwdConfig.stagger: blocks below stagger_w wait
# bid % stagger L2 round trips before their loads), against the table's config (bench/NOTES.md item 21).
#   git apply bench/probe/experiments/split_stagger.patch && bash bench/probe/stagger_ab.sh [ROUNDS]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/results}; mkdir -p "$OUT"
R=${1:-5}
ab() {  # N, first-wave blocks (SMs x CTAs per SM), then extra configs
  local n=$1 w=$2; shift 2
  timeout 150 python3 bench/probe/config_ab.py --case bfloat16:$n --sizes 1,2 --rounds "$R" \
    --out "$OUT/stagger_ab_$n.json" table "table stagger=2 stagger_w=$w" "table stagger=4 stagger_w=$w" \
    "table stagger=8 stagger_w=$w" "table stagger=4 stagger_w=1073741824" "$@" 2>&1 | grep -v -i warn | grep -v "^$"
}
ab 16384 660
ab 32768 792
ab 65536 792 "table stagger=4 stagger_w=792 occupancy=5" "table occupancy=5"
