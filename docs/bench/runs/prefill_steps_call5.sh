# Device call 5 (2026-11-28): call 4's captioning part again (call 4's script failed there on a
# name the revert of encode-ahead removed).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
[ -d /tmp/ck3b ] || python -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" > /dev/null 2>&1
python docs/bench/runs/caption_host_budget.py /tmp/ck3b 1024 bf16,bf16:g8192,bf16:p2048,bf16,bf16:g8192,fp8,fp8:g8192 256 2>&1 | grep -v -i warn | tee $OUT/host_budget.txt | grep -E "images/s|GPU busy|prefill graphs|Error"
