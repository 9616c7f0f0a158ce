export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
R=$PWD; FP=$R/docs/bench/fp8_probe.py
(test -d /tmp/ck3b || python3 -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" >/tmp/ck.log 2>&1; echo ck done) &
echo "== gpu tests"
timeout 240 python -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_gpu_precompile.py tests/gpu/test_gpu_attention.py -k "decode or split or compile or submitted or launch" 2>&1 | tail -3
echo "== break: new tests on af9fd5c"
cp tests/gpu/test_gpu_precompile.py tests/gpu/test_gpu_attention.py .old/tests/gpu/
(cd .old && PYTHONPATH=$PWD timeout 120 python -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_gpu_precompile.py tests/gpu/test_gpu_attention.py -k "submitted_once or share_one_compiled" 2>&1 | tail -3)
wait
for t in new:. old:.old new:. old:.old; do n=${t%%:*}; d=${t#*:}; echo "== decode $n"; (cd $R/$d && PYTHONPATH=$PWD python $FP /tmp/ck3b decode-only 2>&1 | grep -E "decode batch"); done
