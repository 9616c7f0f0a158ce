export PYTHONUNBUFFERED=1 R=$PWD
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
nvidia-smi --query-gpu=name --format=csv,noheader
gcc -shared -fPIC -O1 -o /tmp/gomp_spy.so docs/bench/runs/gomp_spy.c -ldl || exit 1
(PYTHONPATH=$R python3 -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" >/tmp/ck.log 2>&1; PYTHONPATH=$R python -c "from mmpipe.app.bench.caption import write_jpegs; write_jpegs('/tmp/j', 1024)"; mkdir -p /tmp/j64; ls /tmp/j | head -64 | while read f; do cp /tmp/j/$f /tmp/j64/; done; echo data-done) &
PYTHONPATH=$R timeout 200 python -m pytest -q -m gpu tests/gpu/test_gpu_transfer.py tests/gpu/test_gpu_patchify.py tests/gpu/test_gpu_decode.py tests/gpu/test_gpu_decode_graphs.py -p no:cacheprovider > $OUT/pytest.txt 2>&1; tail -3 $OUT/pytest.txt
wait
export TRITON_CACHE_DIR=/tmp/tc
CAP="python -m mmpipe.cli caption --model /tmp/ck3b --format jsonl --max-new-tokens 64 --min-new-tokens 64 --quiet"
tree() { [ $1 = base ] && echo $R/.base || echo $R; }
for T in new base; do (cd $(tree $T) && MMPIPE_CACHE_DIR=/tmp/mc_$T PYTHONPATH=$(tree $T) $CAP /tmp/j64 --output /tmp/w.jsonl --max-new-tokens 8 >/dev/null 2>&1); rm -f /tmp/w.jsonl; done
run() { # tree dir [args]
  rm -f /tmp/o.jsonl; echo "== $1 $2 $3"
  (cd $(tree $1) && MMPIPE_CACHE_DIR=/tmp/mc_$1 PYTHONPATH=$(tree $1) python $R/docs/bench/runs/cpu_threads.py -- $CAP $2 --output /tmp/o.jsonl $3) | head -12; wc -l < /tmp/o.jsonl; }
run new /tmp/j; run base /tmp/j
run new /tmp/j64; run base /tmp/j64
run new /tmp/j "--workers 1"; run base /tmp/j "--workers 1"
run new /tmp/j --gpu-decode
run new /tmp/j; run base /tmp/j
run new /tmp/j64; run base /tmp/j64
echo "== spy new"
(MMPIPE_CACHE_DIR=/tmp/mc_new PYTHONPATH=$R GOMP_SPY_EVERY=1 LD_PRELOAD=/tmp/gomp_spy.so $CAP /tmp/j --output /tmp/o.jsonl > /dev/null 2> $OUT/spy.txt)
grep -c "^@@ GOMP_parallel #" $OUT/spy.txt
grep -A60 "^Stack" $OUT/spy.txt | grep "File" | grep -v "contextlib\|runpy\|cli.py" | sort | uniq -c | sort -rn | head -20
