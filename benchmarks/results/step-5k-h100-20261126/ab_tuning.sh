# A/B of the convolution's tuning knobs on the whole 5k step (one GPU call)
source .device/base/env.sh
for cfg in "" "CGFORGE_LOOP_ORDER=edges" "CGFORGE_BACKWARD_CHUNK=128" "CGFORGE_LOOP_ORDER=edges CGFORGE_BACKWARD_CHUNK=128" "CGFORGE_BACKWARD_CHUNK=32" "CGFORGE_FORWARD_CHUNK=64"; do
  tag=$(echo "${cfg:-default}" | tr ' =' '_-')
  env $cfg python3 benchmarks/bench_md.py --systems 5k --models mace-mp-medium,nequip-M --dtypes float32 --backends cgforge --steps 20 --warmup 3 --nvt-only --profile > $OUT/tune-$tag.log 2>&1
  echo "== ${cfg:-default}"
  grep -E "^ +[0-9.]+ +cgf_[0-9a-f]+_c" $OUT/tune-$tag.log | head -12
  grep -E "^5k " $OUT/tune-$tag.log
done
