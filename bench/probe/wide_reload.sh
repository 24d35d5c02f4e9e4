#!/usr/bin/env bash
# Probe: the two-pass kernel in blocks of 16 and 32 warps, the launch configs torch.compile's
# autotuner picks for this op (bench/probe/inductor_configs.py: 16 warps with 8192-column chunks at
# N = 8192, 16 warps with 2048 at 16384, 32 warps with the whole row at 32768), against the table's.
# num_worker_warps 16/32 needs tileiras 13.5: run on the device after `source .devkit/t135/setup.sh`
# (the experiment kit bench/probe/build_t135_kit.sh builds; bench/NOTES.md items 20, 21).
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source bench/probe/ab.sh
ab wide_reload 8192 "kernel=reload chunk=8192 num_worker_warps=16" "kernel=reload chunk=4096 num_worker_warps=16" \
  "kernel=reload chunk=2048 num_worker_warps=16" "kernel=cached piece_min=8192 packed=True w_early=True num_worker_warps=16 occupancy=4"
ab wide_reload 16384 "kernel=reload chunk=2048 num_worker_warps=16" "kernel=reload chunk=4096 num_worker_warps=16" \
  "kernel=reload chunk=16384 num_worker_warps=32"
ab wide_reload 32768 "kernel=reload chunk=32768 num_worker_warps=32" "kernel=reload chunk=4096 num_worker_warps=16" \
  "kernel=reload chunk=8192 num_worker_warps=32"
