export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
R=$PWD; INV=$R/docs/bench/runs/triton_inventory.py; FP=$R/docs/bench/fp8_probe.py
(test -d /tmp/ck3b || python3 -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" >/tmp/ck.log 2>&1; echo ck done) &
echo "== gpu tests"
timeout 200 python -m pytest -m gpu -q tests/gpu/test_gpu_precompile.py tests/gpu/test_gpu_startup.py -p no:cacheprovider 2>&1 | tail -3
wait
for t in new:. v1:.v1 old:.old; do n=${t%%:*}; d=${t#*:}; echo "== inventory $n"; (cd $R/$d && PYTHONPATH=$PWD python $INV /tmp/ck3b > $OUT/inventory_$n.txt 2>&1); grep -E "^from_pre|^start-up|^first|special" $OUT/inventory_$n.txt; done
for t in new:. v3:.v3 v1:.v1 new:. v3:.v3 v1:.v1; do n=${t%%:*}; d=${t#*:}; echo "== decode $n"; (cd $R/$d && PYTHONPATH=$PWD python $FP /tmp/ck3b decode-only 2>&1 | grep -E "decode batch"); done
