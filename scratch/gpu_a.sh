# GPU suite without the big tests, 16 shards over the visible GPUs
L=/tmp/logs_a; mkdir -p $L
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 575 python3 tests/run_sharded.py --shards ${SHARDS:-16} --timeout 480 --logs $L -- -m "gpu and not big" tests/ > $L/summary.txt 2>&1
echo "rc=$?" >> $L/summary.txt
tar czf $OUT/a_logs.tar.gz -C $L . ; cp $L/summary.txt $OUT/a_summary.txt; cat $L/summary.txt | cut -c1-400
