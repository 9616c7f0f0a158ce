export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
nproc; python -c "import triton, torch; print(triton.__version__, torch.__version__)"
(python3 -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" >/tmp/ck.log 2>&1; echo ck done) &
echo "== gpu tests"
timeout 300 python -m pytest -m gpu -q -x tests/gpu/test_gpu_attention.py tests/gpu/test_gpu_startup.py tests/gpu/test_gpu_decode_graphs.py tests/gpu/test_gpu_vit_graphs.py tests/gpu/test_gpu_precompile.py -p no:cacheprovider 2>&1 | tail -5
wait
echo "== prep times (device CPU)"; python docs/bench/runs/prep_time.py 2>&1 | grep -E "ms|decode'|resize'|blake2" | head -12
echo "== inventory"; python docs/bench/runs/triton_inventory.py /tmp/ck3b > $OUT/inventory.txt 2>&1; head -60 $OUT/inventory.txt
echo "== ttft"; python -m mmpipe.app.bench ttft --checkpoint /tmp/ck3b --repeats 20 2>&1 | tail -9
