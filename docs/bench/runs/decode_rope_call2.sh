# The fused decode kernel with the new K/V written by the split that reads them (CTA barrier, the
# loop untouched): GPU tests; the same tests on two broken copies (writer always split 0; no
# barrier); decode ms/step with the fusion on/off; the FP8 SiLU/activation tests left from last session.
# .brk / .brk2: copies of mmpipe, vision, language, app, tests with `writer = 0` / the tl.debug_barrier() line replaced by `pass` in decode_attention.py (carried).
export PYTHONUNBUFFERED=1 R=$PWD PYTHONPATH=$PWD
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
nvidia-smi --query-gpu=name --format=csv,noheader
(python -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" >/tmp/ck.log 2>&1; echo ck-done) &
T="tests/gpu/test_gpu_attention.py -k rope"
timeout 200 python -m pytest -q -m gpu -p no:cacheprovider $T tests/gpu/test_gpu_decode_graphs.py -k "rope or rotary or exact_bucket" > $OUT/pytest.txt 2>&1
echo pytest rc $?; tail -1 $OUT/pytest.txt; grep -E "^(FAILED|ERROR)" $OUT/pytest.txt | head -10
for B in .brk .brk2; do
  (cd $R/$B && PYTHONPATH=$R/$B timeout 60 python -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_gpu_attention.py -k "decode_with_rope" > $OUT/pytest$B.txt 2>&1; echo "$B rc $?"; tail -1 $OUT/pytest$B.txt)
done
wait
export TRITON_CACHE_DIR=/tmp/tc MMPIPE_CACHE_DIR=/tmp/mc
A=docs/bench/runs/decode_switch_ab.py
F=MMPIPE_DECODE_ROPE_FUSED
timeout 200 python $A /tmp/ck3b 1,8,32,128,256 fp8:$F=1 fp8:$F=0 bf16:$F=1 bf16:$F=0 fp8:$F=1 fp8:$F=0 > $OUT/ab.txt 2>&1; echo rc $?; grep -v Warn $OUT/ab.txt | tail -7
timeout 90 python -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_gpu_fp8.py -k "silu_product or fused_activation" > $OUT/pytest_fp8.txt 2>&1; echo fp8 rc $?; tail -1 $OUT/pytest_fp8.txt
