export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
nvidia-smi --query-gpu=name --format=csv,noheader
(python3 -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" >/tmp/ck.log 2>&1; echo ck-done) &
timeout 200 python -m pytest -q -m gpu tests/gpu/test_gpu_fp8.py -p no:cacheprovider > $OUT/pytest2.txt 2>&1; echo pytest rc $?
tail -4 $OUT/pytest2.txt; grep -E "^(FAILED|ERROR)" $OUT/pytest2.txt | head -20
wait
timeout 200 python docs/bench/runs/fp8_decode_ab.py /tmp/ck3b 1,8,32,48,64,96,128,192,256 off,on,bf16 > $OUT/decode_ab.txt 2>&1; echo decode rc $?
grep -E "\|" $OUT/decode_ab.txt; grep "floor" $OUT/decode_ab.txt; tail -3 $OUT/decode_ab.txt | grep -i error
timeout 120 python docs/bench/runs/fp8_gemm_sweep.py small --all > $OUT/sweep2.txt 2>&1; echo sweep rc $?
grep -c "all:" $OUT/sweep2.txt
