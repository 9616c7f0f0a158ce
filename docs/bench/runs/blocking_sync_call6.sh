# Device call 6 (2026-11-28, third session): after the review mends (lockstep keeps a warm-up per
# size; the blocking-sync test through the switch fixture): those GPU tests again.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
nvidia-smi --query-gpu=name --format=csv,noheader
python -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_blocking_sync.py tests/gpu/test_gpu_prefill_graphs.py tests/gpu/test_gpu_startup.py 2>&1 | tee $OUT/pytest.txt | tail -3
