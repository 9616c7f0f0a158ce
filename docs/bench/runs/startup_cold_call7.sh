export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
R=$PWD; INV=$R/docs/bench/runs/triton_inventory.py
(test -d /tmp/ck3b || python3 -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" >/tmp/ck.log 2>&1; echo ck done) &
echo "== gpu tests"
timeout 200 python -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_gpu_precompile.py tests/gpu/test_gpu_startup.py 2>&1 | tail -3
wait
echo "== inventory new"; python $INV /tmp/ck3b > $OUT/inventory_new.txt 2>&1; grep -E "^from_pre|^start-up|^first|special" $OUT/inventory_new.txt
S="python -m mmpipe.app.bench startup --checkpoint /tmp/ck3b --workdir /tmp/ws --caption "
for t in new old new old; do echo "== startup $t"; runs=fresh; [ -f /tmp/seen_$t ] && runs=fresh,second; touch /tmp/seen_$t
  if [ $t = new ]; then $S "" --cache-root /tmp/cN --bytecode /tmp/bcN --runs $runs 2>&1 | grep -E "^\| (fresh|second)|^start-up"
  else $S "" --cache-root /tmp/cO --bytecode /tmp/bcO --tree .old --runs $runs 2>&1 | grep -E "^\| (fresh|second)|^start-up"; fi
done
