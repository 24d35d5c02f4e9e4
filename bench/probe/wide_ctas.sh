#!/usr/bin/env bash
# Probe: blocks of 16 and 32 warps (one or two 16-byte vectors per thread) for the rows that a 4-8 warp
# block holds as 4-16 vectors per thread (bf16 8192-65536). num_worker_warps 16/32 needs tileiras 13.5.
# Run on the device after `source .devkit/t135/setup.sh` (the experiment kit bench/probe/build_t135_kit.sh builds;
# bench/NOTES.md item 20).
set -u
O=${OUT:-/tmp/out}; mkdir -p $O
python bench/probe/copy_residency.py --kibs 4,8,16,32 --warps 4,8,16,32 --no-persistent --split-ns "" \
  --rounds 5 --out $O/copies.json > $O/copies.log 2>&1; tail -20 $O/copies.log
ab() {  # N, then configs (config_ab.py syntax) against the table's
  local n=$1; shift
  python bench/probe/config_ab.py --case bfloat16:$n --sizes 1,2 --out $O/ab$n.json table "$@" > $O/ab$n.log 2>&1
  tail -6 $O/ab$n.log
}
E="packed=True w_early=True"
ab 8192 "kernel=cached piece_min=8192 $E num_worker_warps=16 occupancy=3" \
  "kernel=cached piece_min=8192 $E num_worker_warps=16 occupancy=4" "kernel=cached piece_min=8192 $E num_worker_warps=32 occupancy=2"
ab 16384 "kernel=cached piece_min=16384 $E num_worker_warps=16 occupancy=2" \
  "kernel=cached piece_min=16384 $E num_worker_warps=32 occupancy=2" "kernel=split split=2 piece_min=8192 $E num_worker_warps=16 occupancy=3"
ab 32768 "kernel=split split=4 piece_min=8192 $E num_worker_warps=16 occupancy=3" \
  "kernel=split split=4 piece_min=8192 $E num_worker_warps=32" "kernel=split split=2 piece_min=16384 $E num_worker_warps=32"
ab 65536 "kernel=split split=8 piece_min=8192 $E num_worker_warps=16 occupancy=3" \
  "kernel=split split=8 piece_min=8192 $E num_worker_warps=32" "kernel=split split=4 piece_min=16384 $E num_worker_warps=32"
