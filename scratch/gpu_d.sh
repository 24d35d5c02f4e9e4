L=/tmp/logs_d; mkdir -p $L
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/experimental tests/test_residual.py tests/test_fp8.py > $L/tests.log 2>&1; echo "rc=$?" >> $L/tests.log
timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_past_2_32.py -k fp8 > $L/big_fp8.log 2>&1; tail -1 $L/big_fp8.log
timeout 170 python3 scratch/fp8_sweep.py 2048,4096,5120,8192,12288,16384 > $L/fp8_sweep.log 2>&1
timeout 170 python3 bench/residual.py --parts backward --random 2 --runs 3 --out $OUT/residual_bwd.json > $L/residual.log 2>&1; echo "rc=$?" >> $L/residual.log
tar czf $OUT/d_logs.tar.gz -C $L .; tail -3 $L/tests.log; cat $L/fp8_sweep.log | cut -c1-300; grep -v "^anchor\|Warn\|warn" $L/residual.log | cut -c1-200 | tail -32
