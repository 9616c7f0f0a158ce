# Device call 6 (2026-11-28): GPU tests after the default prefill schedule grew to max_prefill_tokens.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
timeout 330 python -m pytest -q -m gpu tests/gpu/test_gpu_prefill_graphs.py tests/gpu/test_gpu_startup.py tests/gpu/test_gpu_precompile.py tests/gpu/test_gpu_overlap.py -p no:cacheprovider -x 2>&1 | tail -6 | tee $OUT/pytest.txt
