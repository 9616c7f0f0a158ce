# Device call 3 (2026-11-28): fp8-all captioning, encode-ahead x prefill graphs to 8192 x 2048-token prefill steps.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
python -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" > /dev/null 2>&1
python docs/bench/runs/caption_host_budget.py /tmp/ck3b 1024 fp8-all:inline,fp8-all:g8192+inline,fp8-all:g8192,fp8-all:p2048,fp8-all:p2048+inline,fp8-all:inline 512 2>&1 | grep -v -i warn | tee $OUT/host_budget.txt | grep -E "images/s|GPU busy|prefill graphs"
