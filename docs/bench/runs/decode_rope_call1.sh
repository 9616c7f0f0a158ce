# GPU tests of the rotary inside decode attention (and the decode graphs, PDL), then decode ms/step:
# HEAD with the fusion on/off, and eac0d5f (the tree before the few-row peeling) from .old, on one machine.
export PYTHONUNBUFFERED=1 R=$PWD PYTHONPATH=$PWD
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
nvidia-smi --query-gpu=name --format=csv,noheader
(python -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" >/tmp/ck.log 2>&1; echo ck-done) &
timeout 250 python -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_gpu_attention.py -k "rope" tests/gpu/test_gpu_decode_graphs.py tests/unit/test_pdl.py > $OUT/pytest.txt 2>&1
echo pytest rc $?; tail -1 $OUT/pytest.txt; grep -E "^(FAILED|ERROR)" $OUT/pytest.txt | head -10
wait
export TRITON_CACHE_DIR=/tmp/tc MMPIPE_CACHE_DIR=/tmp/mc
A=docs/bench/runs/decode_switch_ab.py
timeout 190 python $A /tmp/ck3b 1,8,32,128 fp8:MMPIPE_DECODE_ROPE_FUSED=1 fp8:MMPIPE_DECODE_ROPE_FUSED=0 bf16:MMPIPE_DECODE_ROPE_FUSED=1 bf16:MMPIPE_DECODE_ROPE_FUSED=0 fp8:MMPIPE_DECODE_ROPE_FUSED=1 > $OUT/ab_head.txt 2>&1; echo rc $?; grep -v Warn $OUT/ab_head.txt | tail -6
(cd $R/.old && PYTHONPATH=$R/.old timeout 110 python $R/$A /tmp/ck3b 1,8,32,128 fp8 bf16 > $OUT/ab_old.txt 2>&1; echo rc $?); tail -3 $OUT/ab_old.txt
