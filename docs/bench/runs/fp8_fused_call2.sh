export PYTHONUNBUFFERED=1 R=$PWD PYTHONPATH=$PWD
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
nvidia-smi --query-gpu=name --format=csv,noheader; ls /tmp/ck3b >/dev/null 2>&1 && echo ck-present
(ls /tmp/ck3b/config.json >/dev/null 2>&1 || python3 -c "from mmpipe.app.bench.shapes import build_checkpoint as b; b('/tmp/ck3b')" >/tmp/ck.log 2>&1; echo ck-done) &
timeout 300 python -m pytest -q -m gpu tests/gpu/test_gpu_fp8.py tests/gpu/test_gpu_fused.py tests/gpu/test_gpu_transfer.py tests/gpu/test_gpu_patchify.py tests/gpu/test_gpu_decode.py tests/gpu/test_gpu_decode_graphs.py tests/gpu/test_gpu_parity.py -p no:cacheprovider > $OUT/pytest2.txt 2>&1; tail -6 $OUT/pytest2.txt
wait
timeout 270 python -m mmpipe.app.bench caption --checkpoint /tmp/ck3b --images 1024 --hf-images "" --quantizations fp8,fp8-all --workdir /tmp/wd > $OUT/caption.txt 2>&1; grep -v "^ *$" $OUT/caption.txt | head -30
