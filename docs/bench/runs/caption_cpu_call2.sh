# NOTE: as run, with .gpu/ paths; call2 "base"/"old" rows (and call1 "old") ran the working tree (python -m puts the working directory first), see caption_cpu_h100_cfc3cf4.md
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
nvidia-smi --query-gpu=name --format=csv,noheader; nproc; python -V; which gdb perf strace eu-stack
python3 -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" >/tmp/ck.log 2>&1
python -c "from mmpipe.app.bench.caption import write_jpegs; write_jpegs('/tmp/j', 1024)"
mkdir -p /tmp/j64 && ls /tmp/j | head -64 | while read f; do cp /tmp/j/$f /tmp/j64/; done
export TRITON_CACHE_DIR=/tmp/tc MMPIPE_CACHE_DIR=/tmp/mc
CAP="python -m mmpipe.cli caption --model /tmp/ck3b --format jsonl --max-new-tokens 64 --min-new-tokens 64 --quiet"
for T in $PWD $PWD/.base; do PYTHONPATH=$T $CAP /tmp/j64 --output /tmp/w.jsonl >/dev/null 2>&1; rm -f /tmp/w.jsonl; done
run() { # label tree dir [env] [args]
  rm -f /tmp/o.jsonl; echo "== $1 $3 $4 $5"
  env PYTHONPATH=$2 $4 python docs/bench/runs/cpu_threads.py -- $CAP $3 --output /tmp/o.jsonl $5 | grep -v "^  .* 0.0 " | head -30; }
run new $PWD /tmp/j
run base $PWD/.base /tmp/j
run new-omp1 $PWD /tmp/j OMP_NUM_THREADS=1
run new $PWD /tmp/j64
run base $PWD/.base /tmp/j64
run new $PWD /tmp/j A=1 "--workers 1"
run base $PWD/.base /tmp/j A=1 "--workers 1"
run new-gpudecode $PWD /tmp/j A=1 --gpu-decode
run new $PWD /tmp/j
run base $PWD/.base /tmp/j
echo "== profiler"
rm -f /tmp/o.jsonl; timeout 120 python docs/bench/runs/prof_caption.py caption /tmp/j --model /tmp/ck3b --format jsonl --max-new-tokens 64 --min-new-tokens 64 --quiet --output /tmp/o.jsonl 2>&1 | grep -v "^USDT" | cut -c1-260 | head -90
