#!/usr/bin/env bash
# Two GPUs: the vision-mode GPU tests (worker ViT runs reported), ViT data/tensor/rank0 figures with
# a profile of the tensor-parallel tower, then the 7B TP=1/TP=2 figures and the 3B float32 agreement.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi -L | tee $OUT/gpu.txt
python3 -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b'); b('/tmp/ck7b', '7b')" > $OUT/ckpt.log 2>&1 &
CK=$!
timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider -s tests/gpu/test_gpu_tensor_parallel.py \
  -k "other_vision_modes" 2>&1 | grep -v Warn | tee $OUT/tp_tests.log | tail -8
wait $CK
timeout 190 python3 docs/bench/tp_figures.py vit /tmp/ck3b 2>&1 | grep -v Warn | tee $OUT/tp_vit.txt | cut -c1-1500
timeout 230 python3 docs/bench/tp_figures.py /tmp/ck7b /tmp/ck3b 2>&1 | grep -v Warn | tee $OUT/tp_figures.txt | tail -5
