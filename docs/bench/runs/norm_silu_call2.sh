# The quantizers' reciprocal and one-pass rows (issue 31), this tree against .old (f933188):
# kernel microseconds, captioning 1024 files in fp8-all (processes alternating new, old, new, old),
# the kernels' GPU tests.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
nvidia-smi --query-gpu=name --format=csv,noheader
python -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" > $OUT/build.txt 2>&1 &
timeout 50 env PYTHONPATH=$PWD/.old python docs/bench/runs/norm_silu_sweep.py > $OUT/sweep_old.txt 2>&1
echo old rc $?; grep -v Warn $OUT/sweep_old.txt
timeout 120 python docs/bench/runs/norm_silu_sweep.py > $OUT/sweep_new.txt 2>&1
echo new rc $?; grep -v Warn $OUT/sweep_new.txt
wait
for i in 1 2; do
  for tree in new old; do
    [ $tree = old ] && P=$PWD/.old || P=$PWD
    [ $tree$i = new1 ] && BUSY=512 || BUSY=0
    timeout 90 env PYTHONPATH=$P KERNELS=8 python docs/bench/runs/caption_host_budget.py /tmp/ck3b 1024 fp8-all $BUSY > $OUT/caption_${tree}_$i.txt 2>&1
    echo "$tree $i rc $?"; grep -E "images/s|GPU busy|ms/image  " $OUT/caption_${tree}_$i.txt
  done
done
timeout 170 python -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_gpu_fused.py tests/gpu/test_gpu_fp8.py \
  -k "fused or quantizer or norm_writes or silu_product or fused_activation or fp8_layer_on_cuda or few_row" > $OUT/pytest.txt 2>&1
echo pytest rc $?; tail -1 $OUT/pytest.txt; grep -E "^(FAILED|ERROR)" $OUT/pytest.txt | head -10
