# Second version (the last slice of each column block adds, the last block norms): GPU tests,
# decode ms/step on and off, the row kernel's registers, batch 1's kernels (PDL off).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
nvidia-smi --query-gpu=name --format=csv,noheader
python -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" > $OUT/build.txt 2>&1 &
timeout 300 python -m pytest -q -m gpu -p no:cacheprovider tests/unit/test_gemv.py tests/gpu/test_gpu_decode_graphs.py \
  -k "tail or one_row or partial_sums or norm_in_the" > $OUT/pytest.txt 2>&1
echo "pytest rc $?"; tail -4 $OUT/pytest.txt | cut -c1-300
python docs/bench/runs/row_kernel_regs.py > $OUT/regs.txt 2>&1; echo "regs rc $?"; grep -v -i warn $OUT/regs.txt | tail -8
wait
timeout 150 python docs/bench/runs/decode_switch_ab.py /tmp/ck3b 1,8 fp8 fp8:MMPIPE_DECODE_NORM_FUSED=0 bf16 \
  bf16:MMPIPE_DECODE_NORM_FUSED=0 fp8 > $OUT/decode.txt 2>&1
echo "decode rc $?"; grep -v -i warn $OUT/decode.txt | tail -6
MMPIPE_PDL=0 timeout 90 python docs/bench/runs/decode_b1_kernels.py /tmp/ck3b fp8 1 > $OUT/b1_pdl0.txt 2>&1
echo "b1 rc $?"; grep -v -i warn $OUT/b1_pdl0.txt | head -9 | cut -c1-120
