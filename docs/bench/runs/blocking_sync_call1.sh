# Device call 1 (2026-11-28, third session): start-up with today's prefill schedule (HEAD) against
# b175da6 (the schedule to 2048) on one machine (issue 29's rows), the blocking-sync GPU test, and
# decode ms/step and image TTFT with the engine sleeping (MMPIPE_BLOCKING_SYNC=1) or spinning (0).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
python -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" > /dev/null 2>&1
python -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_blocking_sync.py 2>&1 | tail -3 | tee $OUT/pytest.txt
for tree in new old; do
  t=""; [ $tree = old ] && t="--tree .old"
  python -m mmpipe.app.bench startup $t --checkpoint /tmp/ck3b --workdir /tmp/ws --cache-root /tmp/cr_$tree \
    --bytecode /tmp/bc_$tree --runs fresh,second --caption 64 --json $OUT/startup_$tree.json > $OUT/startup_$tree.txt 2>&1
  echo "== $tree"; grep -v -i warn $OUT/startup_$tree.txt | tail -14
done
python docs/bench/runs/decode_switch_ab.py /tmp/ck3b 1,8,64 bf16 bf16:MMPIPE_BLOCKING_SYNC=0 fp8 fp8:MMPIPE_BLOCKING_SYNC=0 bf16 2>&1 | grep -v -i warn | tee $OUT/decode_ab.txt
for v in 1 0 1 0; do
  echo "== MMPIPE_BLOCKING_SYNC=$v"; MMPIPE_BLOCKING_SYNC=$v python -m mmpipe.app.bench ttft --checkpoint /tmp/ck3b 2>&1 | grep -v -i warn | tail -6
done | tee $OUT/ttft_ab.txt
