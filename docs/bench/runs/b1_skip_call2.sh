# Batch-1 fp8 decode: one-row products told apart by grid (PDL off), and the upper bound of
# fusing away the short kernels (b1_skip_bound.py), on this tree.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/docs/bench/runs
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
nvidia-smi --query-gpu=name --format=csv,noheader
python -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" > $OUT/build.txt 2>&1
MMPIPE_PDL=0 timeout 90 python docs/bench/runs/decode_b1_kernels.py /tmp/ck3b fp8 1 > $OUT/b1_grid_pdl0.txt 2>&1
echo "grid rc $?"; grep -v -i warn $OUT/b1_grid_pdl0.txt | head -12 | cut -c1-120
timeout 240 python docs/bench/runs/b1_skip_bound.py /tmp/ck3b fp8 none norm reduce rope norm+reduce+rope none > $OUT/skip.txt 2>&1
echo "skip rc $?"; grep -v -i warn $OUT/skip.txt | tail -8
