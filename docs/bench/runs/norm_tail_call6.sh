# GPU tests of every path the one-row tail and the shared norm row touch, on the committed tree.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
nvidia-smi --query-gpu=name --format=csv,noheader
group() { name=$1; limit=$2; shift 2; start=$(date +%s)
  timeout $limit python -m pytest -q -m gpu -p no:cacheprovider "$@" > $OUT/pytest_$name.txt 2>&1
  echo "$name rc $? ($(( $(date +%s) - start )) s): $(tail -1 $OUT/pytest_$name.txt | cut -c1-200)"
  grep -E "^FAILED" $OUT/pytest_$name.txt | head -5 | cut -c1-200; }
group kernels 150 tests/unit/test_gemv.py tests/unit/test_pdl.py tests/gpu/test_gpu_fused.py tests/gpu/test_gpu_decode_graphs.py tests/gpu/test_gpu_decode.py
group fp8 170 tests/gpu/test_gpu_fp8.py
group parity 110 tests/gpu/test_gpu_parity.py tests/gpu/test_gpu_families.py
group graphs 100 tests/gpu/test_gpu_vit_graphs.py tests/gpu/test_gpu_prefill_graphs.py
