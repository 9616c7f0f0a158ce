# Device call 2 (2026-11-28, third session): the GPU tests of what this session touched (blocking
# sync, prefill capture with one warm-up); start-up with one warm-up forward (this tree) against
# de21293 (a warm-up per size), fresh and three second processes, `mmpipe caption` of 64 files twice.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
nvidia-smi --query-gpu=name --format=csv,noheader
python -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" > /dev/null 2>&1 &
python -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_blocking_sync.py tests/gpu/test_gpu_prefill_graphs.py \
  tests/gpu/test_gpu_startup.py tests/gpu/test_gpu_precompile.py tests/gpu/test_gpu_overlap.py > $OUT/pytest.txt 2>&1
tail -4 $OUT/pytest.txt; grep -E "^(FAILED|ERROR)|Error|assert" $OUT/pytest.txt | head -20
wait
for tree in new old new old; do
  t=""; [ $tree = old ] && t="--tree .old"
  python -m mmpipe.app.bench startup $t --checkpoint /tmp/ck3b --workdir /tmp/ws --cache-root /tmp/cr_$tree \
    --bytecode /tmp/bc_$tree --runs fresh,second,second --caption 64 > $OUT/startup_${tree}_$SECONDS.txt 2>&1
  echo "== $tree"; grep -E "^\| (fresh|second|64) |start-up [0-9]" $OUT/startup_${tree}_*.txt | tail -6 | cut -c1-420
done
