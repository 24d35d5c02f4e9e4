# the big tests (past 2^32, two GPUs) alone
L=/tmp/logs_b; mkdir -p $L
timeout 570 python3 -m pytest -m "gpu and big" -v -p no:cacheprovider -rf -s tests/ > $L/big.log 2>&1; echo "rc=$?" >> $L/big.log
grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|^\{" $L/big.log | cut -c1-600 > $OUT/b_summary.txt
tar czf $OUT/b_logs.tar.gz -C $L . ; tail -40 $OUT/b_summary.txt
