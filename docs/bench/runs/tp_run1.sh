#!/usr/bin/env bash
# One 2-GPU device call: NCCL smoke test, the tensor-parallel GPU tests, the TP figures (7B decode /
# TTFT, collectives, 3B float32 agreement), captioning 1024 files with --tp 2 (vision data / rank0)
# and without.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi -L | tee $OUT/gpu.txt
env | grep -E "NCCL|MULTICAST|NVSHMEM" >> $OUT/gpu.txt
( python3 -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b'); b('/tmp/ck7b', '7b')" > $OUT/ckpt.log 2>&1 ) &
CK=$!
timeout 60 python3 -c "from docs.bench.tp_figures import collectives; print(collectives(3584, 152064))" 2>&1 | tee $OUT/smoke.log | tail -5
grep -q all_reduce_us $OUT/smoke.log || { echo SMOKE FAILED; kill $CK; exit 1; }
timeout 170 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_gpu_tensor_parallel.py 2>&1 | tee $OUT/tp_tests.log | tail -15
wait $CK
timeout 220 python3 docs/bench/tp_figures.py /tmp/ck7b /tmp/ck3b 2>&1 | grep -v Warn | tee $OUT/tp_figures.txt | tail -8
for a in "" "--tp 2" "--tp 2 --vit-parallel rank0"; do
  timeout 75 python3 -m mmpipe.app.bench startup --checkpoint /tmp/ck3b --workdir /tmp/wd --cache-root /tmp/cr --runs "" --caption 1024 --caption-args="$a" 2>&1 | tail -4 | tee -a $OUT/caption.txt
done
