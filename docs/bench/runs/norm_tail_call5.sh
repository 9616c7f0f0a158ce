# The kept version (the last program adds and norms; FP8 weights only): its GPU tests, the same
# tests under two mutations (no counter reset; one arrival early), registers, decode ms/step on
# and off alternating, batch 1's kernels (PDL off).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
nvidia-smi --query-gpu=name --format=csv,noheader
python -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" > $OUT/build.txt 2>&1 &
run_tests() { timeout 200 python -m pytest -q -m gpu -p no:cacheprovider tests/unit/test_gemv.py tests/gpu/test_gpu_decode_graphs.py \
  -k "tail or one_row or partial_sums or norm_in_the" > $OUT/pytest_$1.txt 2>&1; echo "pytest $1 rc $?"; tail -5 $OUT/pytest_$1.txt | cut -c1-200; }
run_tests kept
cp mmpipe/kernels/gemv.py /tmp/gemv.py
sed -i 's/                    tl.store(count_ptr, 0)  # for the next tail/                    pass  # for the next tail/' mmpipe/kernels/gemv.py
grep -c "pass  # for the next tail" mmpipe/kernels/gemv.py; run_tests no_reset; cp /tmp/gemv.py mmpipe/kernels/gemv.py
sed -i 's/== tl.num_programs(0) \* SPLITS - 1:/== tl.num_programs(0) * SPLITS - 2:/' mmpipe/kernels/gemv.py
grep -c "SPLITS - 2:" mmpipe/kernels/gemv.py; run_tests early; cp /tmp/gemv.py mmpipe/kernels/gemv.py
python docs/bench/runs/row_kernel_regs.py > $OUT/regs.txt 2>&1; echo "regs rc $?"; grep -v -i warn $OUT/regs.txt | tail -8
wait
timeout 200 python docs/bench/runs/decode_switch_ab.py /tmp/ck3b 1,8 fp8 fp8:MMPIPE_DECODE_NORM_FUSED=0 fp8 \
  fp8:MMPIPE_DECODE_NORM_FUSED=0 bf16 > $OUT/decode.txt 2>&1
echo "decode rc $?"; grep -v -i warn $OUT/decode.txt | tail -6
MMPIPE_PDL=0 timeout 90 python docs/bench/runs/decode_b1_kernels.py /tmp/ck3b fp8 1 > $OUT/b1_pdl0.txt 2>&1
echo "b1 rc $?"; grep -v -i warn $OUT/b1_pdl0.txt | head -7 | cut -c1-120
