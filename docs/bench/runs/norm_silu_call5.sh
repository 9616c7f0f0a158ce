# After the review mends and the greedy sampler (ef29114): greedy sampling microseconds, captioning
# 1024 files in fp8-all (one process), and the GPU tests of what changed: the quantizers against
# the CPU reference, the sampler, decode graphs, parity with transformers, the other families, ViT graphs.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
nvidia-smi --query-gpu=name --format=csv,noheader
python -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" > $OUT/build.txt 2>&1 &
timeout 40 python docs/bench/runs/greedy_sample_ab.py > $OUT/greedy.txt 2>&1; echo greedy rc $?; grep -v Warn $OUT/greedy.txt
timeout 150 python -m pytest -q -p no:cacheprovider tests/unit/test_sampler.py tests/gpu/test_gpu_decode_graphs.py \
  "tests/gpu/test_gpu_fp8.py::test_the_quantizer_kernel_equals_pytorch_bit_for_bit" \
  "tests/gpu/test_gpu_fp8.py::test_the_group_quantizer_kernel_equals_pytorch_bit_for_bit" > $OUT/pytest_a.txt 2>&1
echo pytest a rc $?; tail -1 $OUT/pytest_a.txt; grep -E "^(FAILED|ERROR)" $OUT/pytest_a.txt | head
wait
timeout 80 python docs/bench/runs/caption_host_budget.py /tmp/ck3b 1024 fp8-all 0 > $OUT/caption.txt 2>&1
echo caption rc $?; grep images/s $OUT/caption.txt
timeout 130 python -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_gpu_parity.py tests/gpu/test_gpu_decode.py > $OUT/pytest_b.txt 2>&1
echo pytest b rc $?; tail -1 $OUT/pytest_b.txt; grep -E "^(FAILED|ERROR)" $OUT/pytest_b.txt | head
timeout 110 python -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_gpu_families.py tests/gpu/test_gpu_vit_graphs.py > $OUT/pytest_c.txt 2>&1
echo pytest c rc $?; tail -1 $OUT/pytest_c.txt; grep -E "^(FAILED|ERROR)" $OUT/pytest_c.txt | head
