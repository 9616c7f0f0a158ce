# One-pass FP8 SiLU product limited to decode batches and rows of <= 4096 columns: captioning A/B, 2 passes, the order reversed from call 5.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
nvidia-smi --query-gpu=name --format=csv,noheader
python -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" > $OUT/build.txt 2>&1
timeout 200 python docs/bench/runs/silu_quant_ab.py /tmp/ck3b 1024 fp8-all:one,fp8-all:two,fp8-all:one,fp8-all:two 2 > $OUT/ab.txt 2>&1
echo ab rc $?; cat $OUT/ab.txt | grep -v Warn
