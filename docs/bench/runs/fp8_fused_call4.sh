export PYTHONUNBUFFERED=1 R=$PWD PYTHONPATH=$PWD
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
nvidia-smi --query-gpu=name --format=csv,noheader
ls /tmp/ck3b/config.json >/dev/null 2>&1 || python3 -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" >/tmp/ck.log 2>&1 &
ls /tmp/wd/images >/dev/null 2>&1 || python -c "from mmpipe.app.bench.caption import write_jpegs; write_jpegs('/tmp/wd/images', 320)"
wait
for Q in fp8-all bf16; do timeout 200 python docs/bench/runs/host_blocking.py /tmp/ck3b /tmp/wd/images $Q 256 > $OUT/host_$Q.txt 2>&1; grep -v "USDT\|Warning\|warn" $OUT/host_$Q.txt | tail -48; done
