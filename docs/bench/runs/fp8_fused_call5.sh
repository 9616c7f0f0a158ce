export PYTHONUNBUFFERED=1 R=$PWD PYTHONPATH=$PWD
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
nvidia-smi --query-gpu=name --format=csv,noheader
ls /tmp/ck3b/config.json >/dev/null 2>&1 || python3 -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" >/tmp/ck.log 2>&1 &
python -c "from mmpipe.app.bench.caption import write_jpegs; write_jpegs('/tmp/j512', 512)"
wait
timeout 330 python docs/bench/runs/prefill_graph_sizes_ab.py /tmp/ck3b /tmp/j512 fp8-all,bf16 2>&1 | grep -v "Warning\|warn" | tail -12
