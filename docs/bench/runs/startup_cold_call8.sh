export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
(test -d /tmp/ck3b || python3 -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" >/tmp/ck.log 2>&1; echo ck done) &
echo "== gpu tests"
timeout 150 python -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_gpu_precompile.py tests/gpu/test_gpu_startup.py 2>&1 | tail -3
wait
S="python -m mmpipe.app.bench startup --checkpoint /tmp/ck3b --workdir /tmp/ws"
F='^\| (fresh|second|64|1024) |^start-up [0-9]|^captioned'
echo "== new startup"; $S --cache-root /tmp/cN --bytecode /tmp/bcN --runs fresh,second --caption "" > $OUT/new_startup.txt 2>&1; grep -E "$F" $OUT/new_startup.txt
echo "== old startup"; $S --tree .old --cache-root /tmp/cO --bytecode /tmp/bcO --runs fresh,second --caption "" > $OUT/old_startup.txt 2>&1; grep -E "$F" $OUT/old_startup.txt
echo "== new captions w4"; $S --cache-root /tmp/cN --bytecode /tmp/bcN --runs "" --caption 64,1024 > $OUT/new_cap_w4.txt 2>&1; grep -E "$F" $OUT/new_cap_w4.txt
echo "== new captions w1"; $S --cache-root /tmp/cN --bytecode /tmp/bcN --runs "" --caption 1024 --caption-args "--workers 1" > $OUT/new_cap_w1.txt 2>&1; grep -E "$F" $OUT/new_cap_w1.txt
echo "== base warm + captions w4"; $S --tree .base --cache-root /tmp/cB --bytecode /tmp/bcB --runs fresh --caption 64,1024 > $OUT/base_cap_w4.txt 2>&1; grep -E "$F" $OUT/base_cap_w4.txt
echo "== base captions w1"; $S --tree .base --cache-root /tmp/cB --bytecode /tmp/bcB --runs "" --caption 1024 --caption-args "--workers 1" > $OUT/base_cap_w1.txt 2>&1; grep -E "$F" $OUT/base_cap_w1.txt
