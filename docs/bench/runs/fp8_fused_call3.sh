export PYTHONUNBUFFERED=1 R=$PWD PYTHONPATH=$PWD
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
nvidia-smi --query-gpu=name --format=csv,noheader
pip install -q matplotlib 2>/dev/null | tail -1; python -c "import matplotlib" 2>/dev/null && echo mpl || echo no-mpl
ls /tmp/ck3b/config.json >/dev/null 2>&1 || python3 -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" >/tmp/ck.log 2>&1
timeout 280 python -m mmpipe.app.bench caption --checkpoint /tmp/ck3b --images 1024 --hf-images "" --quantizations fp8-all --workdir /tmp/wd --timeline $OUT/timeline.png --timeline-images 256 > $OUT/caption3.txt 2>&1; tr '\r' '\n' < $OUT/caption3.txt | grep -v "capturing\|^ *$" | grep -v "^| decode\|^| vision\|^| prefill" | head -40
mkdir -p /tmp/j64; ls /tmp/wd/images | head -64 | while read f; do cp /tmp/wd/images/$f /tmp/j64/; done
export TRITON_CACHE_DIR=/tmp/tc
CAP="python -m mmpipe.cli caption --model /tmp/ck3b --format jsonl --max-new-tokens 64 --min-new-tokens 64 --quiet"
tree() { [ $1 = base ] && echo $R/.base || echo $R; }
for T in new base; do (cd $(tree $T) && MMPIPE_CACHE_DIR=/tmp/mc_$T PYTHONPATH=$(tree $T) $CAP /tmp/j64 --output /tmp/w.jsonl >/dev/null 2>&1); rm -f /tmp/w.jsonl; done
run() { rm -f /tmp/o.jsonl; echo "== $1 $2"; (cd $(tree $1) && MMPIPE_CACHE_DIR=/tmp/mc_$1 PYTHONPATH=$(tree $1) python $R/docs/bench/runs/cpu_threads.py -- $CAP $2 --output /tmp/o.jsonl) 2>&1 | grep -E "^rc|stderr tail"; }
run new /tmp/j64; run base /tmp/j64; run new /tmp/j64; run base /tmp/j64
run new /tmp/wd/images; run base /tmp/wd/images
