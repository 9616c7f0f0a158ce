export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python docs/bench/runs/fp8_gemv_sweep.py 2>&1 | grep -v Warning
python3 -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" >/dev/null 2>&1
python3 -c "from mmpipe.app.bench.caption import write_jpegs; write_jpegs('/tmp/one',1)"
python docs/bench/runs/dynamo_probe.py /tmp/ck3b /tmp/one/img00000.jpg 2>&1 | grep -v Writing | tail -3
python docs/bench/runs/startup_profile.py /tmp/ck3b /tmp/one/img00000.jpg 2>&1 | grep -v Writing | cut -c1-220 | head -130
