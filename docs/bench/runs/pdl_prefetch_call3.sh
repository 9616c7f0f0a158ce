# GPU tests for the PDL weight prefetch (7ed6121), and the 7B decode figures with the corrected floor.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
nvidia-smi --query-gpu=name --format=csv,noheader
python -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck7b', '7b')" > $OUT/build.txt 2>&1 &
timeout 270 python -m pytest -q -m gpu -p no:cacheprovider tests/unit/test_pdl.py tests/unit/test_gemv.py \
  tests/gpu/test_gpu_fp8.py > $OUT/pytest_a.txt 2>&1
echo pytest a rc $?; tail -1 $OUT/pytest_a.txt; grep -E "^(FAILED|ERROR)" $OUT/pytest_a.txt | head -10
wait
timeout 100 python docs/bench/runs/pdl_prefetch_ab.py /tmp/ck7b 1 fp8:1,bf16:1 > $OUT/ab_7b.txt 2>&1
echo 7b rc $?; grep -E "decode batch" $OUT/ab_7b.txt
rm -rf /tmp/ck7b
timeout 150 python -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_gpu_decode_graphs.py tests/gpu/test_gpu_decode.py \
  > $OUT/pytest_b.txt 2>&1
echo pytest b rc $?; tail -1 $OUT/pytest_b.txt; grep -E "^(FAILED|ERROR)" $OUT/pytest_b.txt | head -10
