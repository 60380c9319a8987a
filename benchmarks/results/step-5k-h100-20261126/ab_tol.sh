# step time vs the radial tables' tolerance (table size), one GPU call
source .device/base/env.sh
for tol in 1e-7 1e-6 1e-5; do
python3 - "$tol" > $OUT/tol-$tol.log 2>&1 <<'PY'
import sys, runpy
tol = float(sys.argv[1])
import cgforge.patches.mace.radial_table as m, cgforge.patches.nequip.radial_table as n
m.set_radial_table.__defaults__ = (tol,)
n.set_radial_table.__defaults__ = (tol,)
sys.argv = ["bench_md.py", "--systems", "5k", "--models", "mace-mp-medium,nequip-M", "--dtypes", "float32",
            "--backends", "cgforge", "--steps", "30", "--warmup", "5", "--nvt-only", "--profile"]
sys.path.insert(0, "benchmarks")
runpy.run_path("benchmarks/bench_md.py", run_name="__main__")
PY
echo "== tol $tol"; grep -E "^ +[0-9.]+ +cgf_[0-9a-f]+_c" $OUT/tol-$tol.log | head -8; grep -E "^5k " $OUT/tol-$tol.log
done
