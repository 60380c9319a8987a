# the auto loop order vs segments on the whole 5k step, and an eager profile with input shapes (one GPU call)
source .device/base/env.sh
which ncu nsys 2>&1 | head -2
for cfg in "CGFORGE_LOOP_ORDER=segments" ""; do
  tag=$(echo "${cfg:-auto}" | tr ' =' '_-')
  env $cfg python3 benchmarks/bench_md.py --systems 5k --models mace-mp-medium,nequip-M --dtypes float32 --backends cgforge --steps 30 --warmup 5 --nvt-only > $OUT/loop-$tag.log 2>&1
  echo "== ${cfg:-auto}"; grep -E "^5k " $OUT/loop-$tag.log
done
python3 benchmarks/bench_md.py --systems 5k --models mace-mp-medium --dtypes float32 --backends cgforge-eager --steps 3 --warmup 2 --nvt-only --profile > $OUT/eager-profile.log 2>&1
grep -E "^5k " $OUT/eager-profile.log
