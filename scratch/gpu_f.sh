L=/tmp/logs_f; mkdir -p $L
timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_residual.py tests/experimental/test_triton_add_rmsnorm.py > $L/tests.log 2>&1; echo "rc=$?" >> $L/tests.log
timeout 200 python3 bench/residual.py --parts backward --ns 896,1536,2048,2560,3072,3584,4096,5120,6144,7168,8192 --random 0 --runs 3 --out $OUT/bwd.json > $L/bwd.log 2>&1
tar czf $OUT/f_logs.tar.gz -C $L .; tail -1 $L/tests.log; grep "^N=\|^block" $L/bwd.log | cut -c1-200
