# Sourced by the probe scripts that time configs against the table's (cluster_ab.sh, wide_reload.sh):
#   ab PREFIX N CONFIG...   config_ab.py for bfloat16:N at the bench size and twice it, the table's
#                           config first, ROUNDS rounds (default 5), the records in $OUT/PREFIX_N.json
ab() {
  local prefix=$1 n=$2; shift 2
  timeout 150 python3 bench/probe/config_ab.py --case bfloat16:$n --sizes 1,2 --rounds "${ROUNDS:-5}" \
    --out "$OUT/${prefix}_$n.json" table "$@" 2>&1 | grep -v -i warn | grep -v "^$"
}
