# The quantizers' reciprocal and one-pass rows (issue 31), the committed rule (values a thread):
# kernel microseconds (this tree only), then the GPU tests of everything the kernels feed: FP8 in
# every graph mode (bundled model's captions exact), the fused kernels, parity with transformers.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 100 python docs/bench/runs/norm_silu_sweep.py > $OUT/sweep.txt 2>&1
echo sweep rc $?; grep -v Warn $OUT/sweep.txt | grep -E "silu|quantize"
timeout 420 python -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_gpu_fp8.py tests/gpu/test_gpu_fused.py \
  tests/gpu/test_gpu_parity.py > $OUT/pytest.txt 2>&1
echo pytest rc $?; tail -1 $OUT/pytest.txt; grep -E "^(FAILED|ERROR)" $OUT/pytest.txt | head -10
