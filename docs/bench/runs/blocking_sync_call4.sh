# Device call 4 (2026-11-28, third session): the blocking-sync GPU test, then with the knob acting
# backwards (must fail); one traced fp8-all captioning pass with PDL off (kernel times without the
# PDL wait folded into them).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
nvidia-smi --query-gpu=name --format=csv,noheader
python -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" > /dev/null 2>&1 &
python -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_blocking_sync.py 2>&1 | tee $OUT/pytest.txt | tail -2
sed -i 's/blocking=settings.current().blocking_sync/blocking=not settings.current().blocking_sync/' language/sampler.py
grep -c "blocking=not" language/sampler.py
python -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_blocking_sync.py 2>&1 | tee $OUT/pytest_broken.txt | grep -E "^E |passed|failed" | head -4
sed -i 's/blocking=not settings.current().blocking_sync/blocking=settings.current().blocking_sync/' language/sampler.py
wait
MMPIPE_PDL=0 KERNELS=20 PASSES=1 python docs/bench/runs/caption_host_budget.py /tmp/ck3b 1024 fp8-all 512 2>&1 | grep -v -i warn > $OUT/caption_kernels_pdl0.txt
grep -E "images/s|GPU busy|ms/image  " $OUT/caption_kernels_pdl0.txt
