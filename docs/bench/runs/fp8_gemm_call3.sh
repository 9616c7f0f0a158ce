export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
nvidia-smi --query-gpu=name --format=csv,noheader
(python3 -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" >/tmp/ck.log 2>&1; echo ck-done) &
timeout 200 python -m pytest -q -m gpu tests/gpu/test_gpu_fp8.py -p no:cacheprovider -k "triton or above_the_few_row or every_graph_mode or checkpoint_runs" > $OUT/pytest3.txt 2>&1; echo pytest rc $?
tail -3 $OUT/pytest3.txt; grep -E "^(FAILED|ERROR)|^E .*(excess|bound|assert 0 <)" $OUT/pytest3.txt | head -20
wait
timeout 140 python docs/bench/runs/fp8_decode_ab.py /tmp/ck3b 1,32,48,64,96,128,192,256 off,on,bf16 > $OUT/decode_ab3.txt 2>&1; echo decode rc $?
grep -E "\|" $OUT/decode_ab3.txt; grep "floor" $OUT/decode_ab3.txt
timeout 230 python docs/bench/runs/fp8_caption_ab.py /tmp/ck3b 1024 bf16,fp8:on,fp8:off,fp8-all:on,fp8-all:off 2 > $OUT/caption_ab3.txt 2>&1; echo caption rc $?
grep -E "images/s|Error" $OUT/caption_ab3.txt
