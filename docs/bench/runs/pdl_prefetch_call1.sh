# PDL weight prefetch (issue 31, batch-1 decode): GPU tests, a deliberately broken kernel, decode A/B and profile.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
nvidia-smi --query-gpu=name --format=csv,noheader
python -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" > $OUT/build.txt 2>&1 &
timeout 200 python -m pytest -q -m gpu -p no:cacheprovider tests/unit/test_pdl.py tests/unit/test_gemv.py \
  tests/gpu/test_gpu_fp8.py -k "pdl or test_gemv or few_row or triton or layers_take" > $OUT/pytest1.txt 2>&1
echo pytest rc $?; tail -2 $OUT/pytest1.txt; grep -E "^(FAILED|ERROR)" $OUT/pytest1.txt | head -10
# Break on purpose: the one-row kernel reads its input (written by the kernel before) before the wait.
rm -rf /tmp/broken && mkdir /tmp/broken && cp -r mmpipe tests pyproject.toml vision language app /tmp/broken/ 2>/dev/null
python - <<'PY'
p = "/tmp/broken/mmpipe/kernels/gemv.py"
s = open(p).read()
a = "        if PREFETCH:\n            pdl_enter(PDL)\n        acc = _row_tile(tl.zeros([BLOCK_N], dtype=tl.float32), w, x_ptr, s_ptr, k0, K, rk, stride_s, GATED, SCALE,\n                        BLOCK_N)\n"
assert a in s
s = s.replace(a, "        acc = _row_tile(tl.zeros([BLOCK_N], dtype=tl.float32), w, x_ptr, s_ptr, k0, K, rk, stride_s, GATED, SCALE,\n                        BLOCK_N)\n        if PREFETCH:\n            pdl_enter(PDL)\n")
open(p, "w").write(s)
PY
(cd /tmp/broken && PYTHONPATH=/tmp/broken timeout 90 python -m pytest -q -m gpu -p no:cacheprovider tests/unit/test_pdl.py -k "graph" > $OUT/pytest_broken.txt 2>&1; echo broken rc $?; tail -2 $OUT/pytest_broken.txt; grep -E "^FAILED" $OUT/pytest_broken.txt | head)
wait; tail -2 $OUT/build.txt
timeout 330 python docs/bench/runs/pdl_prefetch_ab.py /tmp/ck3b 1,8,32,64,128 fp8:0,fp8:1,bf16:0,bf16:1,fp8:0,fp8:1 --profile 1 > $OUT/ab.txt 2>&1
echo ab rc $?; grep -v "^  " $OUT/ab.txt | grep -v Warn | tail -30
