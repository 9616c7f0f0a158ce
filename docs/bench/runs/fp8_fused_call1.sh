export PYTHONUNBUFFERED=1 R=$PWD PYTHONPATH=$PWD
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
nvidia-smi --query-gpu=name --format=csv,noheader
(python3 -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" >/tmp/ck.log 2>&1; echo ck-done) &
timeout 420 python -m pytest -q -m gpu tests/gpu/test_gpu_fp8.py tests/gpu/test_gpu_fused.py tests/gpu/test_gpu_transfer.py tests/gpu/test_gpu_patchify.py tests/gpu/test_gpu_decode.py tests/gpu/test_gpu_decode_graphs.py -p no:cacheprovider -x > $OUT/pytest1.txt 2>&1; tail -15 $OUT/pytest1.txt
wait
timeout 170 python docs/bench/runs/fp8_fused_ab.py /tmp/ck3b forward > $OUT/ab.txt 2>&1; tail -20 $OUT/ab.txt
