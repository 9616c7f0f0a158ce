export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
(python3 -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" >/tmp/ck.log 2>&1; echo built > /tmp/ck.done) &
timeout 230 python -m pytest -q -m gpu tests/gpu/test_gpu_parity.py tests/gpu/test_gpu_families.py 2>&1 | tail -3
while [ ! -f /tmp/ck.done ]; do sleep 2; done
timeout 160 python docs/bench/fp8_probe.py /tmp/ck3b decode-only 2>&1 | grep -v Writing
