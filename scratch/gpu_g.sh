export CUTILE_NORMS_CACHE_DIR=/tmp/cn_cache; unset CUDA_TILE_CACHE_DIR
python3 -m compileall -q -j 16 /tmp/devkit/site > /dev/null 2>&1
for i in 1 2 3; do python3 scratch/first_call.py 2>&1 | head -1 | cut -c1-120; done
timeout 130 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_diskcache.py tests/test_warmup.py -k "gpu or 4096" 2>&1 | tail -3
ls /tmp/cn_cache/cute | wc -l
