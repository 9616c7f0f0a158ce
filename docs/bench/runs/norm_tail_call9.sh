# The tail limited to rows of up to 2048 columns: its GPU tests, and batch-1 fp8 decode on and
# off, 7B shape (now the norm kernel either way) and 3B shape.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
nvidia-smi --query-gpu=name --format=csv,noheader
(python -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck7b', shape='7b'); b('/tmp/ck3b')" > $OUT/build.txt 2>&1) &
timeout 90 python -m pytest -q -m gpu -p no:cacheprovider tests/unit/test_gemv.py tests/gpu/test_gpu_decode_graphs.py \
  -k "tail or one_row or norm_in_the" > $OUT/pytest.txt 2>&1
echo "pytest rc $?: $(tail -1 $OUT/pytest.txt)"; grep ^FAILED $OUT/pytest.txt | head
wait
timeout 70 python docs/bench/runs/decode_switch_ab.py /tmp/ck7b 1 fp8 fp8:MMPIPE_DECODE_NORM_FUSED=0 > $OUT/decode7b.txt 2>&1
echo "7b rc $?"; grep -v -i warn $OUT/decode7b.txt | tail -2
timeout 50 python docs/bench/runs/decode_switch_ab.py /tmp/ck3b 1 fp8 fp8:MMPIPE_DECODE_NORM_FUSED=0 > $OUT/decode3b.txt 2>&1
echo "3b rc $?"; grep -v -i warn $OUT/decode3b.txt | tail -2
