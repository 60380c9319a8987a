# EXPERIMENT: backward min blocks and smem carveout, one GPU call
source .device/base/env.sh
for cfg in "" "CGFORGE_CARVEOUT=100" "CGFORGE_BACKWARD_MIN_BLOCKS=5" "CGFORGE_BACKWARD_MIN_BLOCKS=5 CGFORGE_CARVEOUT=100"; do
  tag=$(echo "${cfg:-base}" | tr ' =' '_-')
  env $cfg python3 benchmarks/bench_md.py --systems 5k --models mace-mp-medium,nequip-M --dtypes float32 --backends cgforge --steps 30 --warmup 5 --nvt-only --profile > $OUT/occ-$tag.log 2>&1
  echo "== ${cfg:-base}"; grep -E "^ +[0-9.]+ +cgf_[0-9a-f]+_c" $OUT/occ-$tag.log | head -8; grep -E "^5k " $OUT/occ-$tag.log
done
