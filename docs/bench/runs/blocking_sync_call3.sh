# Device call 3 (2026-11-28, third session): where HostTokens waits (probe), then captioning 1024
# files with the engine sleeping or spinning while it waits for tokens (images/s, process CPU per
# image), then one traced fp8-all pass with its longest kernels.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
nvidia-smi --query-gpu=name --format=csv,noheader
[ -d /tmp/ck3b ] || python -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" > /dev/null 2>&1
python docs/bench/runs/blocking_sync_probe.py 2>&1 | grep -v -i warn | tee $OUT/probe.txt
python docs/bench/runs/caption_host_budget.py /tmp/ck3b 1024 fp8-all,fp8-all:spin,bf16,bf16:spin,fp8-all:spin,fp8-all 0 2>&1 | grep -v -i warn > $OUT/caption_ab.txt
grep -E "images/s|warm-up" $OUT/caption_ab.txt
KERNELS=30 PASSES=1 python docs/bench/runs/caption_host_budget.py /tmp/ck3b 1024 fp8-all 512 2>&1 | grep -v -i warn > $OUT/caption_kernels.txt
grep -E "images/s|GPU busy|ms/image  " $OUT/caption_kernels.txt
