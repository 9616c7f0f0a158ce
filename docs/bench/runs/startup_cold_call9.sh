export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
pip install -q --no-index .whl2/py_spy-*.whl 2>&1 | tail -1
python3 -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" >/tmp/ck.log 2>&1
python -c "from mmpipe.app.bench.caption import write_jpegs; write_jpegs('/tmp/j', 1024)"
export TRITON_CACHE_DIR=/tmp/tc MMPIPE_CACHE_DIR=/tmp/mc
python -m mmpipe.cli caption /tmp/j/ --model /tmp/ck3b --format jsonl --output /tmp/o1.jsonl --max-new-tokens 8 --quiet >/dev/null 2>&1
rm -f /tmp/o.jsonl
/usr/bin/time -v python -m mmpipe.cli caption /tmp/j/ --model /tmp/ck3b --format jsonl --output /tmp/o.jsonl --errors-file /tmp/e.jsonl --max-new-tokens 64 --min-new-tokens 64 --quiet > /tmp/cap.log 2>&1 &
sleep 12; P=$(pgrep -f "mmpipe.cli caption" | head -1); echo pid $P
top -H -b -n 1 -d 1 -p $P | head -30
for i in 1 2; do py-spy dump --pid $P 2>&1 | grep -v "^ *$" | head -120; echo -----; sleep 2; done
wait; grep -E "User time|System time|Elapsed" /tmp/cap.log; tail -2 /tmp/cap.log
