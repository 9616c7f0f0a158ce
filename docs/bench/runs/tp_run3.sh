#!/usr/bin/env bash
# Four GPUs: the tensor-parallel GPU tests (TP ViT, FP8 under TP), ViT data/tensor/rank0 figures,
# `mmpipe caption` of 1024 files with --tp 2 (each ViT mode) and --gpus 4 --tp 2.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi -L | tee $OUT/gpu.txt
python3 -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" > $OUT/ckpt.log 2>&1 &
CK=$!
timeout 260 python3 -m pytest -m gpu -q -p no:cacheprovider -s tests/gpu/test_gpu_tensor_parallel.py 2>&1 \
  | grep -v Warn | tee $OUT/tp_tests.log | tail -15
wait $CK
timeout 130 python3 docs/bench/tp_figures.py vit /tmp/ck3b 2>&1 | grep -v Warn | tee $OUT/tp_vit.txt | tail -6
for a in "--tp 2" "--tp 2 --vit-parallel tensor" "--gpus 4 --tp 2"; do
  echo "== $a" >> $OUT/caption.txt
  timeout 45 python3 -m mmpipe.app.bench startup --checkpoint /tmp/ck3b --workdir /tmp/wd --cache-root /tmp/cr \
    --runs "" --caption 1024 --caption-args="$a" 2>&1 | tail -3 | tee -a $OUT/caption.txt
  head -c 600 /tmp/wd/errors1024.jsonl >> $OUT/caption.txt; echo >> $OUT/caption.txt
done
