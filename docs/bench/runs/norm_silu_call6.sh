# The greedy sampler without the float32 copy (56f66ca; this tree) against 7c5f150 (.old: the
# FP8 quantizer change, the sampler as before): captioning 1024 files in fp8-all, processes
# alternating new, old, new, old; fp8 decode ms/step at batch 1 and 8 per tree.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
nvidia-smi --query-gpu=name --format=csv,noheader
python -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" > $OUT/build.txt 2>&1
for i in 1 2; do
  for tree in new old; do
    [ $tree = old ] && P=$PWD/.old || P=$PWD
    timeout 75 env PYTHONPATH=$P python docs/bench/runs/caption_host_budget.py /tmp/ck3b 1024 fp8-all 0 > $OUT/caption_${tree}_$i.txt 2>&1
    echo "$tree $i rc $?"; grep -E "images/s" $OUT/caption_${tree}_$i.txt
  done
done
for tree in new old; do
  [ $tree = old ] && P=$PWD/.old || P=$PWD
  timeout 40 env PYTHONPATH=$P python docs/bench/runs/decode_switch_ab.py /tmp/ck3b 1,8 fp8 > $OUT/decode_$tree.txt 2>&1
  echo "decode $tree rc $?"; grep -v Warn $OUT/decode_$tree.txt | tail -1
done
