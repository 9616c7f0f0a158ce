#!/usr/bin/env bash
# Four GPUs: single-GPU regression tests on GPUs 2 and 3 (beside the rest), `mmpipe caption --tp 2`
# of 1024 files with each ViT mode on GPUs 0-1, then FP8 at TP=1 vs TP=2.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi -L | tee $OUT/gpu.txt
( CUDA_VISIBLE_DEVICES=2 timeout 420 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_gpu_parity.py \
    tests/gpu/test_gpu_decode_graphs.py tests/gpu/test_gpu_vit_graphs.py > $OUT/regress_a.log 2>&1 ) &
( CUDA_VISIBLE_DEVICES=3 timeout 420 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_gpu_fp8.py \
    tests/gpu/test_gpu_prefill_graphs.py tests/gpu/test_gpu_families.py > $OUT/regress_b.log 2>&1 ) &
python3 -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" > $OUT/ckpt.log 2>&1
for a in "--tp 2" "--tp 2 --vit-parallel rank0" "--tp 2 --vit-parallel tensor"; do
  echo "== $a" >> $OUT/caption.txt
  CUDA_VISIBLE_DEVICES=0,1 timeout 100 python3 -m mmpipe.app.bench startup --checkpoint /tmp/ck3b --workdir /tmp/wd \
    --cache-root /tmp/cr --runs "" --caption 1024 --caption-args="$a" 2>&1 | tail -2 | tee -a $OUT/caption.txt
done
CUDA_VISIBLE_DEVICES=0,1 timeout 120 python3 docs/bench/tp_figures.py fp8 /tmp/ck3b 2>&1 | grep -v Warn | tee $OUT/tp_fp8.txt | tail -3
wait
tail -3 $OUT/regress_a.log $OUT/regress_b.log
