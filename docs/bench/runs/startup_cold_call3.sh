export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
test -d /tmp/ck3b || python3 -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" >/tmp/ck.log 2>&1
python -c "
from PIL import Image; import numpy as np
Image.fromarray(np.random.default_rng(0).integers(0,255,(448,448,3),dtype=np.uint8)).save('/tmp/first.jpg')"
echo "== fresh profile"
TRITON_CACHE_DIR=/tmp/fp/triton MMPIPE_CACHE_DIR=/tmp/fp/mmpipe TORCHINDUCTOR_CACHE_DIR=/tmp/fp/ind python docs/bench/runs/startup_profile.py /tmp/ck3b /tmp/first.jpg > $OUT/profile_fresh.txt 2>&1; grep -E "^import|^to first" $OUT/profile_fresh.txt
for t in new old new old; do
  echo "== decode $t"
  if [ $t = new ]; then python docs/bench/fp8_probe.py /tmp/ck3b decode-only 2>&1 | grep -E "decode|floor|copy"; else (cd .old && PYTHONPATH=$PWD python ../docs/bench/fp8_probe.py /tmp/ck3b decode-only 2>&1 | grep -E "decode|floor|copy"); fi
done
