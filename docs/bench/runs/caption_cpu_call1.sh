# NOTE: as run, with .gpu/ paths; call2 "base"/"old" rows (and call1 "old") ran the working tree (python -m puts the working directory first), see caption_cpu_h100_cfc3cf4.md
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
nvidia-smi --query-gpu=name --format=csv,noheader; nproc; python -V
(python3 -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" >/tmp/ck.log 2>&1; echo ckpt-done $?) &
timeout 300 python -m pytest -q -m gpu tests/gpu/test_gpu_precompile.py tests/gpu/test_gpu_startup.py tests/gpu/test_gpu_parity.py tests/gpu/test_gpu_families.py tests/gpu/test_gpu_vit_graphs.py tests/gpu/test_gpu_patchify.py tests/gpu/test_gpu_decode.py -x -p no:cacheprovider 2>&1 | tail -8
wait
python -c "from mmpipe.app.bench.caption import write_jpegs; write_jpegs('/tmp/j', 1024)"
mkdir -p /tmp/j64 && ls /tmp/j | head -64 | while read f; do cp /tmp/j/$f /tmp/j64/; done
export TRITON_CACHE_DIR=/tmp/tc MMPIPE_CACHE_DIR=/tmp/mc
CAP="python -m mmpipe.cli caption --model /tmp/ck3b --format jsonl --max-new-tokens 64 --min-new-tokens 64 --quiet"
for T in $PWD $PWD/.old; do PYTHONPATH=$T $CAP /tmp/j64 --output /tmp/w.jsonl >/dev/null 2>&1; rm -f /tmp/w.jsonl; done
run() { # label tree dir [env]
  rm -f /tmp/o.jsonl; echo "== $1 $3 $4"
  env PYTHONPATH=$2 $4 python docs/bench/runs/cpu_threads.py -- $CAP $3 --output /tmp/o.jsonl; wc -l < /tmp/o.jsonl; }
for r in 1 2; do
run new $PWD /tmp/j
run old $PWD/.old /tmp/j
run old-omp1 $PWD/.old /tmp/j OMP_NUM_THREADS=1
run new $PWD /tmp/j64
run old $PWD/.old /tmp/j64
done
