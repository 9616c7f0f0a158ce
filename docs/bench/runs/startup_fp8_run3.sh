export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
env | grep -i PYTHON; python -c "import sys; print('dont_write_bytecode', sys.flags.dont_write_bytecode, sys.pycache_prefix)"; ls -ld /opt/torch/.venv/lib/python3.12/site-packages/torch/__pycache__ 2>&1 | head -2; ls /opt/torch/.venv/lib/python3.12/site-packages/torch/__pycache__ 2>/dev/null | head -3
python docs/bench/runs/fp8_gemv_sweep.py qkv o 2>&1 | grep -v Warning | grep -v "^  " 
python -m pytest -q -m gpu tests/gpu/test_gpu_fp8.py tests/unit/test_gemv.py tests/gpu/test_gpu_startup.py 2>&1 | tail -3
python3 -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" >/dev/null 2>&1
python3 -c "from mmpipe.app.bench.caption import write_jpegs; write_jpegs('/tmp/one',1)"
export PYTHONPYCACHEPREFIX=/tmp/pyc
B="python -m mmpipe.app.bench startup --checkpoint /tmp/ck3b --workdir /tmp/ws"
F='^\| (fresh|second|64) |^start-up [0-9]'
echo "== new fresh"; $B --cache-root /tmp/cN --runs fresh --caption "" 2>&1 | grep -E "$F"
echo "== old fresh"; $B --tree .old --cache-root /tmp/cO --runs fresh --caption "" 2>&1 | grep -E "$F"
for i in 1 2 3; do
c=""; [ $i = 3 ] && c=64
echo "== new second $i"; $B --cache-root /tmp/cN --runs second --caption "$c" 2>&1 | grep -E "$F"
echo "== old second $i"; $B --tree .old --cache-root /tmp/cO --runs second --caption "$c" 2>&1 | grep -E "$F"
done
export TRITON_CACHE_DIR=/tmp/cN/triton TORCHINDUCTOR_CACHE_DIR=/tmp/cN/inductor MMPIPE_CACHE_DIR=/tmp/cN/mmpipe
python - <<'PY'
import sys
sys.argv = ["x", "/tmp/ck3b", "/tmp/one/img00000.jpg"]
exec(open("docs/bench/runs/dynamo_probe.py").read())
print("sympy imported:", "sympy" in sys.modules, "transformers:", "transformers" in sys.modules)
PY
