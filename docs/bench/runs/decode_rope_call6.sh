# After the review: the fused decode tests with NaN in the new slots, Qwen3's head norm with the
# tightened bf16 bounds (figures printed), the compiled-order test under the device's Triton, the
# whole-decode on/off test.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
nvidia-smi --query-gpu=name --format=csv,noheader; python -c "import triton; print('triton', triton.__version__)"
timeout 300 python -m pytest -q -s -p no:cacheprovider -k "decode_with_rope or compiled or backend or rotary" tests/gpu/test_gpu_attention.py tests/unit/test_decode_rope.py tests/gpu/test_gpu_decode_graphs.py -m "gpu or not gpu" > $OUT/pytest.txt 2>&1
echo rc $?; grep -E "passed|failed" $OUT/pytest.txt | tail -1; grep -E "^(FAILED|ERROR)" $OUT/pytest.txt | head; grep "qk norm" $OUT/pytest.txt
