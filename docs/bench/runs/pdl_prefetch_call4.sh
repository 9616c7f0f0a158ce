# The decode FP8 GEMM's GPU tests with the prefetch (7ed6121); caption CLI 64 files with and without the
# accelerate import (323cc08 vs the same tree with its _process_state change undone); FP8 captioning with prefetch on/off.
export PYTHONUNBUFFERED=1 R=$PWD PYTHONPATH=$PWD
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
nvidia-smi --query-gpu=name --format=csv,noheader
(python -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" >/tmp/ck.log 2>&1; python -c "from mmpipe.app.bench.caption import write_jpegs; write_jpegs('/tmp/j', 64)"; echo data-done) &
timeout 170 python -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_gpu_fp8.py -k "triton or fused_activation or silu_product" > $OUT/pytest.txt 2>&1
echo pytest rc $?; tail -1 $OUT/pytest.txt; grep -E "^(FAILED|ERROR)" $OUT/pytest.txt | head -10
wait
rm -rf $R/.old && mkdir $R/.old && cp -r $R/mmpipe $R/vision $R/language $R/app $R/pyproject.toml $R/.old/
python - <<'PY'
p = ".old/app/caption.py"; s = open(p).read()
a = "    if not launched():\n        return SingleProcess()\n"; assert a in s; open(p, "w").write(s.replace(a, ""))
PY
export TRITON_CACHE_DIR=/tmp/tc MMPIPE_CACHE_DIR=/tmp/mc
CAP="python -m mmpipe.cli caption --model /tmp/ck3b --format jsonl --max-new-tokens 64 --min-new-tokens 64 --quiet"
tree() { [ $1 = old ] && echo $R/.old || echo $R; }
for T in new old; do (cd $(tree $T) && PYTHONPATH=$(tree $T) $CAP /tmp/j --output /tmp/w.jsonl >/dev/null 2>&1); rm -f /tmp/w.jsonl; done
TIMEFORMAT="wall %R user %U sys %S"
for i in 1 2 3; do for T in new old; do
  rm -f /tmp/o.jsonl; echo -n "$T 64 files: "
  { time (cd $(tree $T) && PYTHONPATH=$(tree $T) $CAP /tmp/j --output /tmp/o.jsonl >/dev/null 2>&1) ; } 2>&1 | tr '\n' ' '; echo " lines $(wc -l < /tmp/o.jsonl)"
done; done
python -X importtime -c "import accelerate" 2> /tmp/imp.txt; tail -1 /tmp/imp.txt
MMPIPE_PDL_PREFETCH=1 timeout 150 python docs/bench/runs/fp8_caption_ab.py /tmp/ck3b 1024 bf16,fp8:on,fp8:off 2 > $OUT/cap_pf1.txt 2>&1; echo rc $?; grep images/s $OUT/cap_pf1.txt
MMPIPE_PDL_PREFETCH=0 timeout 70 python docs/bench/runs/fp8_caption_ab.py /tmp/ck3b 1024 fp8:on 2 > $OUT/cap_pf0.txt 2>&1; echo rc $?; grep images/s $OUT/cap_pf0.txt
