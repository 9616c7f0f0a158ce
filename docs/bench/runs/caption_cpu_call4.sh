export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
nvidia-smi --query-gpu=name --format=csv,noheader
gcc -shared -fPIC -O1 -o /tmp/gomp_spy.so docs/bench/runs/gomp_spy.c -ldl || exit 1
python3 -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" >/tmp/ck.log 2>&1
python -c "from mmpipe.app.bench.caption import write_jpegs; write_jpegs('/tmp/j', 1024)"
export TRITON_CACHE_DIR=/tmp/tc MMPIPE_CACHE_DIR=/tmp/mc
CAP="python -m mmpipe.cli caption /tmp/j --model /tmp/ck3b --format jsonl --max-new-tokens 64 --min-new-tokens 64 --quiet"
$CAP --output /tmp/w.jsonl >/dev/null 2>&1
GOMP_SPY_EVERY=40 LD_PRELOAD=/tmp/gomp_spy.so $CAP --output /tmp/o.jsonl > /dev/null 2> $OUT/spy.txt
grep -c "^@@ GOMP_parallel #" $OUT/spy.txt; grep "total" $OUT/spy.txt
grep "^@@ GOMP" $OUT/spy.txt | awk '{print $5}' | sort | uniq -c
grep -A14 "^@@ GOMP_parallel #" $OUT/spy.txt | grep -o "_ZN[A-Za-z0-9_]*" | sort | uniq -c | sort -rn | head -20
grep -A40 "^Stack" $OUT/spy.txt | grep "File" | sort | uniq -c | sort -rn | head -30
