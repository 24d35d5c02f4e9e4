#!/usr/bin/env bash
# GPU session for the split kernel and packed 16-bit rows: their tests first, then bench/gpu_session.sh.
#   bash bench/probe/session_split.sh tune     # split/packed GPU tests, then the full config sweep
#   bash bench/probe/session_split.sh table|bench|check
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 OUT=${OUT:-bench/results}
mkdir -p "$OUT"
if [ "${1:-}" = tune ]; then
  timeout 150 python -m pytest -m gpu -q -x -p no:cacheprovider tests/cutile/test_rmsnorm_fwd.py -k "split or packed" \
    > "$OUT/split_tests.log" 2>&1; echo "split/packed tests rc=$?"; tail -3 "$OUT/split_tests.log"
fi
case "${1:-}" in
  final1)  # the bf16 mode=None table again, then the GPU suite
    python3 bench/rmsnorm.py --dtype bfloat16 --anchors none --no-backward --small-m "" --write-table \
      --out "$OUT/table_bfloat16" > "$OUT/table_bfloat16.log" 2>&1; echo "table rc=$?"
    cp cutile_norms/tuning/*.json "$OUT"/; grep -h "^| " "$OUT"/table_bfloat16/rmsnorm_*.md | head -16
    timeout 420 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ > "$OUT/gpu_tests.log" 2>&1
    echo "gpu suite rc=$?"; tail -3 "$OUT/gpu_tests.log" ;;
  final2)  # forward benches against the anchors, three dtypes
    python3 bench/rmsnorm.py --anchors quack,tilegym_static_persistent,tilegym_multi_wave_reload,tilegym_multi_wave_cached \
      --no-backward --out "$OUT" > "$OUT/bench_bf16.log" 2>&1; echo "bench rc=$?"
    for dt in float16 float32; do
      python3 bench/rmsnorm.py --dtype $dt --anchors quack --no-backward --out "$OUT" > "$OUT/bench_$dt.log" 2>&1
    done
    for f in "$OUT"/bench_*.log; do echo "== $f"; sed -n '/^Forward/,/^$/p;/^Small M, N = 4096, GPU/,/^$/p' "$f" | cut -c1-200; done ;;
  *) timeout 560 bash bench/gpu_session.sh "$@" ;;
esac
