# One-pass FP8 SiLU product (issue 31): GPU tests, kernel microseconds, captioning A/B.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
nvidia-smi --query-gpu=name --format=csv,noheader
python -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" > $OUT/build.txt 2>&1 &
timeout 120 python -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_gpu_fp8.py -k "silu_product or fused_activation" > $OUT/pytest.txt 2>&1
echo pytest rc $?; tail -1 $OUT/pytest.txt; grep -E "^(FAILED|ERROR)" $OUT/pytest.txt | head -10
wait
timeout 330 python docs/bench/runs/silu_quant_ab.py /tmp/ck3b 1024 fp8-all:two,fp8-all:one,fp8-all:two,fp8-all:one 2 > $OUT/ab.txt 2>&1
echo ab rc $?; cat $OUT/ab.txt | grep -v Warn
