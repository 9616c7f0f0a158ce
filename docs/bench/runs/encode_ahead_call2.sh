# Device call 2 (2026-11-28): encode-ahead GPU tests, the vision_ready wait removed on purpose
# (the late-stream test must fail), then captioning fp8-all / bf16 with encode-ahead on and in line.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
python -m pytest -q -m gpu tests/gpu/test_gpu_encode_ahead.py tests/gpu/test_gpu_vision_stream.py tests/gpu/test_gpu_overlap.py -p no:cacheprovider 2>&1 | tail -4 > $OUT/pytest.txt
cp mmpipe/engine/engine.py /tmp/engine.bak
sed -i 's/        self.runner.vision_ready()  # images encoded ahead/        pass  # BROKEN/' mmpipe/engine/engine.py
grep -c BROKEN mmpipe/engine/engine.py >> $OUT/pytest.txt
python -m pytest -q -m gpu tests/gpu/test_gpu_encode_ahead.py -k late -p no:cacheprovider 2>&1 | tail -4 >> $OUT/pytest.txt
cp /tmp/engine.bak mmpipe/engine/engine.py
cat $OUT/pytest.txt
python -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" > /dev/null 2>&1
python docs/bench/runs/caption_host_budget.py /tmp/ck3b 1024 fp8-all:inline,fp8-all,bf16:inline,bf16,fp8-all:inline,fp8-all 512 2>&1 | grep -v -i warn | tee $OUT/host_budget.txt | cut -c1-600
