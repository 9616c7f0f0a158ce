#!/usr/bin/env bash
# One device call: the FP8 GPU tests, then the FP8 figures (3B shape, random weights; the bundled model).
set -o pipefail
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)" | tee -a $OUT/gpu.txt
python3 -m pytest --version >> $OUT/gpu.txt 2>&1
( python3 -c "from mmpipe.app.bench.shapes import build_checkpoint; build_checkpoint('/tmp/ck3b')" > $OUT/ckpt.log 2>&1 ) &
CK=$!
timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_gpu_fp8.py tests/unit/test_fp8_checkpoints.py tests/unit/test_fp8_runtime.py 2>&1 | tee $OUT/tests_fp8.log | tail -25
wait $CK
timeout 90 python3 docs/bench/fp8_figures.py bundled /tmp/wb 2>&1 | grep -v Warning | tee $OUT/fp8_bundled.jsonl
timeout 280 python3 docs/bench/fp8_figures.py /tmp/ck3b /tmp/w3b 2>&1 | grep -v Warning | tee $OUT/fp8_3b.jsonl
