# Device call 5 (2026-11-28, third session): the blocking-sync GPU test (its untimed first round
# now the same as the timed one), then with the knob acting backwards (must fail).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
nvidia-smi --query-gpu=name --format=csv,noheader
for i in 1 2 3; do python -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_blocking_sync.py 2>&1 | grep -E "^E |passed|failed" | head -3; done | tee $OUT/pytest.txt
sed -i 's/blocking=settings.current().blocking_sync/blocking=not settings.current().blocking_sync/' language/sampler.py
grep -c "blocking=not" language/sampler.py
python -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_blocking_sync.py 2>&1 | tee $OUT/pytest_broken.txt | grep -E "^E |passed|failed" | head -4
sed -i 's/blocking=not settings.current().blocking_sync/blocking=settings.current().blocking_sync/' language/sampler.py
