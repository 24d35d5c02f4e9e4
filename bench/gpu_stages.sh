#!/usr/bin/env bash
# The GPU runs in stages (each fits one 10-minute device call; run them in order on one machine):
#   bash bench/gpu_stages.sh tune    # sweep the cuTile forward configs (DTYPES, default bf16), write the config table
#   bash bench/gpu_stages.sh table   # bench our modes per dtype, write the mode=None table
#   bash bench/gpu_stages.sh bench   # the full bf16 bench against the anchors, forward + backward
#   bash bench/gpu_stages.sh check   # GPU test suite + fp16/fp32 benches against QuACK
#   bash bench/gpu_stages.sh suite   # the whole GPU test suite in parallel shards (tests/run_sharded.py)
#   bash bench/gpu_stages.sh bwd-tune   # sweep the backward's configs (DTYPES), write its config table
#   bash bench/gpu_stages.sh bwd-bench  # the backward against QuACK and torch.compile, bf16 then fp16/fp32
#   bash bench/gpu_stages.sh triton     # the Triton mode: its GPU tests, then bf16 forward + backward against Liger
#   bash bench/gpu_stages.sh figure     # the README's bf16 figure and table: our modes against QuACK, Liger, torch.compile
# Tuning tables written by a stage are kept in $KEEP (outside the repo); the next stage restores them over
# the committed cutile_norms/tuning/ only when asked (RESTORE=1, for a tune -> table -> bench sequence on
# one machine): by default every stage runs the shipped tables. Every result lands in $OUT (or bench/results).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}; KEEP=${KEEP:-/tmp/cutile_norms_tuning}
mkdir -p "$OUT" "$KEEP" cutile_norms/tuning
if [ "${RESTORE:-0}" = 1 ]; then cp "$KEEP"/*.json cutile_norms/tuning/ 2>/dev/null; fi
# the bench log's tables whose titles match $1 (a title, a blank line, then the table's rows)
tables() { awk -v pat="$1" '$0 ~ "^(" pat ")" {p = 1; print; next} p && /^\|/ {print; t = 1; next} t && !/^\|/ {p = t = 0; print ""}' "$2"; }
keep() { cp cutile_norms/tuning/*.json "$KEEP"/ 2>/dev/null; cp cutile_norms/tuning/*.json "$OUT"/ 2>/dev/null; true; }
export PYTHONUNBUFFERED=1
case "${1:-}" in
  tune)  # DTYPES="bfloat16 float16 float32" to sweep several (each dtype keeps its own entries);
         # SWEEP_ARGS="--ns ... --family ..." to sweep part of the table
    for dt in ${DTYPES:-bfloat16}; do
      python3 bench/tune/cutile_rmsnorm_fwd.py --dtype $dt ${SWEEP_ARGS:-} --write-configs --out "$OUT" > "$OUT/sweep_$dt.log" 2>&1
      keep; echo "== $dt"; sed -n '/summary/,$p' "$OUT/sweep_$dt.log"
    done ;;
  table)
    for dt in bfloat16 float16 float32; do
      python3 bench/rmsnorm.py --dtype $dt --anchors none --no-backward --small-m 1,64,1024 --small-n 1024,4096,16384,65536 --write-table \
        --out "$OUT/table_$dt" > "$OUT/table_$dt.log" 2>&1 || echo "table $dt failed"
      keep
    done
    grep -h "^| " "$OUT"/table_*/rmsnorm_*.md | cut -c1-160 | head -80 ;;
  bench)
    python3 bench/rmsnorm.py --anchors quack,liger,torch_eager,tilegym_static_persistent,tilegym_multi_wave_reload,tilegym_multi_wave_cached \
      --out "$OUT" > "$OUT/bench_bf16.log" 2>&1
    sed -n '/^# RMSNorm bench/,$p' "$OUT/bench_bf16.log" ;;
  check)
    python3 -m pytest -m gpu -q -p no:cacheprovider tests/ > "$OUT/gpu_tests.log" 2>&1; tail -3 "$OUT/gpu_tests.log"
    for dt in float16 float32; do
      python3 bench/rmsnorm.py --dtype $dt --anchors quack --no-backward --out "$OUT" > "$OUT/bench_$dt.log" 2>&1
      tables "Forward|Small M" "$OUT/bench_$dt.log" | head -40
    done ;;
  suite)
    timeout ${SUITE_TIMEOUT:-540} python3 tests/run_sharded.py --shards ${SHARDS:-10} --timeout ${SHARD_TIMEOUT:-480} --logs "$OUT" -- -m gpu ${SUITE_ARGS:-tests/} ;;
  bwd-tune)
    for dt in ${DTYPES:-bfloat16}; do
      python3 bench/tune/cutile_rmsnorm_bwd.py --dtype $dt ${SWEEP_ARGS:-} --write-configs --out "$OUT" > "$OUT/bwd_sweep_$dt.log" 2>&1
      keep; echo "== $dt"; sed -n '/summary/,$p' "$OUT/bwd_sweep_$dt.log"
    done ;;
  bwd-bench)
    for dt in ${DTYPES:-bfloat16 float16 float32}; do
      python3 bench/rmsnorm.py --dtype $dt --modes multi_wave_cached --anchors ${ANCHORS:-quack,torch_compile,torch_eager} \
        --no-forward --out "$OUT/bwd_$dt" ${BENCH_ARGS:-} > "$OUT/bwd_bench_$dt.log" 2>&1 || echo "bench $dt failed"
      tables "Backward|Small M, forward \\+ backward|Small M, GPU" "$OUT/bwd_bench_$dt.log"
    done ;;
  triton)
    timeout ${TEST_TIMEOUT:-240} python3 -m pytest -m "gpu and not big" -x -q -p no:cacheprovider tests/triton \
      > "$OUT/triton_tests.log" 2>&1; tail -3 "$OUT/triton_tests.log"
    python3 bench/rmsnorm.py --modes triton --anchors ${ANCHORS:-liger} ${BENCH_ARGS:-} --out "$OUT/triton" \
      > "$OUT/triton_bench.log" 2>&1 || echo "triton bench failed"
    tables "Forward|Backward" "$OUT/triton_bench.log" ;;
  figure)
    python3 bench/rmsnorm.py --modes ${MODES:-multi_wave_cached,triton} --anchors ${ANCHORS:-quack,liger,torch_compile} \
      ${BENCH_ARGS:-} --out "$OUT/figure" > "$OUT/figure.log" 2>&1 || echo "figure bench failed"
    tables "Forward|Backward|Small M" "$OUT/figure.log" ;;
  *) echo "usage: $0 tune|table|bench|check|suite|bwd-tune|bwd-bench|triton|figure" >&2; exit 2 ;;
esac
