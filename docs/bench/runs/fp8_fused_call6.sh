export PYTHONUNBUFFERED=1 R=$PWD PYTHONPATH=$PWD
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
nvidia-smi --query-gpu=name --format=csv,noheader
(ls /tmp/ck3b/config.json >/dev/null 2>&1 || python3 -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" >/tmp/ck.log 2>&1; python -c "import sys; sys.path.insert(0,'docs/bench'); from fp8_figures import write_fp8; write_fp8('/tmp/ck3b','/tmp/ck3b_block','block')" > /tmp/blk.log 2>&1; echo block-ckpt-done) &
timeout 150 python -m pytest -q -m gpu tests/gpu/test_gpu_fp8.py tests/gpu/test_gpu_fused.py -p no:cacheprovider > $OUT/pytest6.txt 2>&1; tail -4 $OUT/pytest6.txt; grep "^FAILED" $OUT/pytest6.txt | head
timeout 40 python docs/bench/runs/group_quant_bench.py 2>&1 | tail -7
wait
tail -2 /tmp/blk.log
timeout 80 python docs/bench/runs/fp8_fused_ab.py /tmp/ck3b forward /tmp/ck3b_block > $OUT/ab_block.txt 2>&1; tail -4 $OUT/ab_block.txt
