# Norm / FP8 SiLU-product layouts and the quantizers' reciprocal (issue 31): kernel sweep on this
# tree and the old one (.old = HEAD before the change), the kernels' GPU tests.
# (It ran an uncommitted tree: a 2-D norm / SiLU kernel with rows per program and a version of
# norm_silu_sweep.py that swept those layouts and wrote the fastest to $OUT/layouts.json. Neither
# was kept; the committed sweep takes no argument. Raw output: norm_silu_rows_per_program_h200_call1.txt.)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 60 env PYTHONPATH=$PWD/.old python docs/bench/runs/norm_silu_sweep.py > $OUT/sweep_old.txt 2>&1
echo old rc $?; grep -v Warn $OUT/sweep_old.txt
timeout 260 python docs/bench/runs/norm_silu_sweep.py $OUT/layouts.json > $OUT/sweep_new.txt 2>&1
echo new rc $?; grep -v Warn $OUT/sweep_new.txt | cut -c1-400
timeout 200 python -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_gpu_fused.py tests/gpu/test_gpu_fp8.py \
  -k "fused or quantizer or norm_writes or silu_product or fused_activation or fp8_layer_on_cuda or few_row" > $OUT/pytest.txt 2>&1
echo pytest rc $?; tail -1 $OUT/pytest.txt; grep -E "^(FAILED|ERROR)" $OUT/pytest.txt | head -10
