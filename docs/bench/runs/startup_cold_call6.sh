export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
R=$PWD; INV=$R/docs/bench/runs/triton_inventory.py
(test -d /tmp/ck3b || python3 -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" >/tmp/ck.log 2>&1; echo ck done) &
echo "== gpu tests"
timeout 330 python -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_gpu_precompile.py tests/gpu/test_gpu_startup.py tests/gpu/test_gpu_vit_graphs.py tests/gpu/test_gpu_parity.py tests/gpu/test_gpu_families.py 2>&1 | tail -4
wait
for t in new:. old:.old; do n=${t%%:*}; d=${t#*:}; echo "== inventory $n"; (cd $R/$d && PYTHONPATH=$PWD python $INV /tmp/ck3b > $OUT/inventory_$n.txt 2>&1); grep -E "^from_pre|^start-up|^first|special" $OUT/inventory_$n.txt; done
B="python -m mmpipe.app.bench startup --checkpoint /tmp/ck3b --workdir /tmp/ws --caption ''"
for t in new old new old; do echo "== startup fresh $t"
  if [ $t = new ]; then python -m mmpipe.app.bench startup --checkpoint /tmp/ck3b --workdir /tmp/ws --caption "" --cache-root /tmp/cN --bytecode /tmp/bcN --runs fresh 2>&1 | grep -E "^\| fresh|^start-up"
  else python -m mmpipe.app.bench startup --checkpoint /tmp/ck3b --workdir /tmp/ws --caption "" --cache-root /tmp/cO --bytecode /tmp/bcO --tree .old --runs fresh 2>&1 | grep -E "^\| fresh|^start-up"; fi
done
