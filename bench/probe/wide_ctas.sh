#!/usr/bin/env bash
# Probe: blocks of 16 and 32 warps (one or two 16-byte vectors per thread) for the rows that a 4-8 warp
# block holds as 4-16 vectors per thread (bf16 8192-65536). num_worker_warps 16/32 needs tileiras 13.5.
# Run on the device after `source .devkit/t135/setup.sh` (the experiment kit bench/probe/build_t135_kit.sh builds;
# bench/NOTES.md item 20).
set -u
O=${OUT:-/tmp/out}; mkdir -p $O
python bench/probe/copy_residency.py --kibs 4,8,16,32 --warps 4,8,16,32 --no-persistent --split-ns "" \
  --rounds 5 --out $O/copies.json > $O/copies.log 2>&1; tail -20 $O/copies.log
E="packed=True w_early=True"
python bench/probe/config_ab.py --case bfloat16:8192 --sizes 1,2 --out $O/ab8192.json table \
  "kernel=cached piece_min=8192 $E num_worker_warps=16 occupancy=3" \
  "kernel=cached piece_min=8192 $E num_worker_warps=16 occupancy=4" \
  "kernel=cached piece_min=8192 $E num_worker_warps=32 occupancy=2" > $O/ab8192.log 2>&1; tail -6 $O/ab8192.log
python bench/probe/config_ab.py --case bfloat16:16384 --sizes 1,2 --out $O/ab16384.json table \
  "kernel=cached piece_min=16384 $E num_worker_warps=16 occupancy=2" \
  "kernel=cached piece_min=16384 $E num_worker_warps=32 occupancy=2" \
  "kernel=split split=2 piece_min=8192 $E num_worker_warps=16 occupancy=3" > $O/ab16384.log 2>&1; tail -6 $O/ab16384.log
python bench/probe/config_ab.py --case bfloat16:32768 --sizes 1,2 --out $O/ab32768.json table \
  "kernel=split split=4 piece_min=8192 $E num_worker_warps=16 occupancy=3" \
  "kernel=split split=4 piece_min=8192 $E num_worker_warps=32" \
  "kernel=split split=2 piece_min=16384 $E num_worker_warps=32" > $O/ab32768.log 2>&1; tail -6 $O/ab32768.log
python bench/probe/config_ab.py --case bfloat16:65536 --sizes 1,2 --out $O/ab65536.json table \
  "kernel=split split=8 piece_min=8192 $E num_worker_warps=16 occupancy=3" \
  "kernel=split split=8 piece_min=8192 $E num_worker_warps=32" \
  "kernel=split split=4 piece_min=16384 $E num_worker_warps=32" > $O/ab65536.log 2>&1; tail -6 $O/ab65536.log
