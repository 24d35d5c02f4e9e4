# residual add and FP8 bench, then the decode bench
L=/tmp/logs_c; mkdir -p $L
export CUDA_VISIBLE_DEVICES=0
timeout 420 python3 bench/residual.py --runs 3 --random 4 --out $OUT/residual.json > $L/residual.log 2>&1; echo "rc=$?" >> $L/residual.log
timeout 120 python3 bench/decode.py > $L/decode.log 2>&1; echo "rc=$?" >> $L/decode.log
tar czf $OUT/c_logs.tar.gz -C $L . ; grep -v "^anchor\|Warning\|warn" $L/residual.log | cut -c1-300 | tail -70; tail -25 $L/decode.log
