# PDL (issue 31): where the prefetched load sits in the compiled kernel; trigger-before-wait A/B; 7B decode figures.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
nvidia-smi --query-gpu=name --format=csv,noheader
python -c "
from mmpipe.app.bench.shapes import build_checkpoint as b
import time; t = time.time(); b('/tmp/ck3b'); print('3b built', time.time() - t, flush=True)
b('/tmp/ck7b', '7b'); print('7b built', time.time() - t, flush=True)" > $OUT/build.txt 2>&1 &
timeout 60 python docs/bench/runs/pdl_order_probe.py > $OUT/order.txt 2>&1; cat $OUT/order.txt | tail -8
MMPIPE_PDL_EARLY_TRIGGER=1 timeout 60 python docs/bench/runs/pdl_order_probe.py 2>&1 | tail -4
while ! grep -q "3b built" $OUT/build.txt; do sleep 2; done
for early in 0 1; do
  MMPIPE_PDL_EARLY_TRIGGER=$early timeout 150 python docs/bench/runs/pdl_prefetch_ab.py /tmp/ck3b 1,8,32,128 fp8:1,bf16:1,fp8:0 > $OUT/ab_early$early.txt 2>&1
  echo early $early rc $?; grep -E "^[a-z0-9:]+ +b1 " $OUT/ab_early$early.txt
done
MMPIPE_PDL_EARLY_TRIGGER=0 timeout 60 python docs/bench/runs/pdl_prefetch_ab.py /tmp/ck3b 1,8,32 fp8:1 > $OUT/ab_early0_again.txt 2>&1
grep -E "^[a-z0-9:]+ +b1 " $OUT/ab_early0_again.txt
wait; cat $OUT/build.txt | grep built
timeout 200 python docs/bench/runs/pdl_prefetch_ab.py /tmp/ck7b 1,8,32,128 fp8:1,bf16:1 > $OUT/ab_7b.txt 2>&1
echo 7b rc $?; grep -E "decode batch   1|^[a-z0-9:]+ +b1 " $OUT/ab_7b.txt
