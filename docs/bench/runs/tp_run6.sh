#!/usr/bin/env bash
# Two GPUs, nothing else running: the FP8-at-load tensor-parallel GPU test, `mmpipe caption` of
# 1024 files at TP=1 and at TP=2 with each ViT mode, then bf16/FP8 at TP=1/TP=2 accuracy and decode.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi -L | tee $OUT/gpu.txt
python3 -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" > $OUT/ckpt.log 2>&1 &
CK=$!
timeout 80 python3 -m pytest -m gpu -q -p no:cacheprovider -s tests/gpu/test_gpu_tensor_parallel.py -k "at-load" 2>&1 \
  | grep -v Warn | grep -E "passed|failed|Error|TP=" | tee $OUT/tp_tests.log
wait $CK
t=75
for a in "" "--tp 2" "--tp 2 --vit-parallel rank0" "--tp 2 --vit-parallel tensor"; do
  echo "== $a" >> $OUT/caption.txt
  timeout $t python3 -m mmpipe.app.bench startup --checkpoint /tmp/ck3b --workdir /tmp/wd --cache-root /tmp/cr \
    --runs "" --caption 1024 --caption-args="$a" 2>&1 | tail -2 | tee -a $OUT/caption.txt
  t=60
done
timeout 140 python3 docs/bench/tp_figures.py fp8 /tmp/ck3b 2>&1 | grep -v Warn | tee $OUT/tp_fp8.txt | tail -4
