export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" >/dev/null 2>&1
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
B="python -m mmpipe.app.bench startup --checkpoint /tmp/ck3b --workdir /tmp/ws"
F='^\| (fresh|second|64|1024) |^start-up [0-9]'
echo "== new fresh"; $B --cache-root /tmp/cN --runs fresh --caption "" 2>&1 | grep -E "$F"
echo "== old fresh"; $B --tree .old --cache-root /tmp/cO --runs fresh --caption "" 2>&1 | grep -E "$F"
echo "== new second"; $B --cache-root /tmp/cN --runs second --caption 64,1024 2>&1 | grep -E "$F"
echo "== old second"; $B --tree .old --cache-root /tmp/cO --runs second --caption 64,1024 2>&1 | grep -E "$F"
