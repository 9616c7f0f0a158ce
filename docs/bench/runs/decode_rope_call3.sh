# The committed rule (fused from buckets of 2 rows): GPU tests (rope kernels, decode graphs, the
# families' parity with transformers incl. Qwen3's head norm in decode, PDL); decode ms/step at
# 1-32 rows with the fusion on/off.
export PYTHONUNBUFFERED=1 R=$PWD PYTHONPATH=$PWD
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
nvidia-smi --query-gpu=name --format=csv,noheader
(python -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" >/tmp/ck.log 2>&1; echo ck-done) &
timeout 250 python -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu/test_gpu_attention.py -k "rope" tests/gpu/test_gpu_decode_graphs.py tests/gpu/test_gpu_families.py tests/unit/test_pdl.py > $OUT/pytest.txt 2>&1
echo pytest rc $?; grep -E "passed|failed" $OUT/pytest.txt | tail -1; grep -E "^(FAILED|ERROR)" $OUT/pytest.txt | head -10; grep -o "float32 [0-9/x]* splits [0-9]*: output equal [A-Za-z]*" $OUT/pytest.txt | sort | uniq -c | head -24
wait
export TRITON_CACHE_DIR=/tmp/tc MMPIPE_CACHE_DIR=/tmp/mc
A=docs/bench/runs/decode_switch_ab.py
F=MMPIPE_DECODE_ROPE_FUSED
timeout 170 python $A /tmp/ck3b 1,2,4,8,32 fp8:$F=1 fp8:$F=0 bf16:$F=1 bf16:$F=0 fp8:$F=1 fp8:$F=0 > $OUT/ab.txt 2>&1; echo rc $?; grep -v Warn $OUT/ab.txt | tail -7
