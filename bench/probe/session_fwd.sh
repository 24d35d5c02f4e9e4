#!/usr/bin/env bash
# The third session's GPU runs (split kernel by block index, fp16 packed), in order on one machine:
#   bash bench/probe/session_fwd.sh probe   # split/packed tests, two probes, the bf16 multi_wave_cached sweep of the changed widths
#   bash bench/probe/session_fwd.sh tune    # the same sweep for fp16 and fp32
#   bash bench/probe/session_fwd.sh retune  # (a new machine) split/packed tests and the split widths again, three dtypes
#     (run once, on the block-wide-poll kernel that was then dropped: its configs were not kept)
#   bash bench/probe/session_fwd.sh final   # the mode=None tables (with small-M rows), then the GPU suite
#   bash bench/probe/session_fwd.sh bench   # forward benches against the anchors, three dtypes
# The fourth session's (stream kernel, confirmed sweeps, small-M configs), then final and bench again:
#   bash bench/probe/session_fwd.sh stream  # stream-kernel tests, the small-M config probe, the bf16 sweep of
#                                           # 512-16384 with --confirm, the static_persistent sweep in fp16 and fp32
#   bash bench/probe/session_fwd.sh narrow  # (after the multi-row weight fix) the narrow widths swept again in three
#                                           # dtypes with --confirm, then the mode=None tables
# The fifth session's (w_early: the weight's loads tied to the sum of squares), then final and bench again:
#   bash bench/probe/session_fwd.sh early   # w_early tests, the bf16 multi_wave_cached sweep of 8192-262144 with --confirm
#   bash bench/probe/session_fwd.sh early2  # the same sweep in fp16 and fp32
# The sixth session's (w_early wherever a small launch waits: multi-row tiles, a weight held across a
# persistent loop; NOTES item 17):
#   bash bench/probe/session_fwd.sh ends    # w_early tests, then the table's configs with w_early off/on at
#                                           # small M and at full size (three dtypes)
# The seventh session's (bf16 widened by its 32-bit words, no add for offset 0; NOTES item 18), run on
# 7c89589 with bench/probe/experiments/bf16_words_and_zero_offset.patch applied:
#   bash bench/probe/session_fwd.sh words   # the tree's kernels against 7c89589's, same configs, same run
#     (git show 7c89589:cutile_norms/cutile/rmsnorm_fwd.py > bench/probe/baseline_fwd.py first), then the
#     forward tests; the rerun with each part off: CN_SSQ_BY_WORDS=0 / CN_W_BY_WORDS=0 and
#     baseline_ab.py --ns 4096,7168,32768,65536
# The eighth session's (NOTES item 19: the split kernel by parts, cuTile copies, time against M, tie_slot):
#   bash bench/probe/session_fwd.sh parts   # the probes, then the table's configs with tie_slot against
#     91e4f46's (git show 91e4f46:cutile_norms/cutile/rmsnorm_fwd.py > bench/probe/baseline_fwd.py first),
#     then the tie_slot tests
# The ninth session's (NOTES item 20: tie_slot through the squares, blocks of 16-32 warps, cold starts):
#   bash bench/probe/session_fwd.sh tie2    # the table's tie_slot configs against 529f9a6's tie (git show
#     529f9a6:cutile_norms/cutile/rmsnorm_fwd.py > bench/probe/baseline_fwd.py first), the GPU suite, the
#     ablation probe's tie (float32:32768), then the bf16 and fp32 benches against QuACK
#   bash bench/probe/session_fwd.sh final9  # (after the bf16 sweep of 16384-262144 and the config_ab picks) the GPU
#     suite, the ablation probe's tie, the bf16 and fp16 benches against QuACK
#   bash bench/probe/session_fwd.sh spread9 # the first wave's cold costs for the new table configs, then the bf16
#     bench three times at 8192-65536 against QuACK (the spread)
#   (run before it, each on its own machine: `source .devkit/t135/setup.sh && bash bench/probe/wide_ctas.sh`, on the
#    experiment kit with tileiras 13.5 that bench/probe/build_t135_kit.sh builds; `python bench/probe/cold_start.py`; `python bench/probe/config_ab.py ...`)
# The tenth session's (NOTES item 21: clusters, a staggered first wave, rolled reload loops, torch.compile's kernel):
#   the probes, each run on its own: bench/probe/cluster_ab.sh, bench/probe/stagger_ab.sh (with
#   bench/probe/experiments/split_stagger.patch applied), bench/probe/reload_rolled_ab.sh (with
#   bench/probe/experiments/reload_rolled.patch applied), bench/probe/inductor_configs.py, bench/probe/wide_reload.sh
#   (experiment kit t135), bench/probe/triton_two_pass.py; then
#   bash bench/probe/session_fwd.sh final10   # the GPU suite, bf16 against QuACK, torch.compile and TileGym
#   bash bench/probe/session_fwd.sh final10b  # fp16 and fp32 against QuACK and torch.compile
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 OUT=${OUT:-bench/results}
mkdir -p "$OUT"
cp /tmp/cutile_norms_tuning/*.json cutile_norms/tuning/ 2>/dev/null  # what an earlier stage measured on this machine
gpu_suite() {
  timeout 260 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests > "$OUT/gpu_tests.log" 2>&1
  echo "GPU suite rc=$?"; tail -2 "$OUT/gpu_tests.log"
}
quack_benches() {  # the forward bench against QuACK (and ANCHORS, if set) for each dtype given, then mode=None's and the anchors' lines
  local anchors=quack${ANCHORS:+,$ANCHORS}
  for dt in "$@"; do
    timeout 240 python3 bench/rmsnorm.py --dtype $dt --anchors $anchors --no-backward --out "$OUT/bench_$dt" \
      > "$OUT/bench_$dt.log" 2>&1; echo "bench $dt rc=$?"
  done
  for dt in "$@"; do sed -n '/^Forward/,/^Small M/p' "$OUT/bench_$dt.log" | grep '^|' | cut -c1-240; done
}
case "${1:-}" in
  final10)  # the tenth session (NOTES item 21): the GPU suite, then bf16 against QuACK, torch.compile and TileGym
    gpu_suite
    ANCHORS=torch_compile,tilegym_static_persistent,tilegym_multi_wave_reload,tilegym_multi_wave_cached \
      quack_benches bfloat16 ;;
  final10b)  # then fp16 and fp32 against QuACK and torch.compile
    ANCHORS=torch_compile quack_benches float16 float32 ;;
  tie2)
    timeout 150 python3 bench/probe/baseline_ab.py --baseline bench/probe/baseline_fwd.py --dtypes bfloat16,float16,float32 \
      --ns 8192,32768,65536,131072,262144 --out "$OUT/tie2_ab.json" 2>&1 | grep -v -i warn | tail -22
    gpu_suite
    timeout 60 python3 bench/probe/split_ablation.py --cases float32:32768 --sizes 1 --rounds 3 --variants full \
      2>&1 | grep -v -i warn | tail -4
    quack_benches bfloat16 float32 ;;
  spread9)
    timeout 120 python3 bench/probe/cold_start.py --cases bfloat16:16384,bfloat16:32768,bfloat16:65536 --sizes 1,2 \
      --out "$OUT/cold_start.json" 2>&1 | grep -v -i warn | grep -v "^$"
    for i in 1 2 3; do
      timeout 120 python3 bench/rmsnorm.py --anchors quack --no-backward --small-m 1,64 --small-n 4096 \
        --ns 8192,16384,32768,65536 --out "$OUT/spread_$i" > "$OUT/spread_$i.log" 2>&1; echo "spread $i rc=$?"
      grep -E "cn.None|quack" "$OUT/spread_$i.log" | cut -c1-110
    done ;;
  final9)
    gpu_suite
    timeout 60 python3 bench/probe/split_ablation.py --cases float32:32768 --sizes 1 --rounds 3 --variants full,one_poll \
      2>&1 | grep -v -i warn | tail -4
    quack_benches bfloat16 float16 ;;
  parts)
    timeout 200 python3 bench/probe/split_ablation.py --cases bfloat16:32768,bfloat16:65536,float32:65536 \
      --out "$OUT/ablation.json" 2>&1 | grep -v -i warn
    timeout 200 python3 bench/probe/copy_residency.py --out "$OUT/residency.json" 2>&1 | grep -v -i warn
    timeout 200 python3 bench/probe/size_scaling.py --out "$OUT/size_scaling.json" 2>&1 | grep -v -i warn
    timeout 150 python3 bench/probe/baseline_ab.py --baseline bench/probe/baseline_fwd.py --dtypes float32,bfloat16,float16 \
      --ns 8192,32768,65536,131072,262144 --out "$OUT/tie_ab.json" 2>&1 | grep -v -i warn
    timeout 210 python3 -m pytest -m gpu -q -p no:cacheprovider tests/cutile/test_rmsnorm_fwd.py -k tie_slot \
      > "$OUT/tie_tests.log" 2>&1; echo "tie_slot tests rc=$?"; tail -2 "$OUT/tie_tests.log" ;;
  probe)
    timeout 180 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/cutile/test_rmsnorm_fwd.py -k "split or packed" \
      > "$OUT/split_tests.log" 2>&1; echo "split/packed tests rc=$?"; tail -3 "$OUT/split_tests.log"
    timeout 60 python3 bench/probe/small_m_latency.py > "$OUT/small_m_latency.log" 2>&1; cat "$OUT/small_m_latency.log"
    for dt in bfloat16 float16; do
      timeout 60 python3 bench/probe/split_fill_cost.py --dtype $dt 2>&1 | tee -a "$OUT/split_fill_cost.log"
    done
    DTYPES=bfloat16 SWEEP_ARGS="--ns 16384,32768,65536,131072,262144 --family multi_wave_cached" \
      timeout 200 bash bench/gpu_session.sh tune ;;
  tune)
    DTYPES=float16 SWEEP_ARGS="--ns 8192,16384,32768,65536,131072,262144 --family multi_wave_cached" \
      timeout 200 bash bench/gpu_session.sh tune
    DTYPES=float32 SWEEP_ARGS="--ns 32768,65536,131072,262144 --family multi_wave_cached" \
      timeout 120 bash bench/gpu_session.sh tune ;;
  retune)  # split/packed tests again, then the split widths swept again
    timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/cutile/test_rmsnorm_fwd.py -k "split or packed" \
      > "$OUT/split_tests.log" 2>&1; echo "split/packed tests rc=$?"; tail -3 "$OUT/split_tests.log"
    for dt in bfloat16 float16; do
      DTYPES=$dt SWEEP_ARGS="--ns 32768,65536,131072,262144 --family multi_wave_cached" timeout 120 bash bench/gpu_session.sh tune
    done
    DTYPES=float32 SWEEP_ARGS="--ns 65536,131072,262144 --family multi_wave_cached" timeout 100 bash bench/gpu_session.sh tune ;;
  stream)
    timeout 170 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/cutile/test_rmsnorm_fwd.py -k "stream" \
      > "$OUT/stream_tests.log" 2>&1; echo "stream tests rc=$?"; tail -3 "$OUT/stream_tests.log"
    timeout 70 python3 bench/probe/small_m_configs.py > "$OUT/small_m_configs.log" 2>&1; cut -c1-150 "$OUT/small_m_configs.log"
    DTYPES=bfloat16 SWEEP_ARGS="--ns 512,1024,2048,4096,8192,16384 --confirm 2 --rounds 5" \
      timeout 220 bash bench/gpu_session.sh tune
    DTYPES="float16 float32" SWEEP_ARGS="--ns 512,2048,4096,8192,16384 --family static_persistent --confirm 2 --rounds 3" \
      timeout 120 bash bench/gpu_session.sh tune ;;
  narrow)
    DTYPES=bfloat16 SWEEP_ARGS="--ns 128,512,1024,2048 --confirm 2 --rounds 5" timeout 150 bash bench/gpu_session.sh tune
    DTYPES="float16 float32" SWEEP_ARGS="--ns 128,512,1024 --confirm 2 --rounds 3" timeout 170 bash bench/gpu_session.sh tune
    timeout 200 bash bench/gpu_session.sh table | grep -E "^\| (128|512|1024|2048) \|" ;;
  early)
    timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/cutile/test_rmsnorm_fwd.py -k "w_early" \
      > "$OUT/w_early_tests.log" 2>&1; echo "w_early tests rc=$?"; tail -3 "$OUT/w_early_tests.log"
    timeout 60 python3 bench/probe/weight_cost.py --ns 16384,65536 2>&1 | tee "$OUT/weight_cost.log" | cut -c1-160
    DTYPES=bfloat16 SWEEP_ARGS="--ns 8192,16384,32768,65536,131072,262144 --family multi_wave_cached --confirm 2 --rounds 5" \
      timeout 330 bash bench/gpu_session.sh tune ;;
  early2)
    DTYPES=float16 SWEEP_ARGS="--ns 8192,16384,32768,65536,131072,262144 --family multi_wave_cached --confirm 2 --rounds 3" \
      timeout 280 bash bench/gpu_session.sh tune
    DTYPES=float32 SWEEP_ARGS="--ns 8192,16384,32768,65536,131072,262144 --family multi_wave_cached --confirm 2 --rounds 3" \
      timeout 250 bash bench/gpu_session.sh tune ;;
  ends)
    timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider tests/cutile/test_rmsnorm_fwd.py -k "w_early" \
      > "$OUT/w_early_tests.log" 2>&1; echo "w_early tests rc=$?"; tail -3 "$OUT/w_early_tests.log"
    timeout 320 python3 bench/probe/w_early_both_ends.py --ns 512,1024,2048,4096,8192 --out "$OUT/w_early_both_ends.json" \
      2>&1 | tee "$OUT/w_early_both_ends.log" | cut -c1-220 ;;
  words)
    timeout 300 python3 bench/probe/baseline_ab.py --baseline bench/probe/baseline_fwd.py --dtypes bfloat16 \
      --out "$OUT/ab_bf16.json" > "$OUT/ab_bf16.log" 2>&1; echo "ab bf16 rc=$?"
    timeout 100 python3 bench/probe/baseline_ab.py --baseline bench/probe/baseline_fwd.py --dtypes float16,float32 \
      --ns 4096,16384,65536 --rounds 3 --out "$OUT/ab_f16_f32.json" > "$OUT/ab_f16_f32.log" 2>&1; echo "ab f16/f32 rc=$?"
    timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/cutile/test_rmsnorm_fwd.py -k "offset or split or w_early" \
      > "$OUT/words_tests.log" 2>&1; echo "tests rc=$?"; tail -2 "$OUT/words_tests.log"
    cat "$OUT/ab_bf16.log" "$OUT/ab_f16_f32.log" | cut -c1-200 ;;
  final)
    timeout 300 bash bench/gpu_session.sh table
    timeout 280 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ > "$OUT/gpu_tests.log" 2>&1
    echo "gpu suite rc=$?"; tail -3 "$OUT/gpu_tests.log" ;;
  bench)
    python3 bench/rmsnorm.py --anchors quack,tilegym_static_persistent,tilegym_multi_wave_reload,tilegym_multi_wave_cached \
      --no-backward --out "$OUT" > "$OUT/bench_bf16.log" 2>&1; echo "bench rc=$?"
    for dt in float16 float32; do
      python3 bench/rmsnorm.py --dtype $dt --anchors quack --no-backward --out "$OUT" > "$OUT/bench_$dt.log" 2>&1
    done
    for f in "$OUT"/bench_*.log; do echo "== $f"; sed -n '/^Forward/,/^$/p;/^Small M, GPU/,/^$/p' "$f" | cut -c1-200; done ;;
  *) echo "usage: $0 probe|tune|retune|stream|narrow|early|early2|ends|words|final|bench|parts|tie2|final9|spread9|final10|final10b" >&2; exit 2 ;;
esac
