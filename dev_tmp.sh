python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH TRITON_CACHE_AUTOTUNING=1
timeout 110 python3 tools/time_step.py --out $OUT/next-int4-b1 --steps 20 --kernels --shape qwen3-next-80b-a3b --quantize experts=int4 --layers 8 > $OUT/next-int4-b1.txt 2>&1; echo "== ts rc $?"; head -2 $OUT/next-int4-b1.txt | tail -1; grep -A8 "^kernels:" $OUT/next-int4-b1.txt | cut -c1-120
timeout 90 python3 -m pytest -q -x tests/gpu/test_moe_compact_gpu.py -p no:cacheprovider 2>&1 | tail -4
timeout 200 python3 tools/sweep_moe_compact.py --out $OUT/sweep --shapes next --tokens 1 4 8 17 2>&1 | tee $OUT/sweep.txt | tail -80
