# The committed quantizer rule (6262030) against .old (f933188): fp8 decode ms/step, captioning
# 1024 files in fp8-all (processes alternating new, old, new, old), and one new-tree process with
# PDL off whose traced pass gives kernel GPU ms per image without PDL's waits.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
nvidia-smi --query-gpu=name --format=csv,noheader
python -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" > $OUT/build.txt 2>&1
for tree in new old; do
  [ $tree = old ] && P=$PWD/.old || P=$PWD
  timeout 70 env PYTHONPATH=$P python docs/bench/runs/decode_switch_ab.py /tmp/ck3b 1,8,64,128 fp8 > $OUT/decode_$tree.txt 2>&1
  echo "decode $tree rc $?"; grep -v Warn $OUT/decode_$tree.txt | tail -6
done
timeout 100 env MMPIPE_PDL=0 KERNELS=30 python docs/bench/runs/caption_host_budget.py /tmp/ck3b 1024 fp8-all 512 > $OUT/caption_new_pdl0.txt 2>&1
echo "pdl0 rc $?"; grep -E "images/s|GPU busy|ms/image  " $OUT/caption_new_pdl0.txt | cut -c1-120
for i in 1 2; do
  for tree in new old; do
    [ $tree = old ] && P=$PWD/.old || P=$PWD
    timeout 80 env PYTHONPATH=$P python docs/bench/runs/caption_host_budget.py /tmp/ck3b 1024 fp8-all 0 > $OUT/caption_${tree}_$i.txt 2>&1
    echo "$tree $i rc $?"; grep -E "images/s" $OUT/caption_${tree}_$i.txt
  done
done
