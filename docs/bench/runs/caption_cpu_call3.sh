export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
nvidia-smi --query-gpu=name --format=csv,noheader
(python3 -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" >/tmp/ck.log 2>&1; python -c "from mmpipe.app.bench.caption import write_jpegs; write_jpegs('/tmp/j', 1024)"; echo ckpt-done) &
timeout 330 python -m pytest -q -m gpu tests/gpu/test_gpu_precompile.py tests/gpu/test_gpu_startup.py tests/gpu/test_gpu_parity.py tests/gpu/test_gpu_families.py tests/gpu/test_gpu_vit_graphs.py tests/gpu/test_gpu_patchify.py tests/gpu/test_gpu_decode.py -p no:cacheprovider > $OUT/pytest.txt 2>&1; tail -5 $OUT/pytest.txt
wait
export TRITON_CACHE_DIR=/tmp/tc MMPIPE_CACHE_DIR=/tmp/mc
python -m mmpipe.cli caption /tmp/j --model /tmp/ck3b --format jsonl --max-new-tokens 8 --quiet --output /tmp/w.jsonl >/dev/null 2>&1
timeout 150 python docs/bench/runs/find_host_ops.py caption /tmp/j --model /tmp/ck3b --format jsonl --max-new-tokens 64 --min-new-tokens 64 --output /tmp/o.jsonl > $OUT/find_par.txt 2>&1
grep -A1 "^ *[0-9]* aten\|^---" $OUT/find_par.txt | head -40 | cut -c1-300
