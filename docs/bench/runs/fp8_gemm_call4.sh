export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
nvidia-smi --query-gpu=name --format=csv,noheader
(python3 -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" >/tmp/ck.log 2>&1; echo ck-done) &
timeout 110 python -m pytest -q -m gpu tests/gpu/test_gpu_fp8.py -p no:cacheprovider -k "triton" > $OUT/pytest4.txt 2>&1; echo pytest rc $?
tail -2 $OUT/pytest4.txt; grep -E "^(FAILED|ERROR)|^E .*(excess|bound|assert 0 <)" $OUT/pytest4.txt | head -10
timeout 60 python docs/bench/runs/fp8_gemm_sweep.py precision > $OUT/sweep_precision.txt 2>&1; echo sweep rc $?
grep -E "^--|^(qkv|o |down)" $OUT/sweep_precision.txt | sed 's/(.*GB\/s w)//; s/err .*//' | cut -c1-120
wait
timeout 110 python docs/bench/runs/fp8_decode_ab.py /tmp/ck3b 1,48,64,128,192,256 off,on,bf16 > $OUT/decode_ab4.txt 2>&1; echo decode rc $?
grep -E "\|" $OUT/decode_ab4.txt; grep "floor" $OUT/decode_ab4.txt
timeout 235 python docs/bench/runs/fp8_caption_ab.py /tmp/ck3b 1024 fp8:off,fp8:on,fp8:on:128,fp8-all:off,fp8-all:on:128,bf16 2 > $OUT/caption_ab4.txt 2>&1; echo caption rc $?
grep -E "images/s|Error" $OUT/caption_ab4.txt
