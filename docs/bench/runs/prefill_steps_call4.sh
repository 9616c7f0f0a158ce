# Device call 4 (2026-11-28): start-up with the prefill schedule extended to 8192, and bf16 / fp8
# captioning with it (against the default and 2048-token prefill steps).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
python -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" > /dev/null 2>&1
for a in default g8192 default g8192 default g8192; do python docs/bench/runs/startup_time.py /tmp/ck3b $a 2>&1 | grep ready; done | tee $OUT/startup.txt
python docs/bench/runs/caption_host_budget.py /tmp/ck3b 1024 bf16,bf16:g8192,bf16:p2048,bf16,bf16:g8192,fp8,fp8:g8192 512 2>&1 | grep -v -i warn | tee $OUT/host_budget.txt | grep -E "images/s|GPU busy|prefill graphs"
