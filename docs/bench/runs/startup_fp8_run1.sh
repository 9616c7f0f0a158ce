set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
python -m pytest -q -m gpu tests/gpu/test_gpu_attention.py tests/gpu/test_gpu_startup.py 2>&1 | tail -4
python3 -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" >/dev/null 2>&1
python3 -c "from mmpipe.app.bench.caption import write_jpegs; write_jpegs('/tmp/one',1)"
export TRITON_CACHE_DIR=/tmp/cP/triton TORCHINDUCTOR_CACHE_DIR=/tmp/cP/ind MMPIPE_CACHE_DIR=/tmp/cP/mm
echo "== probe new (fills caches)"; python docs/bench/runs/dynamo_probe.py /tmp/ck3b /tmp/one/img00000.jpg 2>&1 | grep -v Writing | tail -30
echo "== probe new (second)"; python docs/bench/runs/dynamo_probe.py /tmp/ck3b /tmp/one/img00000.jpg 2>&1 | grep -v Writing | tail -30
unset TRITON_CACHE_DIR TORCHINDUCTOR_CACHE_DIR MMPIPE_CACHE_DIR
B="python -m mmpipe.app.bench startup --checkpoint /tmp/ck3b --workdir /tmp/ws"
echo "== old fresh"; $B --tree .old --cache-root /tmp/cOld --runs fresh --caption "" 2>&1 | grep -v Writing | tail -12
for i in 1 2; do
echo "== new second $i"; $B --cache-root /tmp/cP --runs second --caption "$([ $i = 2 ] && echo 64)" 2>&1 | grep -v Writing | tail -12
echo "== old second $i"; $B --tree .old --cache-root /tmp/cOld --runs second --caption "$([ $i = 2 ] && echo 64)" 2>&1 | grep -v Writing | tail -12
done
