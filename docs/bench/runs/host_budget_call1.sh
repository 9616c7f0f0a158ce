# Device call 1 (2026-11-28): FP8 batch-1 decode kernels (PDL off: kernel times; on: the step),
# and the captioning host budget for fp8-all and bf16 (1024 files) with a py-spy pass.
set -x
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
pip install -q --no-deps .brk/py_spy-*.whl 2>&1 | tail -1
python -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" > /dev/null
for q in fp8 bf16; do MMPIPE_PDL=0 python docs/bench/runs/decode_b1_kernels.py /tmp/ck3b $q 1 2>&1 | grep -v Warn | head -40; done > $OUT/b1_kernels.txt
MMPIPE_PDL=1 python docs/bench/runs/decode_b1_kernels.py /tmp/ck3b fp8 1 2>&1 | head -6 >> $OUT/b1_kernels.txt
cat $OUT/b1_kernels.txt | cut -c1-150
SPY=$(which py-spy) SPY_OUT=$OUT python docs/bench/runs/caption_host_budget.py /tmp/ck3b 1024 fp8-all,bf16 512 2>&1 | tee $OUT/host_budget.txt | cut -c1-1500
