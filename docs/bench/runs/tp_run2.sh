#!/usr/bin/env bash
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi -L | tee $OUT/gpu.txt
( python3 -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b'); b('/tmp/ck7b', '7b')" > $OUT/ckpt.log 2>&1 ) &
CK=$!
timeout 140 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_gpu_tensor_parallel.py 2>&1 | tee $OUT/tp_tests.log | tail -12
wait $CK
timeout 150 python3 docs/bench/tp_figures.py /tmp/ck7b /tmp/ck3b 2>&1 | grep -v Warn | tee $OUT/tp_figures.txt | tail -6
for a in "--tp 2" "--tp 2 --vit-parallel rank0"; do
  timeout 45 python3 -m mmpipe.app.bench startup --checkpoint /tmp/ck3b --workdir /tmp/wd --cache-root /tmp/cr --runs "" --caption 1024 --caption-args="$a" 2>&1 | tail -4 | tee -a $OUT/caption.txt
done
