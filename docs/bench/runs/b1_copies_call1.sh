# Batch-1 fp8 decode kernels (PDL off for kernel times, on for the step), decode ms/step, and the
# sources of captioning's copies and memsets (fp8-all), all on this tree.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
nvidia-smi --query-gpu=name --format=csv,noheader
python -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" > $OUT/build.txt 2>&1
for pdl in 0 1; do
  MMPIPE_PDL=$pdl timeout 90 python docs/bench/runs/decode_b1_kernels.py /tmp/ck3b fp8 1 > $OUT/b1_fp8_pdl$pdl.txt 2>&1
  echo "b1 pdl $pdl rc $?"; grep -v -i warn $OUT/b1_fp8_pdl$pdl.txt | head -14
done
timeout 120 python docs/bench/runs/decode_switch_ab.py /tmp/ck3b 1,8,32,128 fp8 bf16 > $OUT/decode.txt 2>&1
echo "decode rc $?"; grep -v -i warn $OUT/decode.txt | tail -4
timeout 150 python docs/bench/runs/copy_sources.py /tmp/ck3b 512 fp8-all > $OUT/copies.txt 2>&1
echo "copies rc $?"; tail -22 $OUT/copies.txt | cut -c1-260
