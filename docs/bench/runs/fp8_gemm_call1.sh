export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
nvidia-smi --query-gpu=name --format=csv,noheader
python -c "import triton; print('triton', triton.__version__)"
timeout 230 python docs/bench/runs/fp8_gemm_sweep.py all > $OUT/sweep.txt 2>&1; echo sweep rc $?
grep -v "^  " $OUT/sweep.txt | cut -c1-150
grep -c "^  " $OUT/sweep.txt
timeout 320 python -m pytest -q -m gpu tests/gpu/test_gpu_fp8.py tests/gpu/test_gpu_fused.py tests/gpu/test_gpu_decode.py tests/gpu/test_gpu_decode_graphs.py tests/gpu/test_gpu_parity.py -p no:cacheprovider > $OUT/pytest1.txt 2>&1; echo pytest rc $?
tail -8 $OUT/pytest1.txt
