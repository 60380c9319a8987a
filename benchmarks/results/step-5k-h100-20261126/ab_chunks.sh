# the chunks loop order (edges outermost per channel chunk) vs auto, one GPU call
source .device/base/env.sh
python3 -m pytest -m cuda -q -p no:cacheprovider tests/test_kernels_cuda.py -k "loop_order" 2>&1 | tail -1
for cfg in "" "CGFORGE_LOOP_ORDER=chunks CGFORGE_FORWARD_CHUNK=64" "CGFORGE_LOOP_ORDER=chunks CGFORGE_FORWARD_CHUNK=64 CGFORGE_BACKWARD_CHUNK=32"; do
  tag=$(echo "${cfg:-auto}" | tr ' =' '_-')
  env $cfg python3 benchmarks/bench_md.py --systems 5k --models mace-mp-medium,nequip-M --dtypes float32 --backends cgforge --steps 30 --warmup 5 --nvt-only --profile > $OUT/chunks-$tag.log 2>&1
  echo "== ${cfg:-auto}"; grep -E "^ +[0-9.]+ +cgf_[0-9a-f]+_c" $OUT/chunks-$tag.log | head -8; grep -E "^5k " $OUT/chunks-$tag.log
done
