export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
(python3 -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" >/tmp/ck.log 2>&1; echo ck done) &
echo "== gpu tests"
timeout 330 python -m pytest -m gpu -q tests/gpu/test_gpu_attention.py tests/unit/test_gemv.py tests/gpu/test_gpu_decode_graphs.py tests/gpu/test_gpu_fp8.py -p no:cacheprovider 2>&1 | tail -4
echo "== break: new tests on the old kernels"
cp tests/gpu/test_gpu_attention.py .old/tests/gpu/ && cp tests/unit/test_gemv.py .old/tests/unit/
(cd .old && PYTHONPATH=$PWD timeout 120 python -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_gpu_attention.py tests/unit/test_gemv.py -k share_one_compiled 2>&1 | tail -3)
wait
echo "== inventory new"; python docs/bench/runs/triton_inventory.py /tmp/ck3b > $OUT/inventory_new.txt 2>&1; grep -E "^from_pre|^start-up|^first|special" $OUT/inventory_new.txt
echo "== inventory old"; (cd .old && PYTHONPATH=$PWD python ../docs/bench/runs/triton_inventory.py /tmp/ck3b > $OUT/inventory_old.txt 2>&1); grep -E "^from_pre|^start-up|^first|special" $OUT/inventory_old.txt
