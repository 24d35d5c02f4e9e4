L=/tmp/logs_e; mkdir -p $L
nvidia-smi --query-gpu=name --format=csv,noheader
export CUDA_TILE_CACHE_DIR=/tmp/tilecache
( python3 scratch/first_call.py > $L/first1.log 2>&1; python3 scratch/first_call.py > $L/first2.log 2>&1 ) &
FC=$!
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/experimental tests/test_residual.py tests/test_fp8.py > $L/tests.log 2>&1; echo "rc=$?" >> $L/tests.log
wait $FC
timeout 80 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_past_2_32.py -k fp8 > $L/big_fp8.log 2>&1
timeout 120 python3 bench/residual.py --parts fp8 --random 3 --runs 3 --out $OUT/fp8.json > $L/fp8.log 2>&1
timeout 120 python3 scratch/bwd_sweep.py 1536,2048,2560,4096,5120,8192 > $L/bwd_sweep.log 2>&1
tar czf $OUT/e_logs.tar.gz -C $L .
tail -1 $L/tests.log; tail -1 $L/big_fp8.log; head -1 $L/first1.log; head -1 $L/first2.log
grep "^N=\|^#" $L/fp8.log | cut -c1-200; cut -c1-260 $L/bwd_sweep.log
