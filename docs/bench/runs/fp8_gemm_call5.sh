export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 280 python -m pytest -q -m gpu tests/gpu/test_gpu_fp8.py tests/gpu/test_gpu_decode_graphs.py -p no:cacheprovider -k "triton or above_the_few_row or fused_activation or every_graph_mode or checkpoint_runs or fp8_all or layer_on_cuda or test_gpu_decode_graphs" > $OUT/pytest5.txt 2>&1; echo pytest rc $?
tail -2 $OUT/pytest5.txt; grep -E "^(FAILED|ERROR)" $OUT/pytest5.txt | head -10
